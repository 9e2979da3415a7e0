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
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa

from kcache.errors import ArtifactNotFoundError
from kcache.foreign import ForeignBinding, ForeignFileRef
from kcache.lru import LruCache
from kcache.signing import Signature
from kcache.store.base import ArtifactStore
from kcache_server.errors import InvalidRequestError
from kcache_server.models import foreign_bindings_table as _bindings
from kcache_server.models import foreign_files_table as _files
from kcache_server.models import utcnow
from kcache_server.signer import ArtifactSigner

__all__ = ["ForeignStore", "StoredBinding"]

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
                        library=binding.library,
                        version=binding.version,
                        target=binding.target,
                        toolchain=binding.toolchain,
                        key=binding.key,
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
            library=row.library,
            version=row.version,
            target=row.target,
            toolchain=row.toolchain,
            key=row.key,
            files=tuple(ForeignFileRef(f.name, f.digest, int(f.size)) for f in files),
            writer=row.writer,
        )
        return StoredBinding(binding, row.published_at, row.last_used_at)

    def delete(self, binding_key: str) -> bool:
        """Remove the binding (its files' blobs go with garbage collection); True if it was there."""
        with self.db.begin() as conn:
            row_id = conn.execute(
                sa.select(_bindings.c.id).where(_bindings.c.binding_key == binding_key)
            ).scalar()
            if row_id is None:
                return False
            conn.execute(sa.delete(_files).where(_files.c.binding_id == row_id))
            conn.execute(sa.delete(_bindings).where(_bindings.c.id == row_id))
        self._signatures.discard(binding_key)
        return True

    def signature(self, binding: ForeignBinding) -> Signature:
        """The server's signature of "published by <writer>" for ``binding`` (memoised)."""
        key = binding.binding_key
        known = self._signatures.get(key)
        if known is not None and known[0] == binding:
            return known[1]
        signature = self.signer.key.sign_foreign(binding)
        self._signatures.put(key, (binding, signature))
        return signature
