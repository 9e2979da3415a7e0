"""Foreign artifacts: groups of files library cache hooks published under the library's key.

CuPy's, cuda.core's and Triton's cache hooks hand kcache bytes it did not compile
(docs/design.md section 10). :class:`ForeignStore` keeps them: each file's bytes in the
content-addressed store (:meth:`ForeignStore.store_blob`, checked against the digest),
then the group in one transaction (:meth:`ForeignStore.publish`, refused unless every
blob it names is stored), so a reader finds a whole group or none. The first publish of
a name wins. A lookup refreshes the binding's ``last_used_at`` at most once a minute.
The server signs "published by <writer>" (:meth:`ForeignStore.signature`), never
"compiled by kcache".
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa

from kcache.errors import ArtifactNotFoundError
from kcache.foreign import ForeignBinding, ForeignFileRef, ForeignName, group_digest
from kcache.lru import LruCache
from kcache.signing import Signature
from kcache.store.base import ArtifactStore
from kcache_server.errors import InvalidRequestError
from kcache_server.index import pinned, record_withdrawal, serialise_withdrawals
from kcache_server.models import artifacts_table as _artifacts
from kcache_server.models import foreign_bindings_table as _bindings
from kcache_server.models import foreign_files_table as _files
from kcache_server.models import pins_table as _pins
from kcache_server.models import utcnow
from kcache_server.signer import ArtifactSigner

__all__ = ["EvictedBinding", "ForeignStore", "StoredBinding", "least_recently_used_of_both"]

#: A hit refreshes ``last_used_at`` when it is older than this.
_TOUCH_AFTER = timedelta(seconds=60)
#: Signatures remembered, by binding key.
_MEMO = 100_000


@dataclass(frozen=True)
class StoredBinding:
    """A foreign binding as the database holds it."""

    binding: ForeignBinding
    published_at: datetime
    last_used_at: datetime


@dataclass(frozen=True)
class EvictedBinding:
    """A foreign binding an eviction removed: its key, its bytes, its files' digests."""

    binding_key: str
    size: int
    digests: tuple[str, ...]


def _unpinned_binding() -> sa.ColumnElement[bool]:
    """True for a binding no pin names (a pin names a binding by its ``binding_key``)."""
    return ~_bindings.c.binding_key.in_(sa.select(_pins.c.recipe_key))


def least_recently_used_of_both(db: sa.Engine, to_free: int) -> tuple[list[str], list[str]]:
    """(artifact digests, foreign binding keys): the least recently used of both, unpinned,
    in one order of last use, until ``to_free`` bytes are chosen (docs/design.md section 10).

    Both queries stream in their index's order and are merged; reading stops once enough
    is chosen. The store's evictor asks this only when foreign bindings exist; otherwise
    its artifacts-only choice is unchanged.
    """
    last_use = sa.func.coalesce(_artifacts.c.last_used_at, _artifacts.c.created_at)
    artifacts = (
        sa.select(last_use, _artifacts.c.digest, _artifacts.c.size)
        .where(~pinned(_artifacts.c.digest))
        .order_by(last_use, _artifacts.c.digest)
    )
    bindings = (
        sa.select(_bindings.c.last_used_at, _bindings.c.binding_key, _bindings.c.size)
        .where(_unpinned_binding())
        .order_by(_bindings.c.last_used_at, _bindings.c.binding_key)
    )
    digests: list[str] = []
    keys: list[str] = []
    chosen = 0
    with db.connect() as one, db.connect() as other:

        def rows(
            conn: sa.Connection, query: sa.Select[Any], kind: int
        ) -> Iterator[tuple[Any, ...]]:
            for at, name, size in conn.execution_options(yield_per=2000).execute(query):
                yield (_aware(at), kind, name, int(size))

        for _, kind, name, size in heapq.merge(rows(one, artifacts, 0), rows(other, bindings, 1)):
            if chosen >= to_free:
                break
            (digests if kind == 0 else keys).append(name)
            chosen += size
    return digests, keys


def _aware(at: datetime) -> datetime:
    return at if at.tzinfo is not None else at.replace(tzinfo=timezone.utc)


