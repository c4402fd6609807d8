"""Checkpoints that restore anywhere: per-rank row files, a JSON manifest, atomic publication."""

from embtables.checkpoint.store import CheckpointError, published, read_manifest, restore, save

__all__ = ["CheckpointError", "published", "read_manifest", "restore", "save"]
