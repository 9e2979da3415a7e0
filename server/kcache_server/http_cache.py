"""HTTP caching of content-addressed bytes: ``ETag`` and ``Cache-Control``, ``If-None-Match``.

A blob's name is its sha256, so its bytes never change: the digest is a strong
``ETag`` and the response may be cached forever. A fetch by recipe key answers a
*binding* (key -> digest), which a withdrawal ends (docs/design.md, "What a binding
rests on"): a cache may keep that answer but must ask again before each use
(``no-cache``), and the server answers 304 while the key still names the digest. Used
by the blob and recipe routes and by the fast path below the framework alike, so all
three answer with the same headers.
"""

from __future__ import annotations

from kcache.artifact import ArtifactMeta
from kcache.artifact_header import HEADER as META_HEADER
from kcache.artifact_header import encode_meta

__all__ = [
    "IMMUTABLE",
    "REVALIDATE",
    "artifact_headers",
    "blob_headers",
    "etag_matches",
]

#: ``Cache-Control`` of a response whose bytes are named by their hash.
IMMUTABLE = "public, max-age=31536000, immutable"
#: ``Cache-Control`` of a key's answer: kept, but asked again before each use.
REVALIDATE = "no-cache"


def blob_headers(digest: str, size: int) -> dict[str, str]:
    """Caching headers for a blob: a name that is its hash never changes."""
    return {
        "ETag": f'"{digest}"',
        "Cache-Control": IMMUTABLE,
        "X-Kcache-Digest": digest,
        "X-Kcache-Size": str(size),
    }


def artifact_headers(meta: ArtifactMeta) -> dict[str, str]:
    """A fetch by key's headers: the blob's (revalidated, not immutable), plus its metadata in
    ``X-KCache-Meta`` (design §5).

    The metadata header is left out when it would be too long (see
    :mod:`kcache.artifact_header`); clients then read ``GET /v1/recipes/{key}``.
    """
    headers = {**blob_headers(meta.digest, meta.size), "Cache-Control": REVALIDATE}
    encoded = encode_meta(meta)
    if encoded is not None:
        headers[META_HEADER] = encoded
    return headers


def etag_matches(if_none_match: str | None, digest: str) -> bool:
    """True when an ``If-None-Match`` header value names this digest (or ``*``)."""
    if not if_none_match:
        return False
    tags = {t.strip().removeprefix("W/").strip('"') for t in if_none_match.split(",")}
    return digest in tags or "*" in tags
