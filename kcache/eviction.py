"""The eviction policy every bounded kcache store shares: a byte cap with water marks, LRU order.

A store may grow past its *high-water mark* (a fraction of the cap) only until the
next eviction pass, which removes least-recently-used entries until the store is at
or below its *low-water mark*. Evicting down to a lower mark than the one that
triggers eviction gives each pass real work and keeps passes rare (the same
hysteresis as bazel-remote's and ccache's cleanups). Pinned entries are never
chosen, but still count toward the size: a cap that pins alone fill is reported,
not silently exceeded by more than they hold.

The server (SQL rows and blobs), the client's node tier (JSON files and blobs) and a
server replica's local copies of bucket blobs each apply this policy to their own
storage, all through :func:`least_recently_used`: the server's SQL only fetches the
candidates, already in the policy's order (:func:`lru_order`), so that a pass reads
no more rows than it evicts. Sizes on the command line and in the environment
(``10GiB``, ``500M``, ``0`` for no cap) are read by :func:`parse_size`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

__all__ = [
    "DEFAULT_HIGH_WATER",
    "DEFAULT_LOW_WATER",
    "DEFAULT_TIER_CAP_BYTES",
    "DEFAULT_TIER_CAP_FRACTION",
    "LruCandidate",
    "WaterMarks",
    "default_tier_cap",
    "format_size",
    "least_recently_used",
    "lru_order",
    "parse_size",
]

#: Eviction starts above this fraction of the cap ...
DEFAULT_HIGH_WATER = 0.9
#: ... and stops at or below this one.
DEFAULT_LOW_WATER = 0.8
#: A node tier's default cap is the smaller of this ...
DEFAULT_TIER_CAP_BYTES = 10 << 30
#: ... and this fraction of its filesystem's size (sccache and ccache default to a few GiB).
DEFAULT_TIER_CAP_FRACTION = 0.10

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?)(i?)b?\s*", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str | int, what: str = "size", *, zero_means: str | None = "no cap") -> int:
    """Bytes from ``text``: an integer, or a number with a unit (``10GiB``, ``512M``, ``1.5 GB``).

    ``K``/``M``/``G``/``T`` with an ``i`` are powers of 1024 (``GiB``), without one
    powers of 1000 (``GB``), as pydantic's ``ByteSize`` reads them, so a server flag
    and a client variable agree. ``what`` names the setting in the error, which offers 0
    as ``zero_means`` (None: a setting that refuses 0 offers nothing).
    """
    zero = f", or 0 for {zero_means}" if zero_means else ""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"{what}: {text} is negative; give a size in bytes{zero}")
        return text
    match = _SIZE.fullmatch(str(text))
    if match is None:
        raise ValueError(
            f"{what}: {str(text)[:40]!r} is not a size; give bytes (1073741824) or a number with "
            f"a unit (1GiB, 500MB, 512M){zero}"
        )
    number, prefix, binary = match.groups()
    base = 1024 if binary or not prefix else 1000
    value = float(number) * base ** _POWERS[prefix.lower()]
    if not math.isfinite(value) or value >= 2**63:
        raise ValueError(f"{what}: {text!r} is too large")
    return int(value)


def format_size(n: int | float | None) -> str:
    """``1.5 GiB`` and the like, for people (``-`` for None)."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class WaterMarks:
    """A byte cap and the two marks eviction works between.

    ``cap`` 0 means unbounded: nothing is ever over a mark.
    """

    cap: int
    high: float = DEFAULT_HIGH_WATER
    low: float = DEFAULT_LOW_WATER

    def __post_init__(self) -> None:
        if self.cap < 0:
            raise ValueError(f"the store cap is {self.cap} bytes; give a size, or 0 for no cap")
        if not 0.0 < self.low < self.high <= 1.0:
            raise ValueError(
                f"the water marks must satisfy 0 < low < high <= 1 (fractions of the cap), got "
                f"low {self.low} and high {self.high}; for example high 0.9 and low 0.8"
            )

    @property
    def bounded(self) -> bool:
        """True when there is a cap."""
        return self.cap > 0

    @property
    def high_bytes(self) -> int:
        """The size above which a pass evicts."""
        return int(self.cap * self.high)

    @property
    def low_bytes(self) -> int:
        """The size a pass evicts down to."""
        return int(self.cap * self.low)

    def over(self, used: int) -> bool:
        """True when ``used`` bytes call for an eviction pass."""
        return self.bounded and used > self.high_bytes

    def to_free(self, used: int) -> int:
        """Bytes a pass should free when ``used`` bytes are stored (0 when not over the high mark)."""
        return used - self.low_bytes if self.over(used) else 0


class LruCandidate(NamedTuple):
    """One evictable entry: its name, its size, and when it was last used (any comparable stamp).

    A tuple, not a dataclass: a pass builds one per row it reads, and this is half the cost.
    """

    name: str
    size: int
    last_used: float


C = TypeVar("C", bound=LruCandidate)


def lru_order(candidate: LruCandidate) -> tuple[float, str]:
    """The policy's order, oldest first: by ``last_used``, then by name (a query mirrors it)."""
    return candidate.last_used, candidate.name


def least_recently_used(
    candidates: Iterable[C], to_free: int, *, in_order: bool = False
) -> Iterator[C]:
    """The oldest ``candidates`` (by :func:`lru_order`) until their sizes add up to ``to_free``.

    Pinned entries must not be among ``candidates``. Fewer are yielded when all of
    them together are smaller than ``to_free``. ``in_order`` says the candidates come
    sorted already (a query's ``ORDER BY``): they are then read lazily and no further
    than needed, so a stream of rows stops where the choice does.
    """
    freed = 0
    for candidate in candidates if in_order else sorted(candidates, key=lru_order):
        if freed >= to_free:
            return
        freed += candidate.size
        yield candidate


def default_tier_cap(path: str | os.PathLike[str]) -> int:
    """A node tier's default cap: 10 GiB or 10 % of its filesystem, whichever is smaller."""
    try:
        st = os.statvfs(path)
    except OSError:
        return DEFAULT_TIER_CAP_BYTES
    return min(DEFAULT_TIER_CAP_BYTES, int(st.f_blocks * st.f_frsize * DEFAULT_TIER_CAP_FRACTION))
