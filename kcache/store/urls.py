"""Which blob backend a store URL names: the one table of ``SCHEME://`` -> backend.

A server's ``store_url`` (``s3://BUCKET/PREFIX``) names the store its blobs live in,
the truth behind each replica's bounded local copies
(:class:`~kcache.store.cached.CachedArtifactStore`). The server's settings check a URL
here when they load (:func:`check_store_url`, so a typo is refused at start-up with
the backend's own sentence), and its backend choice opens it here
(:func:`open_store_url`). A new backend is its module in this package and one line in
:data:`STORE_URL_SCHEMES`; nothing in the server names a backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kcache.store.base import ArtifactStore
from kcache.store.s3 import S3ArtifactStore, parse_s3_url

__all__ = ["STORE_URL_SCHEMES", "StoreOpener", "UrlBackend", "check_store_url", "open_store_url"]


class StoreOpener(Protocol):
    """Opens the store at a URL; every request it makes is bounded as the arguments say."""

    def __call__(
        self,
        url: str,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        retries: int,
        probe_timeout_s: float | None,
    ) -> ArtifactStore:
        """The store at ``url``: requests time out after ``timeout_s`` (connecting: ``connect_timeout_s``),
        retried ``retries`` times within it; :meth:`~ArtifactStore.probe` gives up after ``probe_timeout_s``."""
        ...


@dataclass(frozen=True)
class UrlBackend:
    """One URL scheme's backend: how its URLs are checked, and how its store is opened."""

    #: Raises a ValueError saying what is wrong with a URL of this scheme (nothing opened).
    check: Callable[[str], object]
    open: StoreOpener


#: ``scheme`` -> its backend. Adding a blob backend adds one line here.
STORE_URL_SCHEMES: dict[str, UrlBackend] = {
    "s3": UrlBackend(parse_s3_url, S3ArtifactStore.from_url),
}


def _backend(url: str) -> UrlBackend:
    scheme, sep, _ = url.partition("://")
    backend = STORE_URL_SCHEMES.get(scheme) if sep else None
    if backend is None:
        known = ", ".join(f"{s}://..." for s in sorted(STORE_URL_SCHEMES))
        raise ValueError(f"store URL {url[:80]!r} is not one kcache opens ({known})")
    return backend


def check_store_url(url: str) -> None:
    """Refuse a store URL no backend reads, or one its backend finds wrong (a ValueError saying why)."""
    _backend(url).check(url)


def open_store_url(
    url: str,
    *,
    timeout_s: float,
    connect_timeout_s: float,
    retries: int,
    probe_timeout_s: float | None = None,
) -> ArtifactStore:
    """The store ``url`` names, its requests bounded as :class:`StoreOpener` says."""
    return _backend(url).open(
        url,
        timeout_s=timeout_s,
        connect_timeout_s=connect_timeout_s,
        retries=retries,
        probe_timeout_s=probe_timeout_s,
    )
