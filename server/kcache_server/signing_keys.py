"""The signing keys recorded in the database: one key in use by every server that shares it.

Clients accept an answer signed by a key they were given (``KCACHE_TRUSTED_KEYS``, the
fleet's public key that job images carry) or pinned for the URL; replicas behind one
URL must therefore sign with one key. Each server records the public half of its key
in ``signing_keys`` at start-up (:func:`record_at_start`) and refuses to start
(:class:`~kcache_server.errors.SigningKeyConflictError`, one line naming
``KCACHE_SIGNING_KEY_FILE``) when the database names another key in use: a replica
that made a key of its own, or one given the wrong secret, never answers a client.

The rules, decided in one transaction at every start (serialised: PostgreSQL's
transaction-scoped advisory lock, SQLite's one writer; the ``active`` column is unique,
so the database holds at most one key in use whatever happens):

- no key in use (a new database): this server's key is recorded, in use;
- this server's key in use: it starts (``last_started_at`` is kept);
- started with ``signing_previous_key_file`` (a rotation) while the previous key is in
  use: the new key is recorded in use and the previous one retired by ``rotation``
  (superseded). Servers still running with the previous key keep serving until they are
  replaced; one started again with the previous key alone is refused, since it would
  sign beside the new key. A rotation is undone by retiring the new key: the previous one
  is then free to sign again;
- another key in use: refused, naming that key and ``kcache db signing-keys retire``;
- this server's key retired by an operator (``kcache db signing-keys retire``, for a key
  lost or compromised): refused, whatever else is recorded. Such a key never signs again.

The rows are listed and retired by ``kcache db signing-keys`` (:func:`recorded_keys`,
:func:`retire`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from kcache.errors import KCacheError
from kcache_server.errors import SigningKeyConflictError
from kcache_server.models import SIGNING_KEY_NOTE_LENGTH, utcnow
from kcache_server.models import signing_keys_table as _keys
from kcache_server.settings import Settings
from kcache_server.signer import ArtifactSigner

__all__ = ["OPERATOR", "ROTATION", "RecordedKey", "record_at_start", "recorded_keys", "retire"]

log = logging.getLogger(__name__)

#: ``retired_by`` of a key a rotation superseded (it may sign again once its successor is retired).
ROTATION = "rotation"
#: ``retired_by`` of a key ``kcache db signing-keys retire`` retired (it never signs again).
OPERATOR = "operator"

#: The transaction-scoped advisory lock that serialises start-ups and retirements on PostgreSQL.
_LOCK = {"a": 0x6B63, "b": 0x5349474B}  # "kc", "SIGK"
#: Attempts at a start-up's transaction when the database refused it for a concurrent write.
_ATTEMPTS = 3


@dataclass(frozen=True)
class RecordedKey:
    """One row of ``signing_keys``."""

    key_id: str
    public_key: str
    active: bool
    recorded_at: datetime
    last_started_at: datetime | None
    retired_at: datetime | None
    retired_by: str | None
    note: str | None

    @property
    def state(self) -> Literal["in use", "superseded", "retired"]:
        """``in use`` (servers sign with it), ``superseded`` (by a rotation) or ``retired`` (for good)."""
        if self.active:
            return "in use"
        return "superseded" if self.retired_by == ROTATION else "retired"

    def to_dict(self) -> dict[str, Any]:
        """JSON form (times RFC 3339)."""

        def stamp(at: datetime | None) -> str | None:
            return at.isoformat() if at is not None else None

        return {
            "key_id": self.key_id,
            "public_key": self.public_key,
            "state": self.state,
            "recorded_at": stamp(self.recorded_at),
            "last_started_at": stamp(self.last_started_at),
            "retired_at": stamp(self.retired_at),
            "retired_by": self.retired_by,
            "note": self.note,
        }


def _row(row: Any) -> RecordedKey:
    return RecordedKey(
        key_id=row.key_id,
        public_key=row.public_key,
        active=bool(row.active),
        recorded_at=row.recorded_at,
        last_started_at=row.last_started_at,
        retired_at=row.retired_at,
        retired_by=row.retired_by,
        note=row.note,
    )


def _serialise(conn: sa.Connection) -> None:
    """Hold the table alone until the transaction ends.

    PostgreSQL: an advisory lock. SQLite: a write first, which takes the database's one
    write lock (the driver begins the transaction at the first write; a read before it
    would run outside the transaction).
    """
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:a, :b)"), _LOCK)
    else:
        conn.execute(sa.update(_keys).where(sa.false()).values(note=_keys.c.note))


def _rows(conn: sa.Connection) -> dict[str, RecordedKey]:
    return {
        r.key_id: r
        for r in map(_row, conn.execute(sa.select(_keys).order_by(_keys.c.recorded_at)).all())
    }


def recorded_keys(engine: sa.Engine) -> list[RecordedKey]:
    """Every recorded key, the one in use first, then the most recently recorded."""
    with engine.connect() as conn:
        rows = list(_rows(conn).values())
    return sorted(rows, key=lambda r: (not r.active, -r.recorded_at.timestamp()))


def _day(at: datetime | None) -> str:
    return at.strftime("%Y-%m-%d %H:%M UTC") if at is not None else "never"


def _database(engine: sa.Engine) -> str:
    return make_url(str(engine.url)).render_as_string(hide_password=True)


def _key_setting(settings: Settings) -> str:
    """Where this server's key came from, as the refusal names it."""
    if settings.signing_key_file is not None:
        return f"KCACHE_SIGNING_KEY_FILE={settings.signing_key_file}"
    return (
        f"KCACHE_SIGNING_KEY_FILE is unset, so it was made as {settings.signing_key_path} "
        "at this data directory's first start"
    )


