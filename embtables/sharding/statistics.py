"""Lookup statistics of one module (spec §5): sampled at training lookups, written at ``flush()``.

The counting is ``lookup_stats.LookupStatsRecorder`` (the step pipeline feeds it); this part merges
every rank's counts, has rank 0 write them, and makes rank 0's outcome every rank's.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from embtables.config import ResolvedConfig
from embtables.sharding import comm
from embtables.sharding.lookup_stats import LookupStatsRecorder, merge, write_stats
from embtables.sharding.pipeline import StepPipeline
from embtables.sharding.plan import TablePlan

logger = logging.getLogger("embtables")


class LookupStatistics:
    """The statistics a module gathers into ``directory`` (``profile_data_directory``)."""

    def __init__(
        self,
        resolved: ResolvedConfig,
        plans: dict[str, TablePlan],
        directory: str | os.PathLike[str],
        sample_rate: float,
        seed: int,
    ) -> None:
        self.resolved = resolved
        self.directory = os.fspath(directory)
        self.recorder = LookupStatsRecorder(resolved, plans, sample_rate, seed)

    def flush(self, pipeline: StepPipeline) -> list[str]:
        """Write the statistics gathered so far (all ranks' counts merged; rank 0 writes one JSON file
        per table, merged with what is there, atomically) and start counting afresh. Returns the
        paths written (on rank 0). Collective when sharded; rank 0's error is raised on every rank."""
        stats, directory, engine = self.recorder, self.directory, pipeline.engine
        offloaded = any(t.config.offload is not None for t in self.resolved.tables)  # the same on every rank
        parts, vocabulary, offload = pipeline.exchange(
            "flush",
            lambda: (
                comm.all_gather_object(stats.state(), engine.group),
                engine.vocabulary_statistics(),
                engine.offload_statistics() if offloaded else {},
            ),
        )
        strategies = {n: p.strategy for n, p in engine.plans.items()}
        stats.reset()
        paths: list[Path] = []
        error: str | None = None
        if engine.rank == 0:
            try:
                paths = write_stats(
                    directory, merge(parts), self.resolved, strategies, engine.world, vocabulary, offload
                )
            except (OSError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        error = pipeline.run(lambda: comm.broadcast_object(error, 0, engine.group))
        if error is not None:
            raise RuntimeError(
                f"DistributedEmbedding.flush: rank 0 could not write the lookup statistics to {directory} ({error}); "
                "training is unaffected. Fix the directory (profile_data_directory) or its permissions."
            )
        if paths:
            logger.info("lookup statistics: wrote %d file(s) to %s", len(paths), directory)
        return [str(p) for p in paths]
