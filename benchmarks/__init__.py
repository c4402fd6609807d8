"""Benchmarks for embtables and its peers (plain PyTorch, FBGEMM/TorchRec, TensorFlow, a memory probe).

Nothing here is collected by pytest (no ``test_`` file names; pytest's testpaths is ``tests``).
Run ``python3 benchmarks/run.py --help`` or ``python3 benchmarks/run_peers_smoke.py``.
"""
