"""``S3ArtifactStore``: blobs in an S3-compatible bucket (AWS S3, MinIO, Ceph RGW, GCS's S3 API).

Layout under the URL's prefix: ``blobs/ab/cd/<digest>`` and ``quarantine/<digest>.<ns>``,
the same names as :class:`~kcache.store.local.LocalArtifactStore`'s directories.

The contract is the local store's:

- **Content addressed.** An object's name is the sha256 of its bytes; a digest is
  checked against ``^[0-9a-f]{64}$`` before it names anything.
- **Visible only once complete.** A blob is one single-part ``PUT`` (S3 makes a PUT
  atomic per object: readers see no object or the whole one), never a multipart
  upload whose parts could be left behind; compiled artifacts are far below the
  5 GiB single-PUT limit.
- **Uploaded once.** The PUT carries ``If-None-Match: *``: when the bytes are already
  stored, the bucket answers 412 and nothing is sent twice. Stores that ignore the
  header simply overwrite the object with the same bytes, which is harmless.
- **Verified on read.** A GET whose bytes do not hash to the name is moved to
  ``quarantine/`` (copy, then delete) and reported as
  :class:`~kcache.errors.CorruptArtifactError`, so the next ``put`` republishes it.
- **Vendor errors stop here.** obstore's ``NotFoundError`` becomes
  :class:`~kcache.errors.ArtifactNotFoundError`; a bucket that cannot be reached, or
  refuses the credentials, becomes :class:`~kcache.errors.StoreUnavailableError`
  (the server answers 503 with ``Retry-After``); each raised ``from`` the original.

Client library: `obstore <https://developmentseed.org/obstore/>`_ (Python bindings of
the Rust ``object_store`` crate that Apache Arrow and DataFusion maintain) rather than
boto3. It is one small wheel with no Python dependencies (boto3 brings botocore's
~100 MB of service models and s3transfer), imports in milliseconds instead of
hundreds, does a small GET or PUT with several times less per-call overhead, ships
type hints (boto3 needs third-party stubs for ``mypy --strict``), releases the GIL
during I/O, and exposes conditional writes as ``mode="create"``. It reads the standard
``AWS_*`` variables itself; :meth:`S3ArtifactStore.from_url` also takes them as
arguments.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from kcache.errors import ArtifactNotFoundError, CorruptArtifactError, StoreUnavailableError
from kcache.keys import is_hex_key, require_hex_key

if TYPE_CHECKING:
    from obstore.store import S3Store

__all__ = ["S3ArtifactStore", "parse_s3_url"]

_log = logging.getLogger(__name__)

# Bucket names as S3 allows them (3-63 of lowercase letters, digits, dots, hyphens).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# A prefix is path segments of safe characters; no "..", no empty segment.
_SEGMENT = re.compile(r"[A-Za-z0-9._-]{1,200}")

#: How long one request may take before the bucket counts as down (seconds).
DEFAULT_TIMEOUT_S = 30.0


def parse_s3_url(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` from ``s3://bucket[/prefix...]``; a ValueError says what is wrong.

    The prefix is returned without leading or trailing slashes ("" for none).
    """
    if not url.startswith("s3://"):
        raise ValueError(f"store URL {url[:80]!r} is not s3://BUCKET[/PREFIX]")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ValueError(
            f"store URL {url[:80]!r}: bucket {bucket[:64]!r} is not an S3 bucket name "
            "(3-63 lowercase letters, digits, dots and hyphens)"
        )
    prefix = prefix.strip("/")
    if prefix:
        for segment in prefix.split("/"):
            if not _SEGMENT.fullmatch(segment) or segment in (".", ".."):
                raise ValueError(
                    f"store URL {url[:80]!r}: prefix segment {segment[:40]!r} must be 1-200 of "
                    "letters, digits, '.', '_' and '-' (and not '.' or '..')"
                )
    return bucket, prefix


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


