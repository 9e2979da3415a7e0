"""HTTP caching of content-addressed bytes: ``ETag`` and immutable headers, ``If-None-Match``.

A blob's name is its sha256, so its bytes never change: the digest is a strong
``ETag`` and the response may be cached forever. Used by the blob and recipe
routes and by the fast path below the framework alike, so all three answer with
the same headers.
"""

from __future__ import annotations

__all__ = ["IMMUTABLE", "blob_headers", "etag_matches"]

#: ``Cache-Control`` of a response whose bytes are named by their hash.
IMMUTABLE = "public, max-age=31536000, immutable"


def blob_headers(digest: str, size: int) -> dict[str, str]:
    """Caching headers for a blob: a name that is its hash never changes."""
    return {
        "ETag": f'"{digest}"',
        "Cache-Control": IMMUTABLE,
        "X-Kcache-Digest": digest,
        "X-Kcache-Size": str(size),
    }


def etag_matches(if_none_match: str | None, digest: str) -> bool:
    """True when an ``If-None-Match`` header value names this digest (or ``*``)."""
    if not if_none_match:
        return False
    tags = {t.strip().removeprefix("W/").strip('"') for t in if_none_match.split(",")}
    return digest in tags or "*" in tags
