"""``SqlIndex``: the core ``Index`` over SQLAlchemy (SQLite embedded, PostgreSQL scaled out).

Writes issue their statements before any read in the same transaction: on SQLite a
transaction that read first cannot take the write lock when another writer
committed meanwhile, while one that writes first simply waits its turn. Concurrent
writers of the same rows are made idempotent with ON CONFLICT.

After a lost database, :meth:`SqlIndex.recover` rebuilds what the blobs alone prove
(an artifact row per verified blob, marked ``recovered``); recipe aliases and
manifests cannot be rebuilt, because a blob does not say which recipe made it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from kcache.artifact import ArtifactMeta, CompileFailure, ManifestEntry
from kcache.deps import Dependency
from kcache.elf import EM_CUDA, cubin_sm
from kcache.errors import ArtifactNotFoundError, CorruptArtifactError, InvalidArtifactError
from kcache.index.base import MANIFEST_LIMIT
from kcache.keys import canonical_json, require_hex_key, sha256_hex
from kcache.store.local import LocalArtifactStore
from kcache_server.models import Artifact, ManifestRow, NegativeEntry, RecipeAlias, utcnow

__all__ = ["SqlIndex"]

_artifacts = cast(sa.Table, Artifact.__table__)
_aliases = cast(sa.Table, RecipeAlias.__table__)
_manifests = cast(sa.Table, ManifestRow.__table__)
_negatives = cast(sa.Table, NegativeEntry.__table__)


def _check(key: str) -> str:
    return require_hex_key(key, "key")


def _stamp(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, timezone.utc) if epoch else utcnow()


def _deps_json(deps: Sequence[Dependency]) -> list[dict[str, str]]:
    return [d.to_dict() for d in deps]


def _deps(data: Sequence[dict[str, str]]) -> tuple[Dependency, ...]:
    return tuple(Dependency(d["name"], d["sha256"]) for d in data)


def _meta(row: sa.Row[Any]) -> ArtifactMeta:
    # The artifacts table mirrors ArtifactMeta's JSON form, timestamps aside, so one
    # conversion (ArtifactMeta.from_dict/to_dict) serves both directions.
    return ArtifactMeta.from_dict({**row._mapping, "created_at": row.created_at.timestamp()})


def _artifact_row(meta: ArtifactMeta) -> dict[str, Any]:
    return {**meta.to_dict(), "created_at": _stamp(meta.created_at)}


def _recovered_meta(digest: str, data: bytes, mtime: float) -> ArtifactMeta:
    """What a blob's bytes prove about the artifact: its size, kind and (mostly) target."""
    kind, target = "ltoir", ""
    if (
        data[:4] == b"\x7fELF"
        and len(data) > 19
        and int.from_bytes(data[18:20], "little") == EM_CUDA
    ):
        kind = "cubin"
        try:
            target = f"sm_{cubin_sm(data)}"  # an "a"/"f" suffix is not recorded in the ELF header
        except InvalidArtifactError:
            target = ""
    elif b".target" in data[:4096] and data[:4096].isascii():
        kind = "ptx"
        for line in data[:4096].decode("ascii").splitlines():
            if line.startswith(".target "):
                target = line.split()[1].rstrip(",")
                break
    return ArtifactMeta(
        digest=digest,
        size=len(data),
        kind=kind,
        target=target[:32],
        toolchain="",
        log="rebuilt from the blob by --recreate-index; the recipe that produced it is not known",
        dependencies_exact=False,
        created_at=mtime,
    )


