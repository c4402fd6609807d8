"""TensorFlow interop: TF2 object checkpoints of ``tf.tpu.experimental.embedding`` (``TPUEmbedding``,
``TPUEmbeddingForServing``) read into, and written from, embtables state dicts, without TensorFlow.

TF saves each table as ``<path>/<table>/.ATTRIBUTES/VARIABLE_VALUE`` and each slot under the local
name ``<table>/<slot>``, escaped to ``<table>.S<slot>`` (spec §7). Both map one to one onto
embtables' state keys (``<table>``, ``<table>/<slot>``):

    emb.load_state_dict(read_tf_checkpoint("tf_ckpt/ckpt-1"))      # from TF
    write_tf_checkpoint("out/ckpt", emb.state_dict())               # to TF:
    tf.train.Checkpoint(model=tpu_embedding).restore("out/ckpt")    # (in TF)

``write_tf_checkpoint`` also writes the object graph TF's object-based restore follows: a root with
one child (``object_name``, default "model"), whose children are the tables and slots.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from embtables.checkpoint.tf_bundle import (
    OBJECT_GRAPH_KEY,
    BundleError,
    field_bytes,
    field_varint,
    read_bundle,
    write_bundle,
)

_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"


def _escape(name: str) -> str:
    return name.replace(".", "..").replace("/", ".S")


def _unescape(name: str) -> str:
    out, i = [], 0
    while i < len(name):
        if name[i] == "." and i + 1 < len(name) and name[i + 1] in ".S":
            out.append("." if name[i + 1] == "." else "/")
            i += 2
        else:
            out.append(name[i])
            i += 1
    return "".join(out)


def read_tf_checkpoint(prefix: str | os.PathLike[str], object_path: str | None = None) -> dict[str, Tensor]:
    """``{"<table>" | "<table>/<slot>": float32 tensor}`` from a TF checkpoint (``prefix`` is what
    ``tf.train.Checkpoint.write`` returned). ``object_path`` picks the embedding object when the
    checkpoint holds several (e.g. "model"); by default every variable is taken by its local name,
    and two variables with the same local name raise ``ValueError``."""
    try:
        tensors = read_bundle(prefix)
    except BundleError as exc:
        raise ValueError(f"read_tf_checkpoint: {exc}") from exc
    out: dict[str, Tensor] = {}
    where: dict[str, str] = {}
    for key, value in tensors.items():
        if key == OBJECT_GRAPH_KEY or not key.endswith(_SUFFIX):
            continue
        path, _, local = key[: -len(_SUFFIX)].rpartition("/")
        if object_path is not None and path != object_path:
            continue
        name = _unescape(local)
        if name in out:
            raise ValueError(
                f"read_tf_checkpoint: {prefix}: {name!r} is saved under both {where[name]!r} and {key!r}; "
                "pass object_path= to pick one."
            )
        out[name], where[name] = torch.from_numpy(np.asarray(value, dtype=np.float32)), key
    if not out:
        raise ValueError(f"read_tf_checkpoint: {prefix}: no variables found (object_path={object_path!r}).")
    return out


def _object_graph(names: list[str], object_name: str) -> bytes:
    """A TrackableObjectGraph: root -> object_name -> one variable node per state key."""
    has_values = field_bytes(5, field_varint(1, 1))
    root = field_bytes(1, field_varint(1, 1) + field_bytes(2, object_name.encode())) + has_values
    children = b"".join(
        field_bytes(1, field_varint(1, 2 + i) + field_bytes(2, n.encode())) for i, n in enumerate(names)
    )
    nodes = [root, children + has_values]
    for n in names:
        key = f"{object_name}/{_escape(n)}{_SUFFIX}"
        attribute = field_bytes(1, b"VARIABLE_VALUE") + field_bytes(2, n.encode()) + field_bytes(3, key.encode())
        nodes.append(field_bytes(2, attribute) + has_values)
    return b"".join(field_bytes(1, node) for node in nodes)


def write_tf_checkpoint(prefix: str | os.PathLike[str], state: Mapping[str, Tensor], object_name: str = "model") -> str:
    """Write ``state`` (an embtables state dict: ``<table>`` and ``<table>/<slot>``) as a TF2 object
    checkpoint at ``prefix`` that ``tf.train.Checkpoint(**{object_name: tpu_embedding}).restore``
    reads. Returns ``prefix``."""
    if not state:
        raise ValueError("write_tf_checkpoint: the state is empty.")
    keyed = sorted(n for n, t in state.items() if not torch.is_floating_point(t))
    if keyed:  # a float32 bundle would round 64-bit keys: refuse rather than corrupt them
        raise ValueError(
            f"write_tf_checkpoint: {keyed[:4]} are not floating point (a dynamic table's key map, spec §11), and "
            "TF's TPUEmbedding has no such state. Write the weights and slots only: "
            "{k: v for k, v in state.items() if v.is_floating_point()}."
        )
    names = sorted(state)
    tensors = {
        f"{object_name}/{_escape(n)}{_SUFFIX}": state[n].detach().to("cpu", torch.float32).numpy() for n in names
    }
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    write_bundle(Path(prefix), tensors, _object_graph(names, object_name))
    return str(prefix)
