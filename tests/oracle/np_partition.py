"""spec §3 partition maps, written literally from the formulas (pure Python; no torch, no embtables).

With V rows over P shards, q = V // P and e = V % P:
- div: shard(i) = max(i // (q + 1), (i - e) // q); local(i) = i % (q + 1) if shard(i) < e else (i - e) % q.
- mod: shard(i) = i % P; local(i) = i // P.
"""

from __future__ import annotations


def div_owner(i: int, v: int, p: int) -> tuple[int, int]:
    q, e = v // p, v % p
    if q == 0:  # V < P: the first V shards hold one row each (the formula's (i - e) // q is undefined)
        return i, 0
    shard = max(i // (q + 1), (i - e) // q)
    local = i % (q + 1) if shard < e else (i - e) % q
    return shard, local


def mod_owner(i: int, v: int, p: int) -> tuple[int, int]:
    del v
    return i % p, i // p


def shards(strategy: str, v: int, p: int) -> list[list[int]]:
    """The global ids of each shard, in local-row order: spec §3's ``[[0,1,2],[3,4,5],...]`` lists."""
    owner = div_owner if strategy == "div" else mod_owner
    out: list[list[int]] = [[] for _ in range(p)]
    for i in range(v):
        shard, local = owner(i, v, p)
        assert local == len(out[shard]), (strategy, v, p, i)
        out[shard].append(i)
    return out