class SqlIndex:
    """An :class:`~kcache.index.base.Index` in the server's SQL database."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        dialect = engine.dialect.name
        if dialect == "postgresql":
            self._insert: Any = postgresql.insert
        elif dialect == "sqlite":
            self._insert = sqlite.insert
        else:
            raise ValueError(f"SqlIndex supports SQLite and PostgreSQL, not {dialect}")

    # ------------------------------------------------------------------ reads
    def lookup(self, recipe_key: str) -> ArtifactMeta | CompileFailure | None:
        """The artifact the alias points at, else the negative entry, else None."""
        _check(recipe_key)
        query = sa.select(_artifacts).join(_aliases, _aliases.c.digest == _artifacts.c.digest)
        with self.engine.connect() as conn:
            row = conn.execute(query.where(_aliases.c.recipe_key == recipe_key)).first()
            if row is not None:
                return _meta(row)
            neg = conn.execute(
                sa.select(_negatives).where(_negatives.c.recipe_key == recipe_key)
            ).first()
        if neg is None:
            return None
        failure = CompileFailure(
            neg.recipe_key,
            neg.log,
            neg.created_at.timestamp(),
            neg.kind,
            neg.expires_at.timestamp() if neg.expires_at is not None else None,
        )
        return None if failure.expired() else failure

    def digests(self) -> set[str]:
        """Every digest an artifact row names (what garbage collection must keep)."""
        with self.engine.connect() as conn:
            return set(conn.execute(sa.select(_artifacts.c.digest)).scalars())

    def names(self, digest: str) -> bool:
        """True when an artifact row names ``digest`` now (garbage collection's last check)."""
        _check(digest)
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(_artifacts.c.digest).where(_artifacts.c.digest == digest)
            ).first()
        return row is not None

    def artifact(self, digest: str) -> ArtifactMeta | None:
        """Metadata by digest."""
        _check(digest)
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(_artifacts).where(_artifacts.c.digest == digest)).first()
        return _meta(row) if row is not None else None

    def manifest(self, base_key: str) -> list[ManifestEntry]:
        """Entries newest first, at most MANIFEST_LIMIT."""
        _check(base_key)
        query = (
            sa.select(_manifests.c.digest, _manifests.c.dependencies, _manifests.c.created_at)
            .where(_manifests.c.base_key == base_key)
            .order_by(_manifests.c.created_at.desc(), _manifests.c.id.desc())
            .limit(MANIFEST_LIMIT)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [
            ManifestEntry(r.digest, _deps(r.dependencies), r.created_at.timestamp()) for r in rows
        ]

    # ------------------------------------------------------------------ writes
    def record_artifact(self, recipe_key: str, base_key: str, meta: ArtifactMeta) -> None:
        """Artifact row, manifest entry (pruned to the limit) and alias, in one transaction."""
        _check(recipe_key)
        _check(base_key)
        _check(meta.digest)
        now = utcnow()
        deps = _deps_json(meta.dependencies)
        row = _artifact_row(meta)
        with self.engine.begin() as conn:
            insert = self._insert(_artifacts).values(**row)
            # An existing row stays (the first compile's metadata), unless it was rebuilt
            # from the bare blob after a lost database: then this compile's metadata,
            # which knows lowered names and dependencies, takes its place.
            conn.execute(
                insert.on_conflict_do_update(
                    index_elements=["digest"],
                    set_={
                        **{k: insert.excluded[k] for k in row if k != "digest"},
                        "recovered": False,
                    },
                    where=_artifacts.c.recovered.is_(True),
                )
            )
            upsert = self._insert(_manifests).values(
                base_key=base_key,
                dependencies_hash=sha256_hex(canonical_json(deps)),
                digest=meta.digest,
                dependencies=deps,
                created_at=now,
            )
            conn.execute(
                upsert.on_conflict_do_update(
                    index_elements=["base_key", "dependencies_hash"],
                    set_={
                        "digest": upsert.excluded.digest,
                        "created_at": upsert.excluded.created_at,
                    },
                )
            )
            keep = (
                sa.select(_manifests.c.id)
                .where(_manifests.c.base_key == base_key)
                .order_by(_manifests.c.created_at.desc(), _manifests.c.id.desc())
                .limit(MANIFEST_LIMIT)
            )
            conn.execute(
                sa.delete(_manifests).where(
                    _manifests.c.base_key == base_key, _manifests.c.id.not_in(keep)
                )
            )
            self._alias(conn, recipe_key, meta.digest, now)

    def record_alias(self, recipe_key: str, digest: str) -> None:
        """``recipe_key`` -> ``digest`` (replacing a negative entry, if any)."""
        _check(recipe_key)
        _check(digest)
        with self.engine.begin() as conn:
            self._alias(conn, recipe_key, digest, utcnow())

    def _alias(self, conn: sa.Connection, recipe_key: str, digest: str, now: datetime) -> None:
        stmt = self._insert(_aliases).values(recipe_key=recipe_key, digest=digest, created_at=now)
        conn.execute(
            stmt.on_conflict_do_update(index_elements=["recipe_key"], set_={"digest": digest})
        )
        conn.execute(sa.delete(_negatives).where(_negatives.c.recipe_key == recipe_key))

    def record_failure(self, failure: CompileFailure) -> None:
        """A negative entry under the failed recipe's key."""
        _check(failure.recipe_key)
        expires = failure.expires_at
        stmt = self._insert(_negatives).values(
            recipe_key=failure.recipe_key,
            log=failure.log,
            created_at=_stamp(failure.created_at),
            kind=failure.kind,
            expires_at=datetime.fromtimestamp(expires, timezone.utc)
            if expires is not None
            else None,
        )
        with self.engine.begin() as conn:
            conn.execute(
                stmt.on_conflict_do_update(
                    index_elements=["recipe_key"],
                    set_={
                        "log": stmt.excluded.log,
                        "created_at": stmt.excluded.created_at,
                        "kind": stmt.excluded.kind,
                        "expires_at": stmt.excluded.expires_at,
                    },
                )
            )

    def forget(self, recipe_key: str) -> None:
        """Remove the alias and the negative entry of ``recipe_key``."""
        _check(recipe_key)
        with self.engine.begin() as conn:
            conn.execute(sa.delete(_aliases).where(_aliases.c.recipe_key == recipe_key))
            conn.execute(sa.delete(_negatives).where(_negatives.c.recipe_key == recipe_key))

    # ------------------------------------------------------------------ recovery
    def recover(self, store: LocalArtifactStore) -> tuple[int, int]:
        """Add a ``recovered`` artifact row for every blob that verifies; (rows added, blobs quarantined).

        For a data directory whose database was lost: the rows keep the blobs from
        garbage collection and make them visible to maintenance again. Aliases and
        manifests cannot be rebuilt (a blob does not name its recipe), so every recipe
        compiles once more; that compile replaces the row's missing metadata.
        """
        added = corrupt = 0
        batch: list[dict[str, Any]] = []

        def write() -> int:
            if not batch:
                return 0
            with self.engine.begin() as conn:
                result = conn.execute(
                    self._insert(_artifacts)
                    .values(batch)
                    .on_conflict_do_nothing(index_elements=["digest"])
                )
            batch.clear()
            return int(result.rowcount or 0)

        for digest in sorted(store.digests()):
            try:
                data = store.get(digest)
                mtime = store.path(digest).stat().st_mtime
            except CorruptArtifactError:
                corrupt += 1  # moved to quarantine by the read
                continue
            except (ArtifactNotFoundError, FileNotFoundError):
                continue
            batch.append(
                {
                    **_artifact_row(_recovered_meta(digest, data, mtime or time.time())),
                    "recovered": True,
                }
            )
            if len(batch) >= 200:
                added += write()
        added += write()
        return added, corrupt
