"""Sharded training on CPU: a small CTR model whose embedding tables are spread over the processes.

    torchrun --nproc_per_node=2 examples/sharded_training.py            # 2 processes, gloo
    torchrun --nproc_per_node=2 examples/sharded_training.py --sharding mod --pipeline
    python examples/sharded_training.py                                  # one process, no sharding

Every process reads its own share of each global batch (here: a slice of the same synthetic
stream); the embedding module exchanges ids, rows and gradients with the others, so the tables,
the optimizer and the loss curve are those of one process training on the whole batch. The dense
part is replicated and its gradients are averaged with DistributedDataParallel, as usual.
Rank 0 prints the loss and, at the end, the lookup statistics it wrote.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import embtables as et


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sharding", default="div", choices=("div", "mod", "table", "auto"))
    ap.add_argument("--pipeline", action="store_true", help="pipeline_execution_with_tensor_core=True")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--stats-dir", default=os.path.join(tempfile.gettempdir(), "embtables-stats"))
    args = ap.parse_args()

    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(0)  # the same initial tables and dense weights on every rank

    users = et.TableConfig(50_000, 16, name="user", optimizer=et.Adagrad(0.05))
    items = et.TableConfig(20_000, 16, name="item", combiner="mean", optimizer=et.Adam(0.01))
    features = {
        "user": et.FeatureConfig(users),
        "history": et.FeatureConfig(items),
        "candidate": et.FeatureConfig(items),
    }
    emb = et.DistributedEmbedding(
        features,
        sharding=args.sharding,
        pipeline_execution_with_tensor_core=args.pipeline,
        profile_data_directory=args.stats_dir,
        profile_sample_rate=0.1,
        timeout=120,
    )
    dense: nn.Module = nn.Sequential(nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 1))
    if world > 1:
        dense = nn.parallel.DistributedDataParallel(dense)
    opt = torch.optim.Adam(dense.parameters(), lr=0.01)
    teacher = torch.Generator().manual_seed(1)
    user_bias = torch.randn(50_000, generator=teacher)
    item_bias = torch.randn(20_000, generator=teacher)

    local = args.global_batch // world
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 + step)  # one global batch per step, sliced per rank
        u = torch.randint(0, 50_000, (args.global_batch,), generator=g)
        h = torch.randint(0, 20_000, (args.global_batch, 5), generator=g)
        c = torch.randint(0, 20_000, (args.global_batch,), generator=g)
        y = ((user_bias[u] + item_bias[c] + 0.3 * item_bias[h].mean(1)) > 0).float()
        mine = slice(rank * local, (rank + 1) * local)
        history = et.Ragged.from_lengths(h[mine].reshape(-1), torch.full((local,), 5))  # a bag of 5 ids
        acts = emb({"user": u[mine], "history": history, "candidate": c[mine]})
        x = torch.cat([acts["user"], acts["history"], acts["candidate"]], dim=1)
        loss = nn.functional.binary_cross_entropy_with_logits(dense(x).squeeze(1), y[mine])
        opt.zero_grad()
        loss.backward()  # DistributedDataParallel averages the dense gradients over ranks
        opt.step()
        # Embedding gradients are summed over ranks (as TF does): divide by W so that they are the
        # gradients of the mean loss over the global batch, like the dense ones.
        emb.apply_gradients({k: a.grad / world for k, a in acts.items()})
        if rank == 0 and step % 50 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    paths = emb.flush()  # every rank calls it; rank 0 writes
    if rank == 0:
        print(f"{emb}\nlookup statistics: {paths}\n(python -m embtables stats {args.stats_dir})")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
