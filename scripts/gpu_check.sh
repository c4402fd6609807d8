#!/usr/bin/env bash
# The GPU checks in one run (for a machine with CUDA and Triton, e.g. the device tool's), about 8 minutes:
#   bash scripts/gpu_check.sh [tests|bench|all] [bench args...]
# Writes logs to $OUT (or ./gpu_out): the CUDA numerics that matter (the fused kernels against the torch
# kernels, the error contract, the oracle suite until TEST_TIMEOUT), then the GPU benchmark (by default the
# standard workload, 8 x 1M x 64, B 4096, 20 Zipf ids, and large-uniform, 32 x 1M x 64, B 65536; Adagrad,
# forward and train; the fused kernels with errors deferred and immediate and with bfloat16 rows and slots,
# plain PyTorch, and the device's copy bandwidth measured in the same run).
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
  EMBTABLES_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -o addopts="" -p no:warnings -p no:cacheprovider -v -ra \
    tests/numerics/test_gpu_kernels.py tests/numerics/test_gpu_engine.py tests/api/test_gpu_deferred_errors.py \
    tests/numerics/test_gpu_half_tables.py \
    tests/numerics/test_engine_vs_oracle.py ${TESTS_EXTRA:-} > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -c PASSED "$OUT/tests.log"; grep -E "FAILED|ERROR" "$OUT/tests.log" | head -30; tail -5 "$OUT/tests.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  name=${BENCH_NAME:-bench}  # several benchmark runs in one call: one pair of files each
  if [ $# -eq 0 ]; then
    set -- --workloads standard,large-uniform --optimizers adagrad --modes forward,train --impls embtables,torch \
      --immediate --dtypes float32,bfloat16+slots --steps 10 --warmup 3
  fi
  timeout "${BENCH_TIMEOUT:-210}" python3 -m embtables bench --device cuda "$@" > "$OUT/$name.jsonl" 2> "$OUT/$name.err"
  echo "$name rc=$?"; grep -i "of copy bw\|error\|traceback" "$OUT/$name.err" | tail -40  # the profile: in the file
  # the launch and sync counts of the CPU's interpreter, checked on the GPU: CUDA runtime calls, profiled
  timeout "${LAUNCH_TIMEOUT:-90}" python3 -m embtables bench gpu-launches --device cuda --tables 8,64 --batch 4096 \
    --pooling 20 > "$OUT/launches.jsonl" 2> "$OUT/launches.err"
  echo "launches rc=$?"; grep -v "^{" "$OUT/launches.err" | tail -12
fi
