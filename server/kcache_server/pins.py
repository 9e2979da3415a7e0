"""Pins: recipe keys whose artifacts eviction never removes.

A pin names a recipe key, not a digest, so it can be made before the recipe is ever
compiled (a release's kernel list) and keeps protecting the key's artifact when a
compile records it later. Pins made together carry a group label (a release, a job)
and can be listed and removed by it. Pinned artifacts count toward the store's size.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from kcache.errors import InvalidKeyError
from kcache.keys import is_hex_key, require_hex_key
from kcache.outcomes import SERVED_OUTCOMES
from kcache_server.errors import InvalidRequestError
from kcache_server.models import artifacts_table as _artifacts
from kcache_server.models import audit_events_table as _events
from kcache_server.models import pins_table as _pins
from kcache_server.models import recipe_aliases_table as _aliases
from kcache_server.models import utcnow

__all__ = ["MAX_KEYS", "PinInfo", "PinStore", "check_group"]

#: Recipe keys one request may pin or unpin.
MAX_KEYS = 10_000
# Group labels are printed by `kcache pin --list`: printable, no control characters.
_GROUP = re.compile(r"[^\x00-\x1f\x7f-\x9f\ud800-\udfff]{1,256}")


def check_group(group: str | None, field: str = "group") -> str:
    """The stored form of a group label ("" for none); a 422 naming ``field`` for a bad one."""
    if group is None:
        return ""
    if not isinstance(group, str) or not _GROUP.fullmatch(group):
        raise InvalidRequestError(
            field, "a group is 1 to 256 printable characters (no control characters)"
        )
    return group


def _check_keys(keys: Iterable[str], field: str) -> list[str]:
    checked = []
    for i, key in enumerate(keys):
        try:
            checked.append(require_hex_key(key, f"{field}[{i}]"))
        except InvalidKeyError as exc:
            raise InvalidRequestError(exc.field, exc.detail) from None
    if len(checked) > MAX_KEYS:
        raise InvalidRequestError(field, f"at most {MAX_KEYS} keys per request, got {len(checked)}")
    return checked


@dataclass(frozen=True)
class PinInfo:
    """A pin, with the artifact its key resolves to now (None before it is compiled)."""

    recipe_key: str
    group: str | None
    created_at: datetime
    created_by: str | None
    digest: str | None
    size: int | None


class PinStore:
    """Pins in the server's database."""

    def __init__(self, db: sa.Engine) -> None:
        self.db = db
        self._insert: Any = postgresql.insert if db.dialect.name == "postgresql" else sqlite.insert

    def add(self, keys: Iterable[str], group: str | None, created_by: str | None) -> int:
        """Pin ``keys`` under ``group``; returns how many pins are new (pinning twice is a no-op)."""
        wanted = sorted(set(_check_keys(keys, "recipe_keys")))
        label = check_group(group)
        if not wanted:
            return 0
        self._refuse_digests(wanted)
        now = utcnow()
        rows = [
            {"recipe_key": k, "group_name": label, "created_at": now, "created_by": created_by}
            for k in wanted
        ]
        with self.db.begin() as conn:
            result = conn.execute(
                self._insert(_pins)
                .values(rows)
                .on_conflict_do_nothing(index_elements=["recipe_key", "group_name"])
            )
        return int(result.rowcount or 0)

    def _refuse_digests(self, keys: list[str]) -> None:
        """Refuse a key that is a stored artifact's digest and no recipe's key: a pin names a
        recipe key, so a digest pinned by mistake would protect nothing, silently."""
        named = sa.select(_aliases.c.recipe_key).where(_aliases.c.recipe_key == _artifacts.c.digest)
        query = sa.select(_artifacts.c.digest).where(_artifacts.c.digest.in_(keys), ~named.exists())
        with self.db.connect() as conn:
            digest = conn.execute(query.limit(1)).scalar()
            if digest is None:
                return
            recipes = conn.execute(
                sa.select(_aliases.c.recipe_key).where(_aliases.c.digest == digest).limit(3)
            ).scalars()
            naming = ", ".join(recipes) or "none now"
        raise InvalidRequestError(
            "recipe_keys",
            f"{digest} is the digest of a stored artifact, not a recipe key: a pin names a "
            f"recipe key (recipe keys naming this artifact: {naming}; `kcache cache ls "
            "--server URL` lists both)",
        )

    def keys_of_job(self, job_id: str) -> list[str]:
        """Recipe keys a job was served (hit, compiled or joined), from the audit events it left."""
        if not isinstance(job_id, str) or not 1 <= len(job_id) <= 256:
            raise InvalidRequestError("job_id", "a job id is 1 to 256 characters")
        query = (
            sa.select(_events.c.recipe_key)
            .where(
                _events.c.job_id == job_id,
                _events.c.recipe_key.is_not(None),
                _events.c.digest.is_not(None),
                _events.c.outcome.in_(sorted(SERVED_OUTCOMES)),
            )
            .distinct()
            .limit(MAX_KEYS + 1)
        )
        with self.db.connect() as conn:
            keys = [k for k in conn.execute(query).scalars() if is_hex_key(k)]
        if len(keys) > MAX_KEYS:
            raise InvalidRequestError(
                "job_id",
                f"job {job_id!r} looked up more than {MAX_KEYS} recipes; pin them in parts",
            )
        return keys

    def list(self, group: str | None = None, limit: int = 1000) -> list[PinInfo]:
        """Pins (of ``group`` if given), newest first, each with its key's current artifact."""
        query = (
            sa.select(
                _pins.c.recipe_key,
                _pins.c.group_name,
                _pins.c.created_at,
                _pins.c.created_by,
                _artifacts.c.digest,
                _artifacts.c.size,
            )
            .select_from(
                _pins.outerjoin(_aliases, _aliases.c.recipe_key == _pins.c.recipe_key).outerjoin(
                    _artifacts, _artifacts.c.digest == _aliases.c.digest
                )
            )
            .order_by(_pins.c.created_at.desc(), _pins.c.id.desc())
            .limit(limit)
        )
        if group is not None:
            query = query.where(_pins.c.group_name == check_group(group))
        with self.db.connect() as conn:
            rows = conn.execute(query).all()
        return [
            PinInfo(
                r.recipe_key,
                r.group_name or None,
                r.created_at,
                r.created_by,
                r.digest,
                None if r.size is None else int(r.size),
            )
            for r in rows
        ]

    def remove(self, keys: Iterable[str] = (), group: str | None = None) -> int:
        """Unpin ``keys`` (only within ``group`` if given), or every pin of ``group``; how many went."""
        wanted = _check_keys(keys, "recipe_key")
        conds: list[sa.ColumnElement[bool]] = []
        if wanted:
            conds.append(_pins.c.recipe_key.in_(wanted))
        if group is not None:
            conds.append(_pins.c.group_name == check_group(group))
        if not conds:
            raise InvalidRequestError(
                "recipe_key", "name the recipe keys to unpin, or a group to unpin all of its pins"
            )
        with self.db.begin() as conn:
            result = conn.execute(sa.delete(_pins).where(*conds))
        return int(result.rowcount or 0)
