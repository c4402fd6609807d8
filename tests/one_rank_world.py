"""A world of one rank through the sharded engine (``EMBTABLES_SHARD_ONE_RANK=1``), in a subprocess: the
process-group path on one GPU over NCCL, or on the CPU over gloo. It trains three steps and must give the
tables of a module without a process group, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

from mp_world import free_port

_SCRIPT = """
import datetime, os, sys, torch, torch.distributed as dist
import embtables as et
backend, device, port = sys.argv[1], sys.argv[2], sys.argv[3]
dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
table = et.TableConfig(50, 8, initializer=et.Constant(0.1), combiner="mean", name="t")
feats = {"f": et.FeatureConfig(table), "g": et.FeatureConfig(table)}
sharded = et.DistributedEmbedding(feats, et.Adagrad(0.1), device=device, process_group=dist.group.WORLD)
os.environ.pop("EMBTABLES_SHARD_ONE_RANK")
alone = et.DistributedEmbedding(feats, et.Adagrad(0.1), device=device)
for module in (sharded, alone):
    for step in range(3):
        ids = et.Ragged.from_lists([[1, 2], [2], [49, 1, 1]])
        acts = module({"f": ids, "g": et.Ragged.from_lists([[3], [], [2, 2]])})
        ((acts["f"] + 2 * acts["g"]) * (step + 1)).sum().backward()
        module.apply_gradients()
assert sharded.embedding_tables["t"].device.type == torch.device(device).type
assert torch.equal(sharded.embedding_tables["t"].cpu(), alone.embedding_tables["t"].cpu())
print("engine", type(sharded._engine).__name__, flush=True)
# the modules go before the group (they hold it): gloo's threads are then joined by destroy_process_group,
# not at interpreter exit, where gloo can end a process with "terminate called without an active exception"
del sharded, alone, acts
import gc; gc.collect()
dist.destroy_process_group()
"""


def run_one_rank_world(backend: str, device: str) -> str:
    """Run the script; returns the engine class name it used (raises with its stderr if it failed)."""
    env = dict(os.environ, EMBTABLES_SHARD_ONE_RANK="1", GLOO_SOCKET_IFNAME="lo")
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, backend, device, str(free_port())],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split("engine", 1)[1].strip()
