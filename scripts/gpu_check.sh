#!/usr/bin/env bash
# The GPU checks in one run (for a machine with CUDA and Triton, e.g. the device tool's):
#   bash scripts/gpu_check.sh [tests|bench|all] [bench args...]
# Writes logs to $OUT (or ./gpu_out): the numerics suite on CUDA, then the GPU benchmark.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
what=${1:-all}
shift || true
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/env.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  # -v: a line per test as it ends, so a run cut by the limit still shows what passed
  EMBTABLES_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -o addopts="" -p no:warnings -p no:cacheprovider -v -ra \
    tests/numerics/test_engine_vs_oracle.py tests/numerics/test_gpu_engine.py tests/numerics/test_gpu_kernels.py \
    ${TESTS_EXTRA:-} > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -c PASSED "$OUT/tests.log"; grep -E "FAILED|ERROR" "$OUT/tests.log" | head -30; tail -5 "$OUT/tests.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  name=${BENCH_NAME:-bench}  # several benchmark runs in one call: one pair of files each
  timeout "${BENCH_TIMEOUT:-240}" python3 -m embtables bench --device cuda "$@" > "$OUT/$name.jsonl" 2> "$OUT/$name.err"
  echo "$name rc=$?"; grep -i "of copy bw\|error\|traceback" "$OUT/$name.err" | tail -40  # the profile: in the file
fi