def record_at_start(engine: sa.Engine, signer: ArtifactSigner, settings: Settings) -> str:
    """Record this server's signing key, or refuse to start (see the module docstring).

    Returns what happened: ``recorded`` (a database that named no key), ``in use`` (the
    key was already), ``rotated`` (it replaced the previous key) or ``restored`` (a
    superseded key signing again, its successor retired).
    """
    for attempt in range(_ATTEMPTS):
        try:
            with engine.begin() as conn:
                _serialise(conn)
                outcome = _decide(conn, signer, settings, _database(engine))
        except sa.exc.IntegrityError:
            # Another server recorded a key between our read and our write (the unique
            # column or the key id said so): read again and decide again.
            if attempt == _ATTEMPTS - 1:
                raise
            continue
        key = signer.key.key_id
        if outcome == "rotated":
            assert signer.previous is not None
            log.warning(
                "signing key rotated: this server signs with key %s; key %s, which endorses it, "
                "is recorded as superseded, so a server started with it alone is refused",
                key,
                signer.previous.key_id,
            )
        elif outcome == "restored":
            log.warning("signing key %s signs again: the key that superseded it was retired", key)
        elif outcome == "recorded":
            log.info("signing key %s recorded as the key of the servers on this database", key)
        return outcome
    raise AssertionError("unreachable")  # pragma: no cover


