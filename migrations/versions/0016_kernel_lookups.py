"""``audit_lookups`` and ``audit_job_builds``: kernel lookups, what every hit rate counts.

A kernel lookup is a process's first lookup of a recipe, decided when it is written: a
hit when it needed no compile anywhere (its first lookup found the kernel, and no rank of
its job had compiled it), with the compile time it avoided and a miss's reason
(:mod:`kcache_server.auditing.lookups`). ``audit_job_builds`` lists the recipes each job
compiled or joined a compile of. The upgrade records the kernel lookups of the raw events
already there, oldest first, deciding each as the writer did when this revision was
written (``kcache_server.auditing.lookups.record_lookups`` at commit 103f988, frozen
below with the tables as they are at 0016); events already rolled up into hourly counts
start none.

Revision ID: 0016
Revises: 0015
Create Date: 2027-03-12
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql, sqlite

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_REASON = 96  # models.LOOKUP_REASON_LENGTH when this revision was written
_REPORTER = 270  # models.REPORTER_LENGTH


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "audit_lookups",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("process", sa.String(length=64), nullable=True),
        sa.Column("identity", sa.String(length=64), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("hit", sa.Boolean(), nullable=False),
        sa.Column("reason", sa.String(length=_REASON), nullable=True),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("saved", sa.Double(), nullable=False),
        sa.Column("recipe_key", sa.String(length=64), nullable=True),
        sa.Column("base_key", sa.String(length=64), nullable=True),
        sa.Column("digest", sa.String(length=64), nullable=True),
        sa.Column("kernel", sa.String(length=1024), nullable=True),
        sa.Column("target", sa.String(length=32), nullable=True),
        sa.Column("client_id", sa.String(length=256), nullable=True),
        sa.Column("job_id", sa.String(length=256), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("reporter", sa.String(length=_REPORTER), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_lookups")),
    )
    with op.batch_alter_table("audit_lookups", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_lookups_at"), ["at"], unique=False)
        batch_op.create_index(
            batch_op.f("ix_audit_lookups_process_identity"), ["process", "identity"], unique=True
        )
        batch_op.create_index(
            batch_op.f("ix_audit_lookups_job_id_at"), ["job_id", "at"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_audit_lookups_kernel_at"), ["kernel", "at"], unique=False
        )
    op.create_table(
        "audit_job_builds",
        sa.Column("job_id", sa.String(length=256), nullable=False),
        sa.Column("identity", sa.String(length=64), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "identity", name=op.f("pk_audit_job_builds")),
    )
    with op.batch_alter_table("audit_job_builds", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_job_builds_at"), ["at"], unique=False)

    _backfill(op.get_bind())


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("audit_job_builds", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_job_builds_at"))
    op.drop_table("audit_job_builds")
    with op.batch_alter_table("audit_lookups", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_lookups_kernel_at"))
        batch_op.drop_index(batch_op.f("ix_audit_lookups_job_id_at"))
        batch_op.drop_index(batch_op.f("ix_audit_lookups_process_identity"))
        batch_op.drop_index(batch_op.f("ix_audit_lookups_at"))
    op.drop_table("audit_lookups")


# ------------------------------------------------------------------ the frozen backfill
# kcache_server.auditing.lookups as at 103f988: backfill and the writer's decisions it
# makes (record_lookups), over the tables as they are at 0016.
class _UTCDateTime(sa.types.TypeDecorator[datetime]):
    """kcache_server.models.UTCDateTime: aware UTC on every backend (SQLite stores it naive)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime")
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value


_events = sa.table(
    "audit_events",
    sa.column("id", sa.BigInteger()),
    sa.column("at", _UTCDateTime()),
    *(sa.column(c, sa.String()) for c in ("outcome", "tier", "recipe_key", "base_key", "digest")),
    *(sa.column(c, sa.String()) for c in ("kernel", "target", "error", "client_id", "host")),
    *(sa.column(c, sa.String()) for c in ("job_id", "reporter")),
    *(sa.column(c, sa.Integer()) for c in ("pid", "rank")),
    sa.column("count", sa.BigInteger()),
    sa.column("compile_seconds_saved", sa.Float()),
)
_artifacts = sa.table("artifacts", sa.column("digest", sa.String()))
_builds = sa.table(
    "audit_job_builds",
    *(sa.column(c, sa.String()) for c in ("job_id", "identity")),
    sa.column("at", _UTCDateTime()),
)
_lookups = sa.table(
    "audit_lookups",
    sa.column("at", _UTCDateTime()),
    *(sa.column(c, sa.String()) for c in ("process", "identity", "outcome", "tier", "reason")),
    *(sa.column(c, sa.String()) for c in ("recipe_key", "base_key", "digest", "kernel")),
    *(sa.column(c, sa.String()) for c in ("target", "client_id", "job_id", "reporter")),
    sa.column("hit", sa.Boolean()),
    sa.column("count", sa.BigInteger()),
    sa.column("saved", sa.Double()),
    sa.column("rank", sa.Integer()),
)
_FOUND = ("hit", "local_hit")
_BUILT = ("compiled", "waited")
_LOOKUP_OUTCOMES = ("hit", "local_hit", "compiled", "waited", "miss", "error", "bypass")
_PAIRS_PER_STATEMENT = 5000


