#!/usr/bin/env bash
# The CUDA path on a real GPU, in one pass that fits a short lease (~7 min on an H200 with 16 cores):
#   1. the CUDA tests (tests/test_cuda_*.py) on the GPU instead of the simulator, and the kernel timings;
#   2. the card's copy bandwidth, a launch's and an allocation's host cost (scripts/bench_cuda.py);
#   3. `ikcli sweep-bench` on a DeepSeek-shaped model (make_test_model.py --preset 2b: Q8_0 attention,
#      shared experts and output, Q4_0 routed experts) with -ngl 99 (to N_KV 16384) and with
#      -ngl 99 -ot exps=CPU, and the bandwidth bound of S_TG at N_KV 0 and at the deepest row;
#   4. the same with ik's default Q4_K_M mixture of that model (MIXTURE=0: not);
#   5. ikcli's own host time per token (no-op kernels), and a profile of generation when time is left.
# Usage: bash scripts/gpu_check.sh [OUTDIR]   (logs in OUTDIR, default ./gpu_check_out)
# Needs numba with numba-cuda, and gguf (for the tests and the model); ikcli runs from the checkout.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-./gpu_check_out}}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
M=${MODEL:-/tmp/ikcli-ds2b-q8_0-q4_0exps.gguf}
T0=$(date +%s)
stamp() { echo "== $(( $(date +%s) - T0 )) s: $*"; }

stamp "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
$PY -c "import numba, numpy; from numba import cuda; print('numba', numba.__version__, 'numpy', numpy.__version__); \
print(cuda.get_current_device().name, cuda.get_current_device().compute_capability)" 2>&1
$PY -c "import numba_cuda; print('numba-cuda', numba_cuda.__version__)" 2>&1 | tail -1
lscpu | grep -E "^Model name|^CPU\(s\)|^Thread|^Core" 2>&1