class ForeignStore:
    """Foreign bindings in the database, their files in the store; see the module docstring."""

    def __init__(self, db: sa.Engine, store: ArtifactStore, signer: ArtifactSigner) -> None:
        self.db = db
        self.store = store
        self.signer = signer
        self._signatures: LruCache[str, tuple[ForeignBinding, Signature]] = LruCache(
            max_entries=_MEMO
        )

    def store_blob(self, digest: str, data: bytes) -> bool:
        """Store a file's bytes under ``digest`` (they must hash to it); True when they were new."""
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise InvalidRequestError(
                "body", f"the body hashes to {actual}, not to the digest in the path {digest}"
            )
        new = not self.store.has(digest)
        self.store.put(data)  # the same bytes again: a no-op that renews the blob's time
        return new

    def publish(self, binding: ForeignBinding) -> tuple[StoredBinding, bool]:
        """Publish ``binding`` unless its name is bound already: (the binding in place, published)."""
        for ref in binding.files:
            info = self.store.blob_info(ref.digest)
            if info is None:
                raise ArtifactNotFoundError(
                    f"the group's file {ref.name} ({ref.digest}) is not stored: PUT "
                    "/v1/blobs/{digest} each file's bytes first, then the group"
                )
            if info.size != ref.size:
                raise InvalidRequestError(
                    "files", f"file {ref.name} is {info.size} bytes as stored, not {ref.size}"
                )
        key = binding.binding_key
        existing = self.get(key, touch=False)
        if existing is not None:
            return existing, False
        now = utcnow()
        try:
            with self.db.begin() as conn:
                row_id = conn.execute(
                    sa.insert(_bindings)
                    .values(
                        binding_key=key,
                        **binding.name.to_dict(),
                        writer=binding.writer,
                        size=binding.size,
                        published_at=now,
                        last_used_at=now,
                    )
                    .returning(_bindings.c.id)
                ).scalar_one()
                conn.execute(
                    sa.insert(_files),
                    [
                        {"binding_id": row_id, "name": f.name, "digest": f.digest, "size": f.size}
                        for f in binding.files
                    ],
                )
        except sa.exc.IntegrityError:  # another writer published the name meanwhile
            existing = self.get(key, touch=False)
            if existing is None:
                raise
            return existing, False
        return StoredBinding(binding, now, now), True

    def get(self, binding_key: str, *, touch: bool = True) -> StoredBinding | None:
        """The binding filed under ``binding_key``, or None; ``touch`` refreshes its last use."""
        with self.db.connect() as conn:
            row = conn.execute(
                sa.select(_bindings).where(_bindings.c.binding_key == binding_key)
            ).first()
            if row is None:
                return None
            files = conn.execute(
                sa.select(_files.c.name, _files.c.digest, _files.c.size)
                .where(_files.c.binding_id == row.id)
                .order_by(_files.c.name)
            ).all()
        now = utcnow()
        if touch and now - row.last_used_at > _TOUCH_AFTER:
            with self.db.begin() as conn:
                conn.execute(
                    sa.update(_bindings).where(_bindings.c.id == row.id).values(last_used_at=now)
                )
        binding = ForeignBinding(
            ForeignName(row.library, row.version, row.target, row.toolchain, row.key),
            files=tuple(ForeignFileRef(f.name, f.digest, int(f.size)) for f in files),
            writer=row.writer,
        )
        return StoredBinding(binding, row.published_at, row.last_used_at)

    def delete(self, binding_key: str, reason: str) -> bool:
        """Remove the binding (its files' blobs go with garbage collection); True if it was there.

        A withdrawal too, in the same transaction
        (:func:`~kcache_server.index.record_withdrawal`): the binding key and the group's
        content digest (:func:`kcache.foreign.group_digest`), so that node tiers and
        processes holding the group stop using it, ``reason`` saying why. Eviction writes
        none: an evicted binding was right.
        """
        with self.db.begin() as conn:
            serialise_withdrawals(conn)
            # Writes first (kcache_server.index's module docstring): SQLite's lock, then reads.
            files = conn.execute(
                sa.delete(_files)
                .where(
                    _files.c.binding_id.in_(
                        sa.select(_bindings.c.id).where(_bindings.c.binding_key == binding_key)
                    )
                )
                .returning(_files.c.name, _files.c.digest, _files.c.size)
            ).all()
            removed = conn.execute(
                sa.delete(_bindings)
                .where(_bindings.c.binding_key == binding_key)
                .returning(_bindings.c.id)
            ).all()
            if not removed:
                return False
            refs = [ForeignFileRef(f.name, f.digest, int(f.size)) for f in files]
            record_withdrawal(conn, binding_key, group_digest(refs), reason)
        self._signatures.discard(binding_key)
        return True

    def usage(self) -> tuple[int, int]:
        """(bindings, bytes) stored: what they add to the store's size against its cap."""
        with self.db.connect() as conn:
            count, size = conn.execute(
                sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(_bindings.c.size), 0))
            ).one()
        return int(count), int(size)

    def evict(
        self, binding_keys: Sequence[str], *, unused_since: datetime | None = None
    ) -> list[EvictedBinding]:
        """Remove these bindings' rows (never a pinned one, nor with ``unused_since`` one used
        after it); their blobs are the caller's to collect, where no row names them."""
        evicted: list[EvictedBinding] = []
        keys = list(binding_keys)
        for start in range(0, len(keys), 500):
            chunk = keys[start : start + 500]
            conds = [_bindings.c.binding_key.in_(chunk), _unpinned_binding()]
            if unused_since is not None:
                conds.append(_bindings.c.last_used_at <= unused_since)
            with self.db.begin() as conn:
                rows = conn.execute(
                    sa.select(_bindings.c.id, _bindings.c.binding_key, _bindings.c.size).where(
                        *conds
                    )
                ).all()
                if not rows:
                    continue
                ids = [r.id for r in rows]
                files = conn.execute(
                    sa.select(_files.c.binding_id, _files.c.digest).where(
                        _files.c.binding_id.in_(ids)
                    )
                ).all()
                conn.execute(sa.delete(_files).where(_files.c.binding_id.in_(ids)))
                conn.execute(sa.delete(_bindings).where(_bindings.c.id.in_(ids)))
            by_id: dict[int, list[str]] = {}
            for binding_id, digest in files:
                by_id.setdefault(binding_id, []).append(digest)
            for r in rows:
                self._signatures.discard(r.binding_key)
                evicted.append(
                    EvictedBinding(r.binding_key, int(r.size), tuple(by_id.get(r.id, ())))
                )
        return evicted

    def signature(self, binding: ForeignBinding) -> Signature:
        """The server's signature of "published by <writer>" for ``binding`` (memoised)."""
        key = binding.binding_key
        known = self._signatures.get(key)
        if known is not None and known[0] == binding:
            return known[1]
        signature = self.signer.key.sign_foreign(binding)
        self._signatures.put(key, (binding, signature))
        return signature
