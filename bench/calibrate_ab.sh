#!/usr/bin/env bash
# The dtype probe (`bulkinfer calibrate`: the first run on a machine runs it) by two checkouts side by side,
# alternating, ROUNDS times, each run as on a machine that never ran the model: a BULKINFER_HOME of its own (the
# prepared models linked in, no calibration stored) and an empty TORCHINDUCTOR_CACHE_DIR (WARM=1: one inductor
# cache per checkout, kept across its rounds). Prints each run's exit status, wall time and the dtype it chose.
# Run it alone on the machine.
#
#   bench/calibrate_ab.sh OLD_CHECKOUT NEW_CHECKOUT [ROUNDS]
set -euo pipefail
old=$1 new=$2 rounds=${3:-2}
py=${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
models=${BULKINFER_HOME:-$HOME/.cache/bulkinfer}/models
work=$(mktemp -d)
echo "# $(date -u +%FT%TZ) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2 | xargs) model $(grep -m1 '^model\s' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; inductor cache: $([ -n "${WARM:-}" ] && echo 'one per checkout' || echo 'empty each run')"
for round in $(seq "$rounds"); do
  for checkout in "$old" "$new"; do
    name=$(basename "$checkout")@$(git -C "$checkout" rev-parse --short HEAD)
    home="$work/home-$round-$(basename "$checkout")"
    mkdir -p "$home" && ln -s "$models" "$home/models"
    inductor="$work/inductor-$round-$(basename "$checkout")"
    [ -n "${WARM:-}" ] && inductor="$work/inductor-$(basename "$checkout")"
    start=$(date +%s.%N)
    status=0
    # from the checkout: `python -m` puts the working directory first on sys.path, ahead of the installed one
    (cd "$checkout" && BULKINFER_HOME=$home TORCHINDUCTOR_CACHE_DIR=$inductor PYTHONPATH=$checkout \
      "$py" -m bulkinfer calibrate > "$work/$round-$(basename "$checkout").log" 2>&1) || status=$?
    end=$(date +%s.%N)
    "$py" -c "import json, sys
stored = json.load(open(sys.argv[1]))
print(sys.argv[2], 'round', sys.argv[3], 'exit', sys.argv[6], 'wall', round(float(sys.argv[5]) - float(sys.argv[4]), 1),
      'dtype', [(c['dtype'], c['why']) for c in stored.get('choices', []) if c.get('kind') == 'dtype'])" \
      "$home/calibration.json" "$name" "$round" "$start" "$end" "$status"
  done
done
