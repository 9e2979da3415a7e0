"""The withdrawal feed on the wire: ``GET /v1/withdrawals`` answers, checked.

What a server's feed says (docs/design.md "What a binding rests on"; the client's use of
it is :mod:`kcache_client._withdrawals`): rows in id order, each a recipe key that no
longer answers a digest. :func:`parse_page` checks an answer before anything trusts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeGuard

from kcache.errors import InvalidKeyError
from kcache.keys import require_hex_key

__all__ = ["PAGE", "WithdrawalPage", "Withdrawn", "is_int", "parse_page"]

#: Rows asked for per request (the server's most).
PAGE = 10_000


@dataclass(frozen=True)
class Withdrawn:
    """One row of the feed: ``recipe_key`` no longer answers ``digest``."""

    id: int
    recipe_key: str
    digest: str
    at: str
    reason: str


@dataclass(frozen=True)
class WithdrawalPage:
    """One answer of ``GET /v1/withdrawals``: its rows, in id order, and the last id."""

    rows: tuple[Withdrawn, ...]
    last_id: int


def is_int(value: Any) -> TypeGuard[int]:
    """An int that is not a bool (JSON's true is not an id)."""
    return isinstance(value, int) and not isinstance(value, bool)


def parse_page(body: Any, after: int, limit: int) -> WithdrawalPage:
    """The checked answer of ``GET /v1/withdrawals?after=after&limit=limit``; ValueError
    naming what is wrong with it.

    Rows are objects of an int ``id`` above ``after`` and above the row before, a
    ``recipe_key`` and a ``digest`` of 64 lowercase hex digits, an RFC 3339 ``at`` and a
    string ``reason``; at most ``limit`` of them; ``last_id`` the last row's id, or
    ``after`` when there are none.
    """
    if not isinstance(body, dict):
        raise ValueError("the answer is not a JSON object")
    rows = body.get("withdrawals")
    last_id = body.get("last_id")
    if not isinstance(rows, list):
        raise ValueError("its withdrawals are not a list")
    if not is_int(last_id):
        raise ValueError(f"its last_id is not an integer: {last_id!r}"[:200])
    if len(rows) > limit:
        raise ValueError(f"{len(rows)} rows, more than the {limit} asked for")
    out: list[Withdrawn] = []
    before = after
    for n, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"row {n} is not an object")
        ident = row.get("id")
        if not is_int(ident) or ident <= before:
            raise ValueError(f"row {n} has id {ident!r}, not an integer above {before}"[:200])
        try:
            key = require_hex_key(row.get("recipe_key"), "recipe_key")
            digest = require_hex_key(row.get("digest"), "digest")
        except InvalidKeyError as exc:
            raise ValueError(f"row {n}: {exc}") from None
        at, reason = row.get("at"), row.get("reason")
        if not isinstance(at, str) or not isinstance(reason, str):
            raise ValueError(f"row {n} has no string at and reason")
        try:
            datetime.fromisoformat(at)
        except ValueError:
            raise ValueError(f"row {n} has at {at[:40]!r}, not an RFC 3339 time") from None
        out.append(Withdrawn(ident, key, digest, at, reason))
        before = ident
    if last_id != before:
        raise ValueError(f"its last_id is {last_id}, its rows end at {before}")
    return WithdrawalPage(tuple(out), last_id)