def _hash(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, separators=(",", ":")).encode()).hexdigest()


def _process_of(event: Mapping[str, Any]) -> str | None:
    who = tuple(event.get(k) for k in ("job_id", "rank", "host", "pid", "client_id"))
    return None if all(v is None for v in who) else _hash("process", *who)


def _identity_of(event: Mapping[str, Any]) -> str | None:
    key = event.get("recipe_key")
    if key:
        return str(key)
    target = event.get("target")
    if event.get("base_key"):
        return _hash("base", event["base_key"], target)
    if event.get("kernel"):
        return _hash("kernel", event["kernel"], target)
    if event.get("outcome") == "bypass":
        return _hash("bypass", event.get("error"), target)
    return None


def _insert(conn: sa.Connection, table: sa.TableClause) -> Any:
    return (postgresql if conn.dialect.name == "postgresql" else sqlite).insert(table)


def _chunks(items: Sequence[Any]) -> list[Sequence[Any]]:
    return [items[i : i + _PAIRS_PER_STATEMENT] for i in range(0, len(items), _PAIRS_PER_STATEMENT)]


def _existing(conn: sa.Connection, pairs: list[tuple[str, str]]) -> set[tuple[str, str]]:
    c = _lookups.c
    found: set[tuple[str, str]] = set()
    for chunk in _chunks(pairs):
        rows = conn.execute(
            sa.select(c.process, c.identity).where(sa.tuple_(c.process, c.identity).in_(chunk))
        )
        found.update((str(p), str(i)) for p, i in rows)
    return found


def _built(conn: sa.Connection, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], datetime]:
    c = _builds.c
    found: dict[tuple[str, str], datetime] = {}
    for chunk in _chunks(pairs):
        rows = conn.execute(
            sa.select(c.job_id, c.identity, c.at).where(sa.tuple_(c.job_id, c.identity).in_(chunk))
        )
        found.update({(str(j), str(i)): at for j, i, at in rows})
    return found


def _known_digests(conn: sa.Connection, digests: set[str]) -> set[str]:
    found: set[str] = set()
    ordered = sorted(digests)
    for i in range(0, len(ordered), _PAIRS_PER_STATEMENT):
        rows = conn.execute(
            sa.select(_artifacts.c.digest).where(
                _artifacts.c.digest.in_(ordered[i : i + _PAIRS_PER_STATEMENT])
            )
        )
        found.update(str(d) for (d,) in rows)
    return found


def _history(conn: sa.Connection, event: Mapping[str, Any]) -> str:
    ev = _events.c
    key, at = event.get("recipe_key"), event["at"]
    if key is not None:
        served = conn.execute(
            sa.select(ev.id)
            .where(
                ev.recipe_key == key,
                ev.at < at,
                ev.outcome.in_(("hit", "local_hit", "compiled")),
            )
            .limit(1)
        ).first()
        if served is not None:
            return "evicted"
    base = event.get("base_key")
    if base is not None and key is not None:
        target = event.get("target")
        sibling = conn.execute(
            sa.select(ev.id)
            .where(
                ev.base_key == base,
                ev.target.is_(None) if target is None else ev.target == target,
                ev.recipe_key != key,
                ev.at < at,
            )
            .limit(1)
        ).first()
        if sibling is not None:
            return "headers_changed"
    return "first_build"


def _miss_reason(conn: sa.Connection, event: Mapping[str, Any]) -> str:
    outcome, error = event["outcome"], event.get("error")
    if outcome == "compiled":
        reason = _history(conn, event)
    elif outcome == "waited":
        reason = "joined_compile"
    elif outcome == "miss":
        reason = f"miss:{error}" if error and error != "not_found" else "not_cached"
    elif outcome == "error":
        reason = f"error:{error or 'unknown'}"
    else:
        reason = f"bypass:{error}" if error else "bypass:"
    return reason[:_REASON]


