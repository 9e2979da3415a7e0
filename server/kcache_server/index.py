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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from kcache.artifact import ArtifactMeta, CompileFailure, ManifestEntry
from kcache.deps import Dependency
from kcache.elf import EM_CUDA, cubin_sm
from kcache.errors import ArtifactNotFoundError, CorruptArtifactError, InvalidArtifactError
from kcache.eviction import LruCandidate, least_recently_used
from kcache.index.base import MANIFEST_LIMIT
from kcache.keys import canonical_json, require_hex_key, sha256_hex
from kcache.store.local import LocalArtifactStore
from kcache_server.models import WITHDRAWAL_REASON_LENGTH, utcnow
from kcache_server.models import artifacts_table as _artifacts
from kcache_server.models import compile_charges_table as _charges
from kcache_server.models import evictions_table as _evictions
from kcache_server.models import foreign_bindings_table as _foreign
from kcache_server.models import foreign_files_table as _foreign_files
from kcache_server.models import manifests_table as _manifests
from kcache_server.models import negative_entries_table as _negatives
from kcache_server.models import pins_table as _pins
from kcache_server.models import recipe_aliases_table as _aliases
from kcache_server.models import withdrawals_table as _withdrawals

__all__ = [
    "RemovedArtifact",
    "SqlIndex",
    "StoreUsage",
    "pinned",
    "record_withdrawal",
    "serialise_withdrawals",
]

# When an artifact was last served (batched from the hit path), else when it was made.
_last_use = sa.func.coalesce(_artifacts.c.last_used_at, _artifacts.c.created_at)
# Rows deleted per transaction by an eviction: short transactions, few round trips.
_EVICT_BATCH = 2000


# pg_advisory_xact_lock(int, int) serialising withdrawals, apart from the evictor's and
# the per-recipe compile locks.
_WITHDRAWAL_LOCK = {"a": 0x6B63, "b": 0x57445257}  # "kc", "WDRW"


def serialise_withdrawals(conn: sa.Connection) -> None:
    """Make the transaction of ``conn`` the only one writing withdrawals until it ends; its
    first statement. Withdrawals are written one at a time (on PostgreSQL under a
    transaction-scoped advisory lock; SQLite has one writer), so their ids commit in order
    and a reader that saw id N never misses a smaller one committed later."""
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:a, :b)"), _WITHDRAWAL_LOCK)


def record_withdrawal(conn: sa.Connection, recipe_key: str, digest: str, reason: str) -> int:
    """Write the row saying ``recipe_key`` no longer answers ``digest``, in the transaction
    that removed the binding (begun with :func:`serialise_withdrawals`); its id."""
    inserted = conn.execute(
        sa.insert(_withdrawals)
        .values(
            at=utcnow(),
            recipe_key=recipe_key,
            digest=digest,
            reason=reason[:WITHDRAWAL_REASON_LENGTH],
        )
        .returning(_withdrawals.c.id)
    )
    return int(inserted.scalar_one())


def pinned(digest: sa.ColumnElement[str]) -> sa.ColumnElement[bool]:
    """True for an artifact some pinned recipe key resolves to.

    Uncorrelated (the digests pins reach, computed once per statement): pins are few,
    artifacts many, and a per-row lookup would cost a pass over 100k rows dearly.
    """
    alias = _aliases.alias("pinned_alias")
    reached = sa.select(alias.c.digest).join(_pins, _pins.c.recipe_key == alias.c.recipe_key)
    return digest.in_(reached)


@dataclass(frozen=True)
class StoreUsage:
    """What the store holds, as the index counts it (pinned artifacts included)."""

    artifacts: int
    bytes: int
    pinned_artifacts: int
    pinned_bytes: int
    pins: int
    oldest_use: datetime | None
    newest_use: datetime | None


