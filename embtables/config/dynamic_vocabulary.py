"""DynamicVocabulary: a table keyed by any 64-bit id, with admission, eviction and expiry (spec §12).

A frozen, validated value; it holds no tensors. ``TableConfig(dynamic=DynamicVocabulary(...))`` turns the
table's ``vocabulary_size`` into a capacity in rows.
"""

from __future__ import annotations

import dataclasses

from embtables.errors import ConfigError

EVICTION_POLICIES = ("lru", "lfu", None)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# The largest lookup count, age or step a key map holds (int64 with headroom); `admit_after` and `ttl_steps`
# above it would wrap in the native map.
COUNT_LIMIT = 1 << 62


@dataclasses.dataclass(frozen=True)
class DynamicVocabulary:
    """How a dynamic table gives its rows to keys.

    Attributes:
      admit_after: a key gets a row at the training lookup that sees it for the ``admit_after``-th time
        (each lookup counts a key once, however often it occurs in the batch); 1 admits at first sight.
        Until then the key is absent from its bags and its gradient is dropped.
      eviction: when every row is taken, "lru" frees the row of the least recently looked-up key, "lfu"
        the least frequently looked-up one (ties: the least recent), None admits no more keys until rows
        are freed (by ``ttl_steps``).
      ttl_steps: a row whose key was not looked up in the last ``ttl_steps`` training steps is freed;
        None keeps rows until they are evicted.
    """

    admit_after: int = 1
    eviction: str | None = "lru"
    ttl_steps: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.admit_after) or not 1 <= self.admit_after <= COUNT_LIMIT:
            raise ConfigError(
                f"DynamicVocabulary: `admit_after` must be an int from 1 (admit a key at first sight) to 2**62 "
                f"(the largest lookup count a key map holds), got {self.admit_after!r}."
            )
        eviction = self.eviction.lower() if isinstance(self.eviction, str) else self.eviction
        if eviction not in EVICTION_POLICIES:
            raise ConfigError(
                f"DynamicVocabulary: `eviction` must be 'lru', 'lfu' or None (admit no more keys when full), "
                f"got {self.eviction!r}."
            )
        object.__setattr__(self, "eviction", eviction)
        if self.ttl_steps is not None and (not _is_int(self.ttl_steps) or not 1 <= self.ttl_steps <= COUNT_LIMIT):
            raise ConfigError(
                f"DynamicVocabulary: `ttl_steps` must be an int from 1 to 2**62 (free rows not looked up for that "
                f"many training steps) or None (never), got {self.ttl_steps!r}."
            )

    @property
    def eviction_code(self) -> int:
        """0 none, 1 lru, 2 lfu (the native map's codes)."""
        return EVICTION_POLICIES.index(self.eviction) + 1 if self.eviction is not None else 0
