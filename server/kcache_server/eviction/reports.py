"""What ``kcache cache info|ls --server`` show: the store against its cap, and its entries.

The dataclasses here are the one list of their fields: the ``/v1/cache`` answers are
these dataclasses under the API's names (:mod:`kcache_server.routes.cache`), each
field's ``description`` (dataclass field metadata, which pydantic reads) included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

import sqlalchemy as sa

from kcache.eviction import WaterMarks
from kcache_server.index import StoreUsage, pinned
from kcache_server.models import artifacts_table, recipe_aliases_table

__all__ = ["RemovalReport", "StoreEntry", "StoreInfo", "list_entries"]


def _doc(text: str) -> dict[str, str]:
    """Field metadata that the response models publish as the field's description."""
    return {"description": text}


@dataclass(frozen=True)
class StoreInfo:
    """The store's size against its cap, and what eviction has done (``kcache cache info``)."""

    location: str = field(metadata=_doc("the server's data directory"))
    bytes_used: int = field(metadata=_doc("bytes of stored artifacts, pinned ones included"))
    bytes_cap: int | None = field(metadata=_doc("max_store_bytes; null when unbounded"))
    high_water_bytes: int | None = field(metadata=_doc("eviction starts above this"))
    low_water_bytes: int | None = field(metadata=_doc("and stops at or below this"))
    artifacts: int
    pinned_artifacts: int
    pinned_bytes: int
    pins: int = field(metadata=_doc("pins, including those whose key has no artifact yet"))
    oldest_use: datetime | None
    newest_use: datetime | None
    evictions: int = field(
        metadata=_doc("artifacts evicted or removed (as far back as the log goes)")
    )
    bytes_freed: int

    @classmethod
    def of(
        cls,
        location: str,
        usage: StoreUsage,
        marks: WaterMarks,
        evictions: int,
        bytes_freed: int,
    ) -> StoreInfo:
        """From the index's usage, the water marks and the eviction log's totals."""
        bounded = marks.bounded
        return cls(
            location=location,
            bytes_used=usage.bytes,
            bytes_cap=marks.cap or None,
            high_water_bytes=marks.high_bytes if bounded else None,
            low_water_bytes=marks.low_bytes if bounded else None,
            artifacts=usage.artifacts,
            pinned_artifacts=usage.pinned_artifacts,
            pinned_bytes=usage.pinned_bytes,
            pins=usage.pins,
            oldest_use=usage.oldest_use,
            newest_use=usage.newest_use,
            evictions=evictions,
            bytes_freed=bytes_freed,
        )


@dataclass(frozen=True)
class RemovalReport:
    """What an admin removal did: evicted artifacts, bytes freed, keys that were pinned or unknown."""

    evicted: int
    bytes_freed: int
    pinned: list[str] = field(metadata=_doc("keys whose artifact is pinned (unpin it first)"))
    unknown: list[str] = field(metadata=_doc("keys that name no stored artifact"))


@dataclass(frozen=True)
class StoreEntry:
    """One stored artifact as ``kcache cache ls`` shows it."""

    digest: str
    recipe_keys: list[str]
    kernel: str
    target: str
    kind: str
    size: int
    created_at: datetime
    last_used_at: datetime | None
    pinned: bool


def list_entries(db: sa.Engine, limit: int) -> list[StoreEntry]:
    """The ``limit`` most recently used artifacts, with the recipe keys that name them."""
    last_use = sa.func.coalesce(artifacts_table.c.last_used_at, artifacts_table.c.created_at)
    query = (
        sa.select(
            artifacts_table.c.digest,
            artifacts_table.c.kernel,
            artifacts_table.c.target,
            artifacts_table.c.kind,
            artifacts_table.c.size,
            artifacts_table.c.created_at,
            artifacts_table.c.last_used_at,
            pinned(artifacts_table.c.digest).label("pinned"),
        )
        .order_by(last_use.desc(), artifacts_table.c.digest)
        .limit(limit)
    )
    with db.connect() as conn:
        rows = conn.execute(query).all()
        keys: dict[str, list[str]] = {}
        digests = [r.digest for r in rows]
        for start in range(0, len(digests), 500):
            for key, digest in conn.execute(
                sa.select(recipe_aliases_table.c.recipe_key, recipe_aliases_table.c.digest).where(
                    recipe_aliases_table.c.digest.in_(digests[start : start + 500])
                )
            ):
                keys.setdefault(digest, []).append(key)
    return [
        StoreEntry(
            r.digest,
            sorted(keys.get(r.digest, [])),
            r.kernel,
            r.target,
            r.kind,
            int(r.size),
            r.created_at,
            r.last_used_at,
            bool(r.pinned),
        )
        for r in rows
    ]
