"""Canonical JSON, the three sha256 hashes (``recipe_key``, ``base_key``, ``digest``) and their one check."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from kcache.errors import InvalidKeyError

__all__ = ["KEY_SCHEMA", "canonical_json", "is_hex_key", "require_hex_key", "sha256_hex"]

#: Bumped whenever the canonical form changes, so old keys never alias new ones.
KEY_SCHEMA = 1

# Matched with fullmatch: "$" would also accept a trailing newline.
_HEX64 = re.compile(r"[0-9a-f]{64}")


def canonical_json(value: Any) -> bytes:
    """Sorted keys, compact separators, ASCII: the same bytes for the same value anywhere."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sha256_hex(data: bytes | str) -> str:
    """sha256 of ``data`` (UTF-8 for text) as 64 lowercase hex digits."""
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def is_hex_key(text: object) -> bool:
    """True when ``text`` is a string of exactly 64 lowercase hex digits (a key or digest)."""
    return isinstance(text, str) and _HEX64.fullmatch(text) is not None


def require_hex_key(value: object, field: str) -> str:
    """``value`` when it is a recipe key or digest, else :class:`InvalidKeyError` naming ``field``.

    The one check of keys and digests everywhere (core, client, server): a key names
    files and rows, so anything but exactly 64 lowercase hex digits is refused before use.
    """
    if isinstance(value, str) and _HEX64.fullmatch(value) is not None:
        return value
    shown = repr(value[:80]) if isinstance(value, str) else f"a {type(value).__name__}"
    raise InvalidKeyError(field, f"must be 64 lowercase hex digits (a sha256), got {shown}")
