#!/usr/bin/env bash
# Idempotent install of the optional benchmark peers (see benchmarks/README.md):
#   fbgemm-gpu-cpu 1.8.0  (the CPU build matching torch 2.13; 1.9.0 fails to import: undefined symbol)
#   torchrec 1.8.0 --no-deps (it declares the CUDA fbgemm-gpu) + tensordict, torchmetrics 1.0.3, tqdm,
#   pyre-extensions, iopath; plus tqdm, matplotlib, psutil for the harness.
# Every pip call runs under a constraint pinning the CPU torch that is already installed, so pip can
# never replace it by the multi-GB CUDA build, and under a constraint pinning the installed numpy.
# TensorFlow is NOT installed into this environment: benchmarks/peers_tf.py skips the TF peer when
# `import tensorflow` fails. BENCH_INSTALL_TF=1 installs tensorflow-cpu into a separate venv
# (--system-site-packages, so it shares torch/fbgemm/torchrec) at $BENCH_TF_VENV
# (default ~/.cache/embtables/venv-tf); run the benchmark with that venv's python to include it.
set -euo pipefail
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "install_bench_peers: torch is not installed; run scripts/install.sh first" >&2
  exit 1
fi
TORCH_VER=$("$PY" -c 'import torch; print(torch.__version__)')
NUMPY_VER=$("$PY" -c 'import numpy; print(numpy.__version__)')
case "$TORCH_VER" in
  *+cpu) ;;
  *) echo "install_bench_peers: warning: torch $TORCH_VER is not a +cpu build" >&2 ;;
esac
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
printf 'torch==%s\nnumpy==%s\n' "$TORCH_VER" "$NUMPY_VER" > "$CONSTRAINTS"
PIP=("$PY" -m pip install -q -c "$CONSTRAINTS")
echo "install_bench_peers: torch $TORCH_VER, numpy $NUMPY_VER (pinned for this install)"

have() { "$PY" -c "$1" >/dev/null 2>&1; }

if have "import tqdm, matplotlib, psutil"; then
  echo "install_bench_peers: tqdm, matplotlib, psutil already installed"
else
  "${PIP[@]}" tqdm matplotlib psutil
fi

if have "import fbgemm_gpu"; then
  echo "install_bench_peers: fbgemm_gpu already importable"
else
  "${PIP[@]}" "fbgemm-gpu-cpu==1.8.0" \
    || echo "install_bench_peers: fbgemm-gpu-cpu 1.8.0 failed to install; the FBGEMM peer will be skipped" >&2
fi

if have "import torchrec"; then
  echo "install_bench_peers: torchrec already importable"
else
  "${PIP[@]}" tensordict "torchmetrics==1.0.3" tqdm pyre-extensions iopath \
    && "${PIP[@]}" --no-deps "torchrec==1.8.0" \
    || echo "install_bench_peers: torchrec 1.8.0 failed to install; the TorchRec peer will be skipped" >&2
fi

if [ "${BENCH_INSTALL_TF:-0}" = "1" ]; then
  # TensorFlow adds ~20 packages (keras, protobuf, grpcio, ...), so it goes into a venv that sees the main
  # environment's packages (--system-site-packages) instead of into the main environment itself.
  # Run the benchmark with "$BENCH_TF_VENV/bin/python" to include the TF peer.
  TF_VENV=${BENCH_TF_VENV:-$HOME/.cache/embtables/venv-tf}
  if [ -x "$TF_VENV/bin/python" ] && "$TF_VENV/bin/python" -c "import tensorflow" >/dev/null 2>&1; then
    echo "install_bench_peers: tensorflow already importable in $TF_VENV"
  else
    "$PY" -m venv --system-site-packages "$TF_VENV"
    "$TF_VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" tensorflow-cpu \
      || echo "install_bench_peers: tensorflow-cpu failed to install into $TF_VENV" >&2
  fi
  "$TF_VENV/bin/python" -c "import tensorflow as tf, torch, numpy; \
print('install_bench_peers: venv', '$TF_VENV', 'tensorflow', tf.__version__, 'torch', torch.__version__, \
'numpy', numpy.__version__)" 2>/dev/null || echo "install_bench_peers: tensorflow not importable in $TF_VENV" >&2
fi

"$PY" - <<'EOF'
import importlib

for name in ("torch", "numpy", "fbgemm_gpu", "torchrec", "tensorflow", "tqdm", "psutil", "matplotlib"):
    try:
        mod = importlib.import_module(name)
        print(f"install_bench_peers: {name} {getattr(mod, '__version__', '?')}")
    except Exception as exc:  # noqa: BLE001 - report every failure kind the same way
        print(f"install_bench_peers: {name} not available ({type(exc).__name__}: {str(exc)[:120]})")
EOF
