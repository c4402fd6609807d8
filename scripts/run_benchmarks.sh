#!/usr/bin/env bash
# The benchmark runs behind BENCHMARKS.md, in one go (about 25 minutes on 2 cores).
#   bash scripts/install_bench_peers.sh          # optional peers: FBGEMM, TorchRec (+ TF with BENCH_INSTALL_TF=1)
#   bash scripts/run_benchmarks.sh [OUT_DIR]
# Uses the TensorFlow venv's python when it exists (it also sees torch, FBGEMM, TorchRec and embtables).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench_out}
PY=python3
[ -x "$HOME/.cache/embtables/venv-tf/bin/python" ] && PY="$HOME/.cache/embtables/venv-tf/bin/python"
mkdir -p "$OUT"
run() { local name=$1; shift; echo "== $name" >&2; "$PY" benchmarks/run.py --out "$OUT/$name" "$@" > "$OUT/$name.jsonl"; }
PEERS=embtables,torch,fbgemm,fbgemm-rowwise,torchrec,tensorflow
# 1. the standard workload: Adagrad and SGD, Zipf and uniform ids, training and lookup-only, with the probe
run standard --impls "$PEERS" --optimizers adagrad,sgd --ids zipf,uniform --modes train,lookup --steps 15 --warmup 3
# 2. the optimizers no fused CPU peer has
run adam_ftrl --impls embtables,torch,tensorflow --optimizers adam,ftrl --ids zipf --no-probe --steps 10 --warmup 2
# 3. shape variations (Adagrad, Zipf)
run variations --impls embtables,torch,fbgemm --optimizers adagrad --ids zipf \
  --variations dim16,dim128,dim256,pool1,pool100 --no-probe --no-check --steps 10 --warmup 2
# 4. table size at fixed ids: 2 tables of 1e5, 1e6 and 1e7 rows
run table_size --impls embtables,torch,fbgemm --optimizers adagrad --ids zipf --tables 2 \
  --variations rows100k,standard,rows10m --no-probe --no-check --steps 10 --warmup 2
# 5. embtables-only modes: no accumulation, sequence features
run modes --impls embtables,embtables-noacc,embtables-seq --optimizers adagrad,adam --ids zipf --no-probe \
  --steps 10 --warmup 2
echo "done: $OUT" >&2
