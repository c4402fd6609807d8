"""Checkpoints that restore anywhere: per-rank row files, a JSON manifest, atomic publication."""

from embtables.checkpoint.serving import ExportReport, ServingEmbedding, export
from embtables.checkpoint.store import CheckpointError, published, read_manifest, restore, save
from embtables.checkpoint.streaming_restore import TornRestore
from embtables.checkpoint.tf_interop import read_tf_checkpoint, write_tf_checkpoint

__all__ = [
    "CheckpointError",
    "ExportReport",
    "ServingEmbedding",
    "TornRestore",
    "export",
    "published",
    "read_manifest",
    "read_tf_checkpoint",
    "restore",
    "save",
    "write_tf_checkpoint",
]
