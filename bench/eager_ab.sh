#!/usr/bin/env bash
# One job eager (`--enforce-eager`) against bulkinfer's own compile choice, alternating, ORDER as given
# (default "eager choice": one round); prints each run's wall time, its choice and its report's generation
# figures. Run it alone on the machine; the environment (BULKINFER_HOME, TORCHINDUCTOR_CACHE_DIR) is the runs'.
#
#   bench/eager_ab.sh INPUT.jsonl WORK_DIR [ORDER...] [-- extra run flags]
set -euo pipefail
input=$1 work=$2; shift 2
order=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do order+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#order[@]} -eq 0 ] && order=(eager choice)
bin=${BULKINFER:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/bulkinfer}
py=${PYTHON:-$(dirname "$bin")/python}
mkdir -p "$work"
echo "# $(date -u +%FT%TZ) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)," \
  "$(grep -m1 '^cpu family' /proc/cpuinfo | cut -d: -f2 | xargs)/$(grep -m1 '^model\s' /proc/cpuinfo | cut -d: -f2 | xargs)," \
  "$(nproc) cores; $input; flags: $*"
i=0
for side in "${order[@]}"; do
  i=$((i + 1))
  flag=(); [ "$side" = eager ] && flag=(--enforce-eager)
  out="$work/$i-$side.out.jsonl"
  start=$(date +%s.%N)
  "$bin" run "$input" -o "$out" --overwrite --plain-progress "${flag[@]}" "$@" > "$work/$i-$side.log" 2>&1
  end=$(date +%s.%N)
  "$py" - "$i" "$side" "$(echo "$end - $start" | bc)" "${out%.jsonl}.report.json" <<'PY'
import json, sys
i, side, wall, path = sys.argv[1:]
r = json.load(open(path))
c = r["engine_choice"].get("compile", {})
mode = "eager" if c.get("enforce_eager") else "compiled"
s = r["seconds"]
print(f"{i} {side}: {mode}, cache {c.get('cache', '-')}; wall {float(wall):.1f} s, total {s['total']:.1f} s, "
      f"engine start {s['start']['engine']:.1f} s, generate {s['generate']:.1f} s, "
      f"{r['throughput']['completion_tokens_per_s']:.1f} completion tok/s ({r['tokens']['completion']} tokens)")
PY
done
