"""Peer implementations of the benchmark step, one factory per peer, plus the impl registry.

Every factory has the :data:`benchmarks._harness.Factory` signature and returns an
:class:`~benchmarks._harness.Impl`; a missing package or an unsupported optimizer raises
:class:`~benchmarks._harness.Skip` (printed as one ``skipped`` line, never a traceback).

Peers (exact configurations; see also the ``notes`` field each one reports):

* ``torch``: one ``nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, include_last_offset=True)`` per
  table; ``torch.optim.Adagrad(lr, initial_accumulator_value=0.1, eps=1e-10)`` (torch adds eps to
  ``sqrt(acc)``, TPU Adagrad does not), ``torch.optim.SparseAdam`` (lazy, like the TPU's default Adam),
  ``torch.optim.SGD``; FTRL is hand-written on the coalesced sparse gradient (torch has none).
  Lookup-only: ``F.embedding_bag`` under ``no_grad``.
* ``fbgemm``: ``SplitTableBatchedEmbeddingBagsCodegen`` (all tables in one op), ``EmbeddingLocation.HOST``,
  ``ComputeDevice.CPU``, ``EmbOptimType.EXACT_ADAGRAD`` (elementwise, eps=0, accumulator set to 0.1
  after construction since FBGEMM starts it at 0) or ``EXACT_SGD``. Adam and FTRL are not supported by
  FBGEMM on CPU (it asserts "not supported in CPU mode").
* ``fbgemm-fp16``: ``fbgemm`` with float16 weights (``weights_precision=SparseType.FP16``): the half peer.
* ``fbgemm-per-feature``: ``fbgemm`` with its [B, T x D] output split into one activation per table and the
  per-feature dense side embtables' default (per-feature) step has, ``sum((a_t * g_t).sum())``: the like for
  like of ``embtables`` (``fbgemm`` is the like for like of ``embtables-concat``).
* ``fbgemm-rowwise``: the same with ``EXACT_ROWWISE_ADAGRAD`` (one accumulator per row: a different
  optimizer than TPU Adagrad, reported as ``adagrad_rowwise``).
* ``torchrec``: ``torchrec.modules.fused_embedding_modules.FusedEmbeddingBagCollection`` with
  ``optimizer_type=torch.optim.Adagrad`` (mapped by TorchRec to FBGEMM ``EXACT_ADAGRAD``; its kwargs go
  to FBGEMM verbatim, so ``initial_accumulator_value`` is rejected and the accumulator is set to 0.1
  after construction) or ``torch.optim.SGD``; inputs as a ``KeyedJaggedTensor`` built before timing.
* ``tensorflow``: see :mod:`benchmarks.peers_tf`.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._harness import Factory, Impl, OptimizerSpec, Skip
from benchmarks.workload import Batch, Workload, activation_grad


def _torch_inputs(wl: Workload, batches: list[Batch]) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    ids = [[torch.from_numpy(x) for x in b.ids] for b in batches]
    return ids, torch.from_numpy(batches[0].offsets)


def _ftrl_update(w: torch.Tensor, acc: torch.Tensor, lin: torch.Tensor, grad: torch.Tensor, opt: OptimizerSpec) -> None:
    """TF ``ApplyFtrlV2`` with l1 = l2 = 0 on the rows of a (coalesced) sparse gradient."""
    grad = grad.coalesce()
    idx, g = grad.indices()[0], grad.values()
    a_old = acc.index_select(0, idx)
    a_new = a_old + g * g
    p = -opt.lr_power
    w_rows = w.index_select(0, idx)
    lin_rows = lin.index_select(0, idx) + g - (a_new.pow(p) - a_old.pow(p)) / opt.lr * w_rows
    acc.index_copy_(0, idx, a_new)
    lin.index_copy_(0, idx, lin_rows)
    w.index_copy_(0, idx, -lin_rows / (a_new.pow(p) / opt.lr))


def torch_peer(wl: Workload, batches: list[Batch], opt: OptimizerSpec, mode: str) -> Impl:
    bags = nn.ModuleList(
        nn.EmbeddingBag(wl.rows, wl.dim, mode="sum", sparse=True, include_last_offset=True) for _ in range(wl.tables)
    )
    ids, offsets = _torch_inputs(wl, batches)
    nb = len(batches)
    if mode == "lookup":

        @torch.no_grad()
        def lookup(i: int) -> None:
            for t, bag in enumerate(bags):
                F.embedding_bag(ids[i % nb][t], bag.weight, offsets, mode="sum", include_last_offset=True)

        return Impl("torch", "none", lookup, notes="F.embedding_bag(mode='sum') per table under no_grad")

    grads = [g.contiguous() for g in torch.from_numpy(activation_grad(wl)).split(wl.dim, dim=1)]
    params = [b.weight for b in bags]
    row = wl.dim * 4
    notes = ""
    ftrl_state: list[tuple[torch.Tensor, torch.Tensor]] = []
    optim: torch.optim.Optimizer | None = None
    if opt.name == "adagrad":
        optim = torch.optim.Adagrad(params, lr=opt.lr, initial_accumulator_value=opt.initial_accumulator, eps=opt.eps)
        notes = f"torch.optim.Adagrad(eps={opt.eps:g}) adds eps to sqrt(acc); TPU Adagrad has no eps"
    elif opt.name == "adam":
        optim = torch.optim.SparseAdam(params, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.adam_eps)
        notes = "torch.optim.SparseAdam (lazy: only touched rows' moments decay)"
    elif opt.name == "sgd":
        optim = torch.optim.SGD(params, lr=opt.lr)
    elif opt.name == "ftrl":
        for p in params:
            ftrl_state.append((torch.full_like(p, opt.initial_accumulator), torch.zeros_like(p)))
        notes = "hand-written sparse FTRL (TF ApplyFtrlV2, l1=l2=0) with index_select/index_copy_; torch has none"
    else:
        raise Skip(f"optimizer {opt.name} not implemented for torch")

    def step(i: int) -> None:
        b = ids[i % nb]
        loss = sum((bag(b[t], offsets) * grads[t]).sum() for t, bag in enumerate(bags))
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        if optim is not None:
            optim.step()
            optim.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                for p, (acc, lin) in zip(params, ftrl_state, strict=True):
                    assert p.grad is not None
                    _ftrl_update(p.data, acc, lin, p.grad, opt)
                    p.grad = None

    def read() -> list[np.ndarray]:
        return [p.detach().numpy().copy() for p in params]

    def set_weights(ws: list[np.ndarray]) -> None:
        with torch.no_grad():
            for p, w in zip(params, ws, strict=True):
                p.copy_(torch.from_numpy(w))

    return Impl(
        "torch",
        opt.name,
        step,
        slot_bytes_per_row=row * opt.slots,
        notes=notes,
        read_weights=read,
        set_weights=set_weights,
    )


def _fbgemm_modules() -> tuple[Any, Any, Any, Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import fbgemm_gpu  # noqa: F401
            from fbgemm_gpu.split_embedding_configs import EmbOptimType
            from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
            from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
                ComputeDevice,
                SplitTableBatchedEmbeddingBagsCodegen,
            )
    except Exception as exc:
        raise Skip(
            f"fbgemm_gpu not importable ({type(exc).__name__}: {str(exc)[:150]}); run scripts/install_bench_peers.sh"
        ) from None
    return (
        SplitTableBatchedEmbeddingBagsCodegen,
        EmbOptimType,
        (EmbeddingLocation, PoolingMode),
        ComputeDevice,
    )


def _fbgemm_optim(opt: OptimizerSpec, rowwise: bool, who: str) -> tuple[str, str]:
    """(EmbOptimType member name, optimizer label for the report)."""
    if opt.name == "adagrad":
        return ("EXACT_ROWWISE_ADAGRAD", "adagrad_rowwise") if rowwise else ("EXACT_ADAGRAD", "adagrad")
    if rowwise:
        raise Skip(f"{who} is only the row-wise Adagrad variant")
    if opt.name == "sgd":
        return "EXACT_SGD", "sgd"
    raise Skip(f"{who}: FBGEMM on CPU has no {opt.name} (only EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD)")


def _fbgemm_fill_accumulators(emb: Any, value: float) -> None:
    with torch.no_grad():
        for states in emb.split_optimizer_states():
            states[0].fill_(value)


def _fbgemm_factory(rowwise: bool, per_feature: bool = False, fp16: bool = False) -> Factory:
    who = "fbgemm-rowwise" if rowwise else "fbgemm-per-feature" if per_feature else "fbgemm-fp16" if fp16 else "fbgemm"

    def factory(wl: Workload, batches: list[Batch], opt: OptimizerSpec, mode: str) -> Impl:
        tbe_cls, optim_t, (loc_t, pool_t), dev_t = _fbgemm_modules()
        if mode == "train":
            member, label = _fbgemm_optim(opt, rowwise, who)
        elif rowwise:
            raise Skip("lookup-only is the same kernel as 'fbgemm'")
        else:
            member, label = "EXACT_SGD", "none"
        eps = 0.0
        precision: dict[str, Any] = {}
        if fp16:  # the half peer: float16 weights (FBGEMM's CPU TBE has no bfloat16 weights), float32 slots
            from fbgemm_gpu.split_embedding_configs import SparseType

            precision["weights_precision"] = SparseType.FP16
        emb = tbe_cls(
            [(wl.rows, wl.dim, loc_t.HOST, dev_t.CPU)] * wl.tables,
            optimizer=getattr(optim_t, member),
            learning_rate=opt.lr,
            eps=eps,
            pooling_mode=pool_t.SUM,
            **precision,
        )
        n = wl.batch * wl.pooling
        offsets = torch.arange(0, wl.tables * n + 1, wl.pooling, dtype=torch.int64)
        idx = [torch.from_numpy(np.concatenate(b.ids)) for b in batches]
        nb = len(batches)
        if mode == "lookup":

            @torch.no_grad()
            def lookup(i: int) -> None:
                emb(idx[i % nb], offsets)

            return Impl(who, "none", lookup, notes="SplitTableBatchedEmbeddingBagsCodegen forward under no_grad")
        if member != "EXACT_SGD":
            _fbgemm_fill_accumulators(emb, opt.initial_accumulator)
        grad = torch.from_numpy(activation_grad(wl))

        grads = [g.contiguous() for g in grad.split(wl.dim, dim=1)]

        def step(i: int) -> None:
            (emb(idx[i % nb], offsets) * grad).sum().backward()

        def per_feature_step(i: int) -> None:
            acts = emb(idx[i % nb], offsets).split(wl.dim, dim=1)
            loss: Any = sum((a * g).sum() for a, g in zip(acts, grads))
            loss.backward()

        slot = {"EXACT_ADAGRAD": wl.dim * 4, "EXACT_ROWWISE_ADAGRAD": 4}.get(member, 0)

        def set_weights(ws: list[np.ndarray]) -> None:
            with torch.no_grad():
                for p, w in zip(emb.split_embedding_weights(), ws, strict=True):
                    p.copy_(torch.from_numpy(w))

        impl = Impl(
            who,
            label,
            per_feature_step if per_feature else step,
            slot_bytes_per_row=slot,
            notes=f"SplitTableBatchedEmbeddingBagsCodegen HOST/CPU {member} eps={eps:g}, accumulator set to "
            f"{opt.initial_accumulator:g} after construction"
            if member != "EXACT_SGD"
            else f"{member} HOST/CPU",
            read_weights=lambda: [w.detach().float().numpy().copy() for w in emb.split_embedding_weights()],
            set_weights=set_weights,
        )
        return impl

    return factory


def torchrec_peer(wl: Workload, batches: list[Batch], opt: OptimizerSpec, mode: str) -> Impl:
    _fbgemm_modules()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
            from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    except Exception as exc:
        raise Skip(
            f"torchrec not importable ({type(exc).__name__}: {str(exc)[:150]}); run scripts/install_bench_peers.sh"
        ) from None
    if mode == "train":
        member, label = _fbgemm_optim(opt, False, "torchrec")
    else:
        member, label = "EXACT_SGD", "none"
    optim_type = torch.optim.Adagrad if member == "EXACT_ADAGRAD" else torch.optim.SGD
    kwargs: dict[str, Any] = {"lr": opt.lr}
    if optim_type is torch.optim.Adagrad:
        kwargs["eps"] = 0.0
    tables = [
        EmbeddingBagConfig(
            name=f"t{t}",
            embedding_dim=wl.dim,
            num_embeddings=wl.rows,
            feature_names=[f"f{t}"],
            pooling=PoolingType.SUM,
        )
        for t in range(wl.tables)
    ]
    ebc = FusedEmbeddingBagCollection(
        tables=tables, optimizer_type=optim_type, optimizer_kwargs=kwargs, device=torch.device("cpu")
    )
    tbe = ebc._emb_modules[0]._emb_module  # the one FBGEMM op holding every table
    if member == "EXACT_ADAGRAD":
        _fbgemm_fill_accumulators(tbe, opt.initial_accumulator)
    keys = [f"f{t}" for t in range(wl.tables)]
    lengths = torch.full((wl.tables * wl.batch,), wl.pooling, dtype=torch.int64)
    kjts = [
        KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.from_numpy(np.concatenate(b.ids)), lengths=lengths)
        for b in batches
    ]
    nb = len(batches)
    if mode == "lookup":

        @torch.no_grad()
        def lookup(i: int) -> None:
            ebc(kjts[i % nb]).values()

        return Impl("torchrec", "none", lookup, notes="FusedEmbeddingBagCollection forward under no_grad")
    grad = torch.from_numpy(activation_grad(wl))

    def step(i: int) -> None:
        (ebc(kjts[i % nb]).values() * grad).sum().backward()

    def set_weights(ws: list[np.ndarray]) -> None:
        with torch.no_grad():
            for p, w in zip(tbe.split_embedding_weights(), ws, strict=True):
                p.copy_(torch.from_numpy(w))

    impl = Impl(
        "torchrec",
        label,
        step,
        slot_bytes_per_row=wl.dim * 4 if member == "EXACT_ADAGRAD" else 0,
        notes=f"FusedEmbeddingBagCollection(torch.optim.{optim_type.__name__}, {kwargs}) -> FBGEMM "
        f"{member}; non-distributed (no DistributedModelParallel)",
        read_weights=lambda: [w.detach().numpy().copy() for w in tbe.split_embedding_weights()],
        set_weights=set_weights,
    )
    return impl


def _embtables(name: str) -> Factory:
    def factory(wl: Workload, batches: list[Batch], opt: OptimizerSpec, mode: str) -> Impl:
        from benchmarks.impl_embtables import EMBTABLES_IMPLS

        return EMBTABLES_IMPLS[name](wl, batches, opt, mode)

    return factory


def tensorflow_peer(wl: Workload, batches: list[Batch], opt: OptimizerSpec, mode: str) -> Impl:
    from benchmarks.peers_tf import tensorflow_factory

    return tensorflow_factory(wl, batches, opt, mode)


IMPLS: dict[str, Factory] = {
    "embtables": _embtables("embtables"),
    "torch": torch_peer,
    "fbgemm": _fbgemm_factory(rowwise=False),
    "fbgemm-rowwise": _fbgemm_factory(rowwise=True),
    "fbgemm-per-feature": _fbgemm_factory(rowwise=False, per_feature=True),
    "fbgemm-fp16": _fbgemm_factory(rowwise=False, fp16=True),
    "torchrec": torchrec_peer,
    "tensorflow": tensorflow_peer,
    "embtables-noacc": _embtables("embtables-noacc"),
    "embtables-seq": _embtables("embtables-seq"),
    "embtables-concat": _embtables("embtables-concat"),
    "embtables-bf16": _embtables("embtables-bf16"),
    "embtables-bf16-slots": _embtables("embtables-bf16-slots"),
    "embtables-bf16-slots-nearest": _embtables("embtables-bf16-slots-nearest"),
}


def register_impl(name: str, factory: Factory) -> None:
    """Add an impl (e.g. embtables itself) with the same factory contract as the peers."""
    IMPLS[name] = factory
