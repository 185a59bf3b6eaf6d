#!/usr/bin/env bash
# Issue 34's measurements on the CPU at hand, one after another, each alone on the machine (start it
# with nothing else running, and run nothing CPU-heavy until it ends: ~1.5-2 h on 2 cores):
#
#   bench/cpu_round.sh TAG          e.g. zen3, zen5; DRY=1 prints the commands only
#
# 1. identical settings, bfloat16 compiled (only where the CPU has AVX-512-BF16 or AMX: elsewhere the
#    dtype probe keeps float32, and bfloat16 ran 0.19x float32 on the AVX2-only Zen 3);
# 2. identical settings, float32 eager;
# 3. `bulkinfer calibrate --compile` (the compile decision's break-even on this machine), then
#    defaults against defaults on ShareGPT-200 and the shared-prefix workload: bulkinfer, raw vLLM
#    with bulkinfer's dtype, raw vLLM at its own defaults;
# 4. the first token of a 300-row job, phases itemised.
# Results: bench/results/compare-*.{json,md} (named by each run's time: the log lists them),
# bench/results/startup-TAG.{json,md}, and this round's log bench/results/cpu-round-TAG.log. Then the
# README's Performance summary and docs/performance.md take the figures, with the CPU.
set -euo pipefail
tag=${1:?usage: bench/cpu_round.sh TAG (e.g. zen3, zen5)}
cd "$(dirname "$0")/.."
py=${PY:-.venv/bin/python}
bulkinfer=${BULKINFER:-.venv/bin/bulkinfer}
log=bench/results/cpu-round-$tag.log
cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2 | xargs) model $(grep -m1 '^model\s' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, $( (grep -o -E 'avx512_bf16|amx_bf16' /proc/cpuinfo || true) | sort -u | xargs)"

out=$(mktemp)
run() {  # a command, its output's last 40 lines and its exit status into the log; stops the round if it fails
  echo "## $(date -u +%FT%TZ) $*" | tee -a "$log"
  [ -n "${DRY:-}" ] && return 0
  local status=0
  "$@" > "$out" 2>&1 || status=$?
  tail -n 40 "$out" >> "$log"
  echo "## $(date -u +%FT%TZ) exit $status" | tee -a "$log"
  return "$status"
}

[ -n "${DRY:-}" ] && log=/dev/null
echo "# issue 34 round '$tag' on $cpu ($(git rev-parse --short HEAD))" | tee -a "$log"
identical=(-m bench.compare --workload sharegpt --n 200 --systems a,b --repeats 2 --vllm-env VLLM_ENABLE_V1_MULTIPROCESSING=0)
if grep -q -E 'avx512_bf16|amx_bf16' /proc/cpuinfo; then
  run "$py" "${identical[@]}" --dtype bfloat16 --compiled
else
  echo "# no AVX-512-BF16 or AMX: no bfloat16 compiled comparison" | tee -a "$log"
fi
run "$py" "${identical[@]}"
run "$bulkinfer" calibrate --compile
run "$py" -m bench.compare --workload sharegpt,shared-prefix --n 200 --systems a,b,e --engine defaults --repeats 2
run "$py" -m bench.startup --rows 300 --max-tokens 16 --rounds 2 --out "bench/results/startup-$tag.json"
echo "# $(date -u +%FT%TZ) round '$tag' ended" | tee -a "$log"