# the model (CPU work) while the tests compile and run
if [ ! -f "$M" ]; then
  ( t=$(date +%s); $PY -c "
import sys; sys.path.insert(0, 'scripts'); import make_test_model as m
m.write_model('$M.part', 'deepseek2', 'ik', 'q8_0', '2b', expert_qtype='q4_0')" && mv "$M.part" "$M" \
    && echo "model written in $(( $(date +%s) - t )) s" ) > "$OUT/model.log" 2>&1 &
  GEN=$!
fi

stamp "CUDA tests on the GPU"
# TESTS=tests/test_cuda_backend.py: the model tests alone; TIMINGS=0: no kernel timings
timeout ${TESTS_S:-150} $PY -m pytest -n 12 -q -p no:cacheprovider -rs ${TESTS:-tests/test_cuda_kernels.py tests/test_cuda_backend.py} \
  -k "not timings" > "$OUT/tests.log" 2>&1
echo "pytest rc $?"; grep -E "^[.FEsx]+ *\[|passed|failed" "$OUT/tests.log" | tail -4
grep -E "^_{3,} " "$OUT/tests.log" | head -20
grep -E "^E  " "$OUT/tests.log" | sort | uniq -c | head -10
if [ "${TIMINGS:-1}" != 0 ]; then
  timeout 45 $PY -m pytest -q -s -p no:cacheprovider tests/test_cuda_kernels.py -k timings 2>&1 | grep -E "x4096|passed|failed|Error" | head
fi

stamp "bandwidth"
BW=$(timeout 30 $PY scripts/bench_cuda.py bandwidth 2>&1 | tee -a "$OUT/bandwidth.log" | tail -1)
echo "$BW"
GBS=$(echo "$BW" | sed -n 's/.*: \([0-9]*\) GB\/s.*/\1/p')
timeout 30 $PY scripts/bench_cuda.py launch 2>&1 | tail -1
timeout 30 $PY scripts/bench_cuda.py alloc 2>&1 | tail -1

[ -n "${GEN:-}" ] && wait $GEN
cat "$OUT/model.log"
ls -la "$M" || exit 1
COMMON="-m $M -mla 3 -fa -fmoe -amb 512 -ctk q8_0"

stamp "sweep-bench -ngl 99"
timeout ${SWEEP1_S:-150} $PY -m ikcli sweep-bench $COMMON -ngl 99 -c 18432 -ub 2048 -n 64 > "$OUT/sweep_ngl99.log" 2>&1
echo "rc $?"; grep -E "offloaded|CUDA0|^\||^warning|^ikcli:|Error" "$OUT/sweep_ngl99.log" | head -30

stamp "sweep-bench -ngl 99 -ot exps=CPU"
timeout ${SWEEP2_S:-110} $PY -m ikcli sweep-bench $COMMON -ngl 99 -ot exps=CPU -c 4096 -ub 512 -n 32 \
  > "$OUT/sweep_exps_cpu.log" 2>&1
echo "rc $?"; grep -E "offloaded|CUDA0|^\||^warning|^ikcli:|Error" "$OUT/sweep_exps_cpu.log" | head -30

stamp "bounds"
for d in 0 16384; do $PY scripts/bench_cuda.py bound "$M" --depth $d --gbs "${GBS:-0}"; done
for d in 0 3584; do $PY scripts/bench_cuda.py bound "$M" --depth $d --exps-cpu --gbs "${GBS:-0}"; done
# ik's default mixture on the same weights (llama-quantize Q4_K_M: Q6_K output, Q4_K / Q6_K experts,
# Q5_K attn_output), requantized from the Q8_0 file: what users download, not a --pure file
MIX=${MIX_MODEL:-${M%.gguf}-q4_k_m.gguf}
if [ "${MIXTURE:-1}" != 0 ]; then
  stamp "sweep-bench -ngl 99 on ik's Q4_K_M mixture"
  [ -f "$MIX" ] || timeout 120 $PY -m ikcli quantize --allow-requantize "$M" "$MIX" Q4_K_M > "$OUT/quantize.log" 2>&1
  timeout ${SWEEP4_S:-90} $PY -m ikcli sweep-bench -m "$MIX" -mla 3 -fa -fmoe -amb 512 -ctk q8_0 -ngl 99 \
    -c 4096 -ub 512 -n 32 > "$OUT/sweep_q4km.log" 2>&1
  echo "rc $?"; grep -E "offloaded|CUDA0|^\||^warning|^ikcli:|Error" "$OUT/sweep_q4km.log" | head -20
  for d in 0 3584; do $PY scripts/bench_cuda.py bound "$MIX" --depth $d --gbs "${GBS:-0}"; done
fi
# ikcli's own host time per token on this CPU (kernels as no-ops, on the simulator): the rest of a
# measured TG token is numba-cuda's launches and allocations, the driver and the GPU
timeout 60 $PY scripts/bench_cuda.py host "$M" 2>&1 | tail -2

if [ -n "${CPU_BASELINE:-}" ]; then   # CPU_BASELINE=1: also the CPU alone (cold compile: >45 s)
  stamp "sweep-bench on the CPU alone (same model)"
  timeout ${SWEEP3_S:-45} $PY -m ikcli sweep-bench $COMMON -c 2048 -ub 512 -n 32 > "$OUT/sweep_cpu.log" 2>&1
  echo "rc $?"; grep -E "^\|" "$OUT/sweep_cpu.log" | head -8
fi
if [ $(( $(date +%s) - T0 )) -lt ${PROFILE_IF_UNDER_S:-360} ]; then
  stamp "profile of generation, -ngl 99 (self time per function)"
  timeout 90 $PY -m cProfile -o "$OUT/tg.prof" -m ikcli sweep-bench $COMMON -ngl 99 -c 256 -ub 256 -n 64 \
    > "$OUT/sweep_prof.log" 2>&1
  $PY -c "import pstats; pstats.Stats('$OUT/tg.prof').sort_stats('tottime').print_stats(22)" 2>&1 \
    | grep -E "ncalls|[0-9]" | cut -c1-150 | tail -23
fi
stamp "done"
