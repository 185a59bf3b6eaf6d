#!/usr/bin/env bash
# Engine start-up of two checkouts side by side: a 1-row `bulkinfer run` per
# checkout, alternating, ROUNDS times; prints each run's wall time and its
# report's seconds.load / seconds.total. Run it alone on the machine.
#
#   bench/start_ab.sh OLD_CHECKOUT NEW_CHECKOUT [ROUNDS] [-- extra run flags, e.g. -dp 2]
set -euo pipefail
old=$1 new=$2 rounds=${3:-2}
shift $(( $# < 3 ? $# : 3 )); [ "${1:-}" = "--" ] && shift
py=${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
work=$(mktemp -d)
echo '{"id":"a","prompt":"What is the capital of France?"}' > "$work/one.jsonl"
echo "# $(date -u +%FT%TZ) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; flags: $*"
for round in $(seq "$rounds"); do
  for checkout in "$old" "$new"; do
    out="$work/$round-$(basename "$checkout")"
    start=$(date +%s.%N)
    # from $work: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH
    (cd "$work" && PYTHONPATH=$checkout "$py" -m bulkinfer run one.jsonl -o "$out/out.jsonl" --max-tokens 4 --plain-progress "$@" > /dev/null 2>&1)
    end=$(date +%s.%N)
    "$py" -c "import json, sys; r = json.load(open(sys.argv[1])); s = r['seconds']
wall = float(sys.argv[5]) - float(sys.argv[4])
print(sys.argv[2], 'round', sys.argv[3], 'wall', round(wall, 1), 'load', round(s['load'], 1), 'total', round(s['total'], 1))" \
      "$out/out.report.json" "$checkout@$(git -C "$checkout" rev-parse --short HEAD)" "$round" "$start" "$end"
  done
done
