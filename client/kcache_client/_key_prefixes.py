"""Keys as ``kcache cache ls`` prints them: a recipe key or digest, or any unique start of one.

``kcache cache rm``, ``kcache pin`` and ``kcache unpin`` take keys the way git takes a
commit: whole (64 hex digits, taken as it is, known or not), or any start of at least
:data:`MIN_PREFIX` digits that begins exactly one key of the place worked on (a node tier,
a server's store, its pins). None is an error, and so is more than one, listing them. The
candidates are asked for only when a prefix needs them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kcache.keys import is_hex_key
from kcache_client._cache_cli_text import show
from kcache_client.errors import ClientError

__all__ = ["MIN_PREFIX", "Known", "check_keys", "resolve_keys"]

#: The shortest prefix of a key accepted (git's): shorter ones would match by chance.
MIN_PREFIX = 4
_PREFIX_RE = re.compile(rf"[0-9a-f]{{{MIN_PREFIX},64}}")


@dataclass(frozen=True)
class Known:
    """A key a prefix may stand for: a recipe key or a digest, and what it names."""

    key: str
    kind: str  # "recipe key" or "digest"
    kernel: str


def check_keys(values: Sequence[str], what: str) -> list[str]:
    """Check the form of each value: a key, or a prefix of one (what ``kcache cache ls`` prints)."""
    for value in values:
        if not _PREFIX_RE.fullmatch(value):
            raise ClientError(
                f"{what} {show(value[:80])!r} is not a recipe key or digest, nor the start of one "
                f"({MIN_PREFIX} to 64 lowercase hex digits, as `kcache cache ls` prints them; "
                "`kcache key RECIPE` prints a recipe's key)"
            )
    return list(values)


def resolve_keys(
    values: Sequence[str],
    known: Callable[[], Sequence[Known]],
    where: str,
    what: str = "KEY",
    names: str = "recipe key or digest",
) -> list[str]:
    """Each value as the whole key it starts, the way git takes a commit's prefix.

    A whole key (64 digits) is taken as it is, known or not; a shorter one must begin
    exactly one of ``known()`` (asked only when a prefix needs it): none is an error
    (saying what the keys ``names``), and so is more than one, listing them.
    """
    out: list[str] = []
    candidates: Sequence[Known] | None = None
    for value in check_keys(values, what):
        if is_hex_key(value):
            out.append(value)
            continue
        if candidates is None:
            candidates = known()
        matches = {k.key: k for k in candidates if k.key.startswith(value)}
        if not matches:
            raise ClientError(
                f"{what} {value} begins no {names} of {where} (`kcache cache ls` lists them)"
            )
        if len(matches) > 1:
            shown = [
                f"{k.key[:16]} ({k.kind}{', ' + show(k.kernel) if k.kernel else ''})"
                for k in list(matches.values())[:5]
            ]
            more = f" and {len(matches) - 5} more" if len(matches) > 5 else ""
            raise ClientError(
                f"{what} {value} is ambiguous in {where}: it begins {', '.join(shown)}{more}; "
                "give more of its digits"
            )
        out.append(next(iter(matches)))
    return out
