"""An offloaded table's memory is its cache's (docs/offload.md, 'Memory'): its bookkeeping is per row in memory,
plus a bit a row (the rows changed since the last save) and a byte per block of 1024 rows, whatever the
vocabulary; measured on a 100M-row table in a child process. The bit-a-row changed rows give what a byte a row
gives (the base of increments and serving deltas)."""

from __future__ import annotations

from pathlib import Path

import torch
from subproc import run_python

import embtables as et

_HUNDRED_MILLION_ROWS = """
import sys, tempfile, torch, embtables as et
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
V, CACHE = 100_000_000, 65_536
t = et.TableConfig(1000, 16, name="t", offload=et.Offload(sys.argv[1], CACHE))
emb = et.DistributedEmbedding({"f": et.FeatureConfig(t)}, et.Adagrad(0.1))  # warm-up: imports, the library
torch.manual_seed(0)
emb.close()
base = rss_mib()
t = et.TableConfig(V, 16, name="u", offload=et.Offload(sys.argv[1], CACHE))
emb = et.DistributedEmbedding({"f": et.FeatureConfig(t)}, et.Adagrad(0.1))
built = rss_mib() - base
for step in range(3):
    a = emb({"f": torch.randint(0, V, (256, 2))})["f"]
    emb.apply_gradients({"f": torch.ones_like(a)})
trained = rss_mib() - base
rows = emb.changed_rows()["u"]
resident = emb.offload_statistics()["u"]["resident_rows"]
print(f"built {built:.1f} trained {trained:.1f} resident {resident} changed {rows.numel()}")
"""


def test_a_hundred_million_row_table_keeps_memory_of_its_cache_size(tmp_path: Path) -> None:
    """100M x 16 with a cache of 65,536 rows (8 MiB with the accumulators): the module adds about 12 MiB when
    built (the bit a row), and its memory after three steps stays under its cache plus 40 MiB of working memory (a
    batch, the library's scratch)."""
    out = run_python(_HUNDRED_MILLION_ROWS.replace("sys.argv[1]", repr(str(tmp_path))), timeout=300)
    words = out.split()
    built, trained = float(words[words.index("built") + 1]), float(words[words.index("trained") + 1])
    assert built <= 24, out
    assert trained <= 8 + 40, out
    resident = int(words[words.index("resident") + 1])  # a row cache holds the rows looked up: 3 x 512 ids at most
    assert 1000 < resident <= 3 * 512 and int(words[words.index("changed") + 1]) > 1000, out


def _tables(directory: Path | None, v: int) -> dict[str, et.FeatureConfig]:
    offload = et.Offload(directory, 8192) if directory is not None else None
    return {"f": et.FeatureConfig(et.TableConfig(v, 8, name="t", offload=offload))}


def test_changed_rows_of_an_offloaded_table_are_those_of_the_same_table_in_memory(tmp_path: Path) -> None:
    """A bit a row (V = 20,003: a last byte of 3 rows) against a byte a row: after steps, after a full load (every
    row, none past the last), after a save (none); and an increment of them restores to the same tables."""
    v = 20_003
    torch.manual_seed(0)
    off = et.DistributedEmbedding(_tables(tmp_path / "rows", v), et.Adagrad(0.1))
    mem = et.DistributedEmbedding(_tables(None, v), et.Adagrad(0.1))
    start = off.state_dict()
    off.load_state_dict(start)
    mem.load_state_dict(start)
    assert torch.equal(off.changed_rows()["t"], torch.arange(v)) and torch.equal(
        mem.changed_rows()["t"], torch.arange(v)
    )
    off.save(tmp_path / "ckpt")
    mem.save(tmp_path / "mem")
    assert off.changed_rows()["t"].numel() == 0
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.cat((torch.randint(0, v, (40,), generator=g), torch.tensor([v - 1, 0, 7, 8])))
        for emb in (off, mem):
            a = emb({"f": ids.reshape(4, 11)})["f"]
            emb.apply_gradients({"f": torch.ones_like(a)})
    assert torch.equal(off.changed_rows()["t"], mem.changed_rows()["t"])
    assert off.changed_rows()["t"].numel() > 40
    increment = Path(off.save(tmp_path / "ckpt", incremental=True))
    assert '"chain"' in (increment / "manifest.json").read_text()
    again = et.DistributedEmbedding(_tables(None, v), et.Adagrad(0.1))
    again.restore(tmp_path / "ckpt")
    for key, value in mem.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_rows_read_in_join_the_resident_arrays_in_order_with_their_state() -> None:
    """``Residency.insert`` (the merge that keeps the cache's bookkeeping O(cache)): the rows stay ascending,
    each resident row keeps its slot, last use and use count, each new one starts unused in a free slot."""
    from embtables.tables.offload_residency import Residency

    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        every = torch.randperm(1000, generator=g)[: int(torch.randint(0, 300, (1,), generator=g))]
        n = int(torch.randint(0, every.numel() + 1, (1,), generator=g))
        old, new = torch.sort(every[:n]).values, torch.sort(every[n:]).values
        r = Residency(1000)
        r.insert(old)
        r.uses = torch.rand(n, generator=g)
        r.last_use = torch.randint(0, 9, (n,), dtype=torch.int32, generator=g)
        before = dict(zip(old.tolist(), zip(r.slots.tolist(), r.last_use.tolist(), r.uses.tolist())))
        given = r.insert(new)
        r.check()
        assert torch.equal(r.units, torch.sort(every).values)
        fresh = dict(zip(new.tolist(), given.tolist()))
        for i, row in enumerate(r.units.tolist()):
            got = (int(r.slots[i]), int(r.last_use[i]), float(r.uses[i]))
            assert got == before.get(row, (fresh.get(row), -(2**31), 0.0)), row


def test_the_bookkeeping_of_a_full_cache_is_at_most_33_bytes_a_cached_row(tmp_path: Path) -> None:
    """Beside each cached row's values, its bookkeeping (the resident arrays and the free-slot stack, each of the
    cache's length, the slot's dirty flag, the write log's index and runs) is kept in 4-byte indices: at most 33
    bytes a cached row once the cache and its log are full (a float32 table keeps no rounding id a slot). With
    int64 indices it was 57."""
    cache = 4096
    table = et.TableConfig(200_000, 8, name="t", offload=et.Offload(tmp_path, cache))
    emb = et.DistributedEmbedding({"f": et.FeatureConfig(table)}, et.Adagrad(0.1))
    g = torch.Generator().manual_seed(0)
    rows = emb._engine.local.offloaded["t"]
    log = rows.files.log
    assert log is not None
    while log.head < cache // 2:  # the cache full, rows written back into the log
        a = emb({"f": torch.randint(0, 200_000, (512, 2), generator=g)})["f"]
        emb.apply_gradients({"f": torch.ones_like(a)})
    r = rows.residency
    arrays = [r._units, r._slots, r._free, r._last, r._uses, rows.dirty, rows.slot_global, *log.index]
    arrays += [run for run, _ in log.runs]
    per_row = sum(t.numel() * t.element_size() for t in arrays) / cache  # 20 + 1 + up to 12 for the log
    assert len(r) == cache and per_row <= 33, per_row