def _decide(conn: sa.Connection, signer: ArtifactSigner, settings: Settings, database: str) -> str:
    own, previous = signer.key, signer.previous
    rows = _rows(conn)
    mine = rows.get(own.key_id)
    if mine is not None and mine.retired_by == OPERATOR:
        in_use = next((r for r in rows.values() if r.active), None)
        current = f"; the key in use is {in_use.key_id}" if in_use else ""
        raise SigningKeyConflictError(
            f"refusing to start: this server's signing key {own.key_id} ({_key_setting(settings)}) "
            f"was retired for good on {_day(mine.retired_at)} (`kcache db signing-keys retire`"
            f"{': ' + mine.note if mine.note else ''}) in the database {database}{current}. "
            "Give this server the fleet's current key file as KCACHE_SIGNING_KEY_FILE, or a new "
            "one made with `kcache signing-key create FILE` (and its public half to the clients "
            "as KCACHE_TRUSTED_KEYS)"
        )
    allowed = {own.key_id} | ({previous.key_id} if previous is not None else set())
    other = next((r for r in rows.values() if r.active and r.key_id not in allowed), None)
    if other is not None:
        superseded = (
            f"; this server's key was superseded by it on {_day(mine.retired_at)} (a rotation), "
            "so start it with the new key"
            if mine is not None and mine.retired_by == ROTATION
            else ""
        )
        with_previous = f" (its previous key: {previous.key_id})" if previous is not None else ""
        raise SigningKeyConflictError(
            f"refusing to start: the database {database} names key {other.key_id} as the signing "
            f"key of the servers that share it (recorded {_day(other.recorded_at)}, last started "
            f"{_day(other.last_started_at)}), but this server signs with key {own.key_id}"
            f"{with_previous} ({_key_setting(settings)}){superseded}. Replicas sharing a database "
            "must sign with one key, or clients refuse their answers: give every replica the same "
            "key file as KCACHE_SIGNING_KEY_FILE (a secret). If key "
            f"{other.key_id} was lost or compromised and this key replaces it, run "
            f"`kcache db signing-keys retire {other.key_id}` with this server's database "
            "settings, start again, and give clients the new public key (`kcache signing-key "
            "public FILE` prints it for KCACHE_TRUSTED_KEYS)"
        )
    now = utcnow()
    outcome = "in use" if mine is not None and mine.active else "recorded"
    if previous is not None:
        before = rows.get(previous.key_id)
        note = f"superseded by key {own.key_id}"
        if before is None:
            conn.execute(
                sa.insert(_keys).values(
                    key_id=previous.key_id,
                    public_key=previous.public_key,
                    active=None,
                    recorded_at=now,
                    retired_at=now,
                    retired_by=ROTATION,
                    note=note,
                )
            )
        elif before.active:
            conn.execute(
                sa.update(_keys)
                .where(_keys.c.key_id == previous.key_id)
                .values(active=None, retired_at=now, retired_by=ROTATION, note=note)
            )
            outcome = "rotated"
    if mine is None:
        conn.execute(
            sa.insert(_keys).values(
                key_id=own.key_id,
                public_key=own.public_key,
                active=True,
                recorded_at=now,
                last_started_at=now,
            )
        )
    else:
        if not mine.active and outcome != "rotated":
            outcome = "restored"
        conn.execute(
            sa.update(_keys)
            .where(_keys.c.key_id == own.key_id)
            .values(active=True, last_started_at=now, retired_at=None, retired_by=None, note=None)
        )
    return outcome


def retire(engine: sa.Engine, key_id: str, reason: str | None = None) -> tuple[RecordedKey, bool]:
    """Retire ``key_id`` for good: no server starts with it again. (its row now, whether it changed)

    A :class:`~kcache.errors.KCacheError` names a key the database does not record.
    Servers already running with it keep signing until they stop.
    """
    note = (reason or "").strip()[:SIGNING_KEY_NOTE_LENGTH] or None
    with engine.begin() as conn:
        _serialise(conn)
        rows = _rows(conn)
        found = rows.get(key_id)
        if found is None:
            known = ", ".join(sorted(rows)) or "none"
            raise KCacheError(
                f"no signing key {key_id} is recorded in the database {_database(engine)} "
                f"(recorded: {known}); `kcache db signing-keys` lists them with their 16-digit ids"
            )
        if found.retired_by == OPERATOR:
            return found, False
        conn.execute(
            sa.update(_keys)
            .where(_keys.c.key_id == key_id)
            .values(active=None, retired_at=utcnow(), retired_by=OPERATOR, note=note)
        )
        changed = _rows(conn)[key_id]
    return changed, True
