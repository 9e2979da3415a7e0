"""Canonical JSON and the three sha256 hashes: ``recipe_key``, ``base_key`` and ``digest``."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

__all__ = ["KEY_SCHEMA", "canonical_json", "is_hex_key", "sha256_hex"]

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


def is_hex_key(text: str) -> bool:
    """True when ``text`` is exactly 64 lowercase hex digits (a key or digest)."""
    return isinstance(text, str) and _HEX64.fullmatch(text) is not None