class S3ArtifactStore:
    """An :class:`~kcache.store.base.ArtifactStore` over an S3-compatible bucket.

    Build it with :meth:`from_url`. Thread-safe: the obstore client is shared and
    holds its own connection pool.
    """

    def __init__(self, store: S3Store, url: str) -> None:
        self._store = store
        self.url = url.rstrip("/")

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> S3ArtifactStore:
        """The store at ``s3://bucket/prefix``.

        Arguments left None come from the standard variables: ``AWS_ENDPOINT_URL_S3`` or
        ``AWS_ENDPOINT_URL`` (an S3-compatible server; plain ``http://`` is allowed for
        it), ``AWS_REGION`` or ``AWS_DEFAULT_REGION`` (default ``us-east-1``),
        ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and ``AWS_SESSION_TOKEN``
        (or the instance's or pod's role when they are unset). Requests are path-style
        when an endpoint is given (MinIO, Ceph and moto want that).
        """
        try:
            from obstore.store import S3Store
        except ImportError as exc:
            raise ImportError("an s3:// store needs obstore: pip install 'kcache[s3]'") from exc
        bucket, prefix = parse_s3_url(url)
        endpoint = endpoint_url or _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
        config: dict[str, str | bool] = {
            "region": region or _env("AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1"
        }
        if endpoint:
            config["endpoint"] = endpoint
            config["virtual_hosted_style_request"] = False
        key_id = access_key_id or _env("AWS_ACCESS_KEY_ID")
        secret = secret_access_key or _env("AWS_SECRET_ACCESS_KEY")
        if key_id and secret:
            config["access_key_id"] = key_id
            config["secret_access_key"] = secret
            token = _env("AWS_SESSION_TOKEN")
            if token:
                config["session_token"] = token
        timeout = timedelta(seconds=timeout_s)
        store = S3Store(
            bucket,
            prefix=prefix or None,
            config=config,  # type: ignore[arg-type]  # keys checked against S3Config above
            client_options={
                "allow_http": bool(endpoint and endpoint.startswith("http://")),
                "timeout": timeout,
                "connect_timeout": timedelta(seconds=min(5.0, timeout_s)),
            },
            # A few quick retries, bounded in time: a bucket that is down must surface as
            # StoreUnavailableError (503 + Retry-After) within a request's lifetime, not after
            # obstore's default of 10 retries over 3 minutes.
            retry_config={
                "max_retries": 3,
                "retry_timeout": timeout,
                "backoff": {
                    "init_backoff": timedelta(milliseconds=50),
                    "max_backoff": timedelta(seconds=1),
                    "base": 2,
                },
            },
        )
        return cls(store, f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}")

    # ------------------------------------------------------------------ names
    @staticmethod
    def key(digest: str) -> str:
        """The object name under the prefix: ``blobs/ab/cd/<digest>`` (the digest is validated)."""
        require_hex_key(digest, "digest")
        return f"blobs/{digest[:2]}/{digest[2:4]}/{digest}"

    def path(self, digest: str) -> Path:
        """Refused: a bucket has no local path (a :class:`CachedArtifactStore` in front has one)."""
        raise TypeError(
            f"blob {digest[:64]} lives in {self.url}, which has no local path; put a "
            "kcache.store.CachedArtifactStore in front of the bucket to serve files"
        )

    # ------------------------------------------------------------------ the contract
    def put(self, data: bytes) -> str:
        """Publish ``data`` under its sha256 with one conditional PUT; idempotent."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        digest = hashlib.sha256(data).hexdigest()
        try:
            obstore.put(self._store, self.key(digest), data, mode="create", use_multipart=False)
        except (AlreadyExistsError, PreconditionError):
            pass  # the same name holds the same bytes (reads verify anyway)
        except Exception as exc:
            self._raise(exc, digest, "store")
        return digest

    def get(self, digest: str) -> bytes:
        """Read and verify; a mismatching object is moved to ``quarantine/`` and reported."""
        import obstore

        key = self.key(digest)
        try:
            data = bytes(obstore.get(self._store, key).bytes())
        except Exception as exc:
            self._raise(exc, digest, "read")
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise CorruptArtifactError(digest, actual, self._quarantine(key, digest))
        return data

    def has(self, digest: str) -> bool:
        """True when an object named ``digest`` is present (one HEAD; not verified)."""
        import obstore

        try:
            obstore.head(self._store, self.key(digest))
        except Exception as exc:
            try:
                self._raise(exc, digest, "look up")
            except ArtifactNotFoundError:
                return False
        return True

    def size(self, digest: str) -> int:
        """The object's size in bytes; ArtifactNotFoundError when absent."""
        import obstore

        try:
            return int(obstore.head(self._store, self.key(digest))["size"])
        except Exception as exc:
            self._raise(exc, digest, "look up")

    def delete(self, digest: str) -> bool:
        """Remove the object; True if it was there (S3 DELETE itself does not say)."""
        import obstore

        if not self.has(digest):
            return False
        try:
            obstore.delete(self._store, self.key(digest))
        except Exception as exc:
            try:
                self._raise(exc, digest, "delete")
            except ArtifactNotFoundError:
                return False
        return True

    def digests(self) -> Iterator[str]:
        """Every object under ``blobs/`` whose name is a digest in its fan-out place."""
        import obstore

        try:
            for chunk in obstore.list(self._store, "blobs/", chunk_size=1000):
                for meta in chunk:
                    parts = meta["path"].split("/")
                    name = parts[-1]
                    if (
                        len(parts) >= 4
                        and is_hex_key(name)
                        and parts[-3:-1] == [name[:2], name[2:4]]
                    ):
                        yield name
        except Exception as exc:
            self._raise(exc, None, "list")

    # ------------------------------------------------------------------ helpers
    def _quarantine(self, key: str, digest: str) -> str | None:
        import obstore

        dest = f"quarantine/{digest}.{time.time_ns()}"
        try:
            obstore.copy(self._store, key, dest)
            obstore.delete(self._store, key)
        except Exception as exc:
            try:
                self._raise(exc, digest, "quarantine")
            except ArtifactNotFoundError:
                return None  # another reader quarantined it first
        return f"{self.url}/{dest}"

    def _raise(self, exc: Exception, digest: str | None, action: str) -> NoReturn:
        """Translate an obstore error at the boundary (``from`` keeps the original)."""
        from obstore.exceptions import BaseError, NotFoundError

        if isinstance(exc, (NotFoundError, FileNotFoundError)):  # obstore raises either
            raise ArtifactNotFoundError(f"no blob {digest} in {self.url}") from exc
        if isinstance(exc, (BaseError, OSError, TimeoutError)):
            what = f"blob {digest}" if digest else "its blobs"
            # The vendor's text (endpoint, request ids) goes to the log, not to HTTP callers.
            _log.warning("%s: could not %s %s: %s", self.url, action, what, exc)
            raise StoreUnavailableError(self.url, f"could not {action} {what}") from exc
        raise exc