def _row(event: Mapping[str, Any], process: str | None, identity: str) -> dict[str, Any]:
    count = max(int(event.get("count", 1)), 1)
    saved = float(event.get("compile_seconds_saved") or 0.0)
    found = event["outcome"] in _FOUND
    return {
        "at": event["at"],
        "process": process,
        "identity": identity,
        "outcome": event["outcome"],
        "tier": event.get("tier") or "server",
        "hit": found,
        "reason": None,
        "count": 1 if process is not None else count,
        "saved": (saved / count if process is not None else saved) if found else 0.0,
        **{k: event.get(k) for k in ("recipe_key", "base_key", "digest", "kernel", "target")},
        **{k: event.get(k) for k in ("client_id", "job_id", "rank", "reporter")},
    }


def _decided(
    conn: sa.Connection,
    row: dict[str, Any],
    event: Mapping[str, Any],
    built: Mapping[tuple[str, str], datetime],
) -> dict[str, Any]:
    if row["hit"]:
        job = event.get("job_id")
        when = built.get((str(job), row["identity"])) if job is not None else None
        if when is not None and when <= event["at"]:
            row["hit"], row["reason"] = False, "built_by_job"
    else:
        row["reason"] = _miss_reason(conn, event)
    return row


def _record_lookups(conn: sa.Connection, events: Sequence[Mapping[str, Any]]) -> int:
    """The kernel lookups ``events`` start, recorded; how many were new."""
    ordered = sorted(
        (e for e in events if e["outcome"] in _LOOKUP_OUTCOMES and e.get("tier") != "memory"),
        key=lambda e: e["at"],
    )
    builds: dict[tuple[str, str], datetime] = {}
    for e in events:
        if e.get("job_id") is not None and e["outcome"] in _BUILT:
            identity = _identity_of(e)
            if identity is not None:
                pair = (str(e["job_id"]), identity)
                builds[pair] = min(builds.get(pair, e["at"]), e["at"])
    if builds:
        stmt = _insert(conn, _builds)
        conn.execute(
            stmt.on_conflict_do_update(
                index_elements=["job_id", "identity"],
                set_={
                    "at": sa.case(
                        (stmt.excluded.at < _builds.c.at, stmt.excluded.at), else_=_builds.c.at
                    )
                },
            ),
            [{"job_id": j, "identity": i, "at": at} for (j, i), at in sorted(builds.items())],
        )
    client_digests = {
        str(e["digest"]) for e in ordered if e.get("tier") != "server" and e.get("digest")
    }
    known = _known_digests(conn, client_digests) if client_digests else set()
    firsts: dict[tuple[str, str], Mapping[str, Any]] = {}
    unnamed: list[tuple[Mapping[str, Any], str]] = []
    for e in ordered:
        identity = _identity_of(e)
        if identity is None:
            continue
        if e["outcome"] == "local_hit" and str(e.get("digest")) not in known:
            continue
        process = _process_of(e)
        if process is None:
            unnamed.append((e, identity))
        else:
            firsts.setdefault((process, identity), e)
    seen = _existing(conn, sorted(firsts)) if firsts else set()
    fresh = [(pair, e) for pair, e in firsts.items() if pair not in seen]
    jobs = sorted({(str(e["job_id"]), pair[1]) for pair, e in fresh if e.get("job_id") is not None})
    built = _built(conn, jobs) if jobs else {}
    rows = [
        _decided(conn, _row(e, process, identity), e, built) for (process, identity), e in fresh
    ]
    rows += [_decided(conn, _row(e, None, identity), e, built) for e, identity in unnamed]
    if not rows:
        return 0
    stmt = _insert(conn, _lookups)
    new = conn.execute(
        stmt.on_conflict_do_nothing(index_elements=["process", "identity"]).returning(
            _lookups.c.process
        ),
        rows,
    ).all()
    return len(new)


def _backfill(conn: sa.Connection, chunk: int = 20_000) -> int:
    """Record the kernel lookups of every raw event already written, oldest first.

    Over ``audit_events`` in id order; events already rolled up start none. Returns the
    lookups recorded.
    """
    ev = _events.c
    after, total = 0, 0
    while True:
        rows = conn.execute(
            sa.select(_events).where(ev.id > after).order_by(ev.id).limit(chunk)
        ).all()
        if not rows:
            return total
        after = rows[-1].id
        total += _record_lookups(conn, [dict(r._mapping) for r in rows])