@dataclass(frozen=True)
class RemovedArtifact:
    """One artifact whose rows an eviction removed: its blob's digest, size and former recipe keys."""

    digest: str
    size: int
    recipe_keys: tuple[str, ...]


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
        """Every digest an artifact row or a foreign file names (what garbage collection must keep)."""
        with self.engine.connect() as conn:
            return set(conn.execute(sa.select(_artifacts.c.digest)).scalars()) | set(
                conn.execute(sa.select(_foreign_files.c.digest)).scalars()
            )

    def names(self, digest: str) -> bool:
        """True when an artifact row or a foreign file names ``digest`` now (garbage collection's last check)."""
        _check(digest)
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(_artifacts.c.digest).where(_artifacts.c.digest == digest)
            ).first()
            if row is None:
                row = conn.execute(
                    sa.select(_foreign_files.c.digest).where(_foreign_files.c.digest == digest)
                ).first()
        return row is not None

    def named(self, digests: Sequence[str]) -> set[str]:
        """Those of ``digests`` an artifact row or a foreign file names now (eviction's last check, batched)."""
        found: set[str] = set()
        with self.engine.connect() as conn:
            for start in range(0, len(digests), _EVICT_BATCH):
                chunk = [_check(d) for d in digests[start : start + _EVICT_BATCH]]
                found.update(
                    conn.execute(
                        sa.select(_artifacts.c.digest).where(
                            self._among(_artifacts.c.digest, chunk)
                        )
                    ).scalars()
                )
                found.update(  # a foreign file's blob is kept as an artifact's is
                    conn.execute(
                        sa.select(_foreign_files.c.digest).where(
                            self._among(_foreign_files.c.digest, chunk)
                        )
                    ).scalars()
                )
        return found

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
            sa.select(
                _manifests.c.digest,
                _manifests.c.dependencies,
                _manifests.c.created_at,
                _manifests.c.dependency_check,
            )
            .where(_manifests.c.base_key == base_key)
            .order_by(_manifests.c.created_at.desc(), _manifests.c.id.desc())
            .limit(MANIFEST_LIMIT)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [
            ManifestEntry(
                r.digest, _deps(r.dependencies), r.created_at.timestamp(), r.dependency_check
            )
            for r in rows
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
            # from the bare blob after a lost database, or its dependency list was proven
            # less well: then this compile's metadata, which knows lowered names and
            # dependencies, takes its place.
            conn.execute(
                insert.on_conflict_do_update(
                    index_elements=["digest"],
                    set_={
                        **{k: insert.excluded[k] for k in row if k != "digest"},
                        "recovered": False,
                    },
                    where=_artifacts.c.recovered.is_(True)
                    | (_artifacts.c.dependency_check < insert.excluded.dependency_check),
                )
            )
            upsert = self._insert(_manifests).values(
                base_key=base_key,
                dependencies_hash=sha256_hex(canonical_json(deps)),
                digest=meta.digest,
                dependencies=deps,
                created_at=now,
                dependency_check=meta.dependency_check,
            )
            conn.execute(
                upsert.on_conflict_do_update(
                    index_elements=["base_key", "dependencies_hash"],
                    set_={
                        "digest": upsert.excluded.digest,
                        "created_at": upsert.excluded.created_at,
                        "dependency_check": upsert.excluded.dependency_check,
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
        # INSERT ... SELECT: an artifact evicted since the caller looked it up gets no
        # alias (the recipe is a plain miss next time) instead of a foreign-key error.
        found = sa.select(
            sa.literal(recipe_key, sa.String(64)).label("recipe_key"),
            _artifacts.c.digest,
            sa.literal(now, _aliases.c.created_at.type).label("created_at"),
        ).where(_artifacts.c.digest == digest)
        stmt = self._insert(_aliases).from_select(["recipe_key", "digest", "created_at"], found)
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

    def withdraw_binding(self, recipe_key: str, digest: str, reason: str, *, base_key: str) -> int:
        """Stop ``recipe_key`` answering ``digest``, and record it; the new withdrawal's id.

        For a binding verification found wrong. In one transaction: the alias of
        ``recipe_key`` goes if it still names ``digest`` (a fresh compile may have bound
        the key since), so do the manifest entries of ``base_key`` (the recipe's) that
        name it, and a ``withdrawals`` row says so, which every replica, worker process
        and client reads. Other recipes whose key names the same bytes keep their
        binding: the bytes are right for them. The artifact row and blob stay.

        Withdrawals are written one at a time
        (:func:`serialise_withdrawals`), so their ids commit in
        order.
        """
        _check(recipe_key)
        _check(digest)
        _check(base_key)
        with self.engine.begin() as conn:
            serialise_withdrawals(conn)
            # Writes first (see the module docstring): the alias delete takes SQLite's lock.
            conn.execute(
                sa.delete(_aliases).where(
                    _aliases.c.recipe_key == recipe_key, _aliases.c.digest == digest
                )
            )
            conn.execute(
                sa.delete(_manifests).where(
                    _manifests.c.base_key == base_key, _manifests.c.digest == digest
                )
            )
            return record_withdrawal(conn, recipe_key, digest, reason)

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

    # ------------------------------------------------------------------ bounded storage
    def usage(self) -> StoreUsage:
        """Artifacts and foreign bindings stored and their bytes, how many of them are pinned, and
        the oldest and newest use."""
        is_pinned = pinned(_artifacts.c.digest)
        with self.engine.connect() as conn:
            count, size, oldest, newest = conn.execute(
                sa.select(
                    sa.func.count(),
                    sa.func.coalesce(sa.func.sum(_artifacts.c.size), 0),
                    sa.func.min(_last_use),
                    sa.func.max(_last_use),
                )
            ).one()
            pinned_count, pinned_size = conn.execute(
                sa.select(
                    sa.func.count(), sa.func.coalesce(sa.func.sum(_artifacts.c.size), 0)
                ).where(is_pinned)
            ).one()
            pins = conn.execute(sa.select(sa.func.count()).select_from(_pins)).scalar_one()
            # Foreign bindings (docs/design.md section 10) are stored bytes too, under one cap.
            f_count, f_size, f_oldest, f_newest = conn.execute(
                sa.select(
                    sa.func.count(),
                    sa.func.coalesce(sa.func.sum(_foreign.c.size), 0),
                    sa.func.min(_foreign.c.last_used_at),
                    sa.func.max(_foreign.c.last_used_at),
                )
            ).one()
            f_pinned_count, f_pinned_size = (0, 0)
            if f_count:
                f_pinned_count, f_pinned_size = conn.execute(
                    sa.select(
                        sa.func.count(), sa.func.coalesce(sa.func.sum(_foreign.c.size), 0)
                    ).where(_foreign.c.binding_key.in_(sa.select(_pins.c.recipe_key)))
                ).one()
        return StoreUsage(
            int(count) + int(f_count),
            int(size) + int(f_size),
            int(pinned_count) + int(f_pinned_count),
            int(pinned_size) + int(f_pinned_size),
            int(pins),
            min((t for t in (oldest, f_oldest) if t is not None), default=None),
            max((t for t in (newest, f_newest) if t is not None), default=None),
        )

    def least_recently_used(self, to_free: int) -> list[str]:
        """Digests of unpinned artifacts that the LRU policy chooses to free ``to_free`` bytes.

        The choice is :func:`kcache.eviction.least_recently_used`'s; the query only
        fetches its candidates, streamed in the policy's order (last use, then digest),
        and reading stops once the policy has chosen enough. Fewer when the unpinned
        artifacts together are smaller.
        """
        query = (
            sa.select(_artifacts.c.digest, _artifacts.c.size)
            .where(~pinned(_artifacts.c.digest))
            .order_by(_last_use, _artifacts.c.digest)
        )
        with self.engine.connect() as conn:
            rows = conn.execution_options(yield_per=2000).execute(query)
            # A row's rank in that order is its recency stamp (comparable, as the policy
            # asks): reading and parsing every row's timestamp would cost more than the query.
            candidates = (
                LruCandidate(digest, int(size), float(rank))
                for rank, (digest, size) in enumerate(rows)
            )
            return [c.name for c in least_recently_used(candidates, to_free, in_order=True)]

    def evict(
        self, digests: Iterable[str], reason: str, *, unused_since: datetime | None = None
    ) -> list[RemovedArtifact]:
        """Remove the rows of these artifacts: aliases, manifest entries, charges, the artifact.

        Skipped: pinned artifacts, and with ``unused_since`` those used (or made) after
        it, so a hit between choosing and deleting keeps its artifact. Each removal is
        logged in ``evictions`` in the same transaction. Blobs are the caller's to
        delete afterwards, and only where no row names them again.
        """
        wanted = [_check(d) for d in digests]
        evicted: list[RemovedArtifact] = []
        for start in range(0, len(wanted), _EVICT_BATCH):
            evicted += self._evict_batch(wanted[start : start + _EVICT_BATCH], reason, unused_since)
        return evicted

    def _among(
        self, column: sa.ColumnElement[str], values: list[str] | sa.Select[Any]
    ) -> sa.ColumnElement[bool]:
        """``column IN values``; on PostgreSQL a list goes as one array parameter (``= ANY``).

        Thousands of bind parameters per statement cost more to build and to parse
        than the deletes they select for.
        """
        if isinstance(values, list) and self.engine.dialect.name == "postgresql":
            array = sa.bindparam(None, values, type_=postgresql.ARRAY(sa.String(64)))
            return column == sa.any_(array)
        return column.in_(values)

    def _evict_batch(
        self, digests: list[str], reason: str, unused_since: datetime | None
    ) -> list[RemovedArtifact]:
        conds: list[sa.ColumnElement[bool]] = [
            self._among(_artifacts.c.digest, digests),
            ~pinned(_artifacts.c.digest),
        ]
        if unused_since is not None:
            conds.append(_last_use <= unused_since)
        victims: list[str] | sa.Select[Any] = sa.select(_artifacts.c.digest).where(*conds)
        with self.engine.begin() as conn:
            if self.engine.dialect.name == "postgresql":
                # Lock the chosen rows: a concurrent refresh of last_used_at waits, and the
                # statements below act on exactly this set.
                assert not isinstance(victims, list)
                victims = list(conn.execute(victims.with_for_update()).scalars())
                if not victims:
                    return []
            # On SQLite the first statement is a write, which takes the database's write
            # lock: nothing changes between these statements.
            keys = conn.execute(
                sa.delete(_aliases)
                .where(self._among(_aliases.c.digest, victims))
                .returning(_aliases.c.recipe_key, _aliases.c.digest)
            ).all()
            conn.execute(sa.delete(_manifests).where(self._among(_manifests.c.digest, victims)))
            gone = conn.execute(
                sa.delete(_artifacts)
                .where(self._among(_artifacts.c.digest, victims))
                .returning(_artifacts.c.digest, _artifacts.c.size)
            ).all()
            if not gone:
                return []
            by_digest: dict[str, list[str]] = {}
            for key, digest in keys:
                by_digest.setdefault(digest, []).append(key)
            evicted = [
                RemovedArtifact(digest, int(size), tuple(sorted(by_digest.get(digest, ()))))
                for digest, size in gone
            ]
            names = [e.digest for e in evicted]
            conn.execute(sa.delete(_charges).where(self._among(_charges.c.digest, names)))
            now = utcnow()
            conn.execute(
                sa.insert(_evictions),
                [
                    {
                        "at": now,
                        "digest": e.digest,
                        "size": e.size,
                        "recipe_keys": list(e.recipe_keys),
                        "reason": reason,
                    }
                    for e in evicted
                ],
            )
        return evicted

    def digests_for(self, keys: Iterable[str]) -> dict[str, str | None]:
        """For each key, the digest of the artifact it names: a recipe key's alias, or a digest itself."""
        wanted = [_check(k) for k in keys]
        found: dict[str, str | None] = dict.fromkeys(wanted)
        with self.engine.connect() as conn:
            for start in range(0, len(wanted), _EVICT_BATCH):
                chunk = wanted[start : start + _EVICT_BATCH]
                for key, digest in conn.execute(
                    sa.select(_aliases.c.recipe_key, _aliases.c.digest).where(
                        _aliases.c.recipe_key.in_(chunk)
                    )
                ):
                    found[key] = digest
                for (digest,) in conn.execute(
                    sa.select(_artifacts.c.digest).where(_artifacts.c.digest.in_(chunk))
                ):
                    found[digest] = found[digest] or digest
        return found
