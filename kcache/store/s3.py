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
  header simply overwrite the object with the same bytes, which is harmless. One
  exception keeps garbage collection safe: an object already there that is older than
  :data:`REFRESH_AFTER_S` is written again, which renews its ``Last-Modified`` (a
  local store touches the file's mtime), because it may be an old orphan that a row is
  about to name and the collector's grace period is measured from that time.
- **Collected like the local store's blobs.** :meth:`S3ArtifactStore.collect_many`
  deletes an unnamed object only when it is older than the grace period, asking the
  index again just before (once per batch; the object store offers no rename to set a
  blob aside first, so a reuse in the milliseconds between that last look and the
  delete is not caught; such a row's blob is then missing, which a resolve answers as
  a miss and compiles afresh).
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
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from kcache.errors import (
    ArtifactNotFoundError,
    BucketMissingError,
    CorruptArtifactError,
    StoreUnavailableError,
)
from kcache.keys import is_hex_key, require_hex_key
from kcache.store.base import COLLECT_BATCH, ArtifactStore, BlobInfo, Collected, Leftovers, NamedNow

if TYPE_CHECKING:
    from obstore.store import S3Store

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_RETRIES",
    "DEFAULT_TIMEOUT_S",
    "PROBE_KEY",
    "REFRESH_AFTER_S",
    "S3ArtifactStore",
    "parse_s3_url",
]

_log = logging.getLogger(__name__)

# Bucket names as S3 allows them (3-63 of lowercase letters, digits, dots, hyphens).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# A prefix is path segments of safe characters; no "..", no empty segment.
_SEGMENT = re.compile(r"[A-Za-z0-9._-]{1,200}")

#: How long one request may take, body included, before the bucket counts as down
#: (seconds). Retries happen only within this time, so a call fails within about twice
#: it: a server's fetch of a blob its replica has no copy of answers 503 (with
#: ``Retry-After``) in seconds, not after a load balancer or a client gave up.
DEFAULT_TIMEOUT_S = 5.0
#: How long opening a connection may take (seconds); at most the request timeout.
DEFAULT_CONNECT_TIMEOUT_S = 1.0
#: Retries of a request that failed in a way worth retrying (a refused or reset
#: connection, a 5xx), each after a short backoff, within the request timeout.
DEFAULT_RETRIES = 2
#: An object already stored and older than this (seconds) is written again by ``put``
#: (see the module docstring): far below any grace period ``kcache db gc`` allows.
REFRESH_AFTER_S = 60.0
#: The object :meth:`S3ArtifactStore.probe` asks for (it need not exist: "not found"
#: is an answer). Outside ``blobs/``, so no listing ever takes it for a blob.
PROBE_KEY = "kcache-readiness-probe"
#: The S3 error code of a bucket that does not exist, in the body of every answer but a HEAD's.
_NO_SUCH_BUCKET = "<Code>NoSuchBucket</Code>"


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

    #: A bucket is the truth for its blobs: it keeps copies of no other store.
    remote: ArtifactStore | None = None

    def __init__(self, store: S3Store, url: str, *, probe_store: S3Store | None = None) -> None:
        """``store`` serves the blobs; ``probe_store`` (default ``store``) answers :meth:`probe`."""
        self._store = store
        self._probe_store = probe_store or store
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
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        probe_timeout_s: float | None = None,
    ) -> S3ArtifactStore:
        """The store at ``s3://bucket/prefix``.

        Arguments left None come from the standard variables: ``AWS_ENDPOINT_URL_S3`` or
        ``AWS_ENDPOINT_URL`` (an S3-compatible server; plain ``http://`` is allowed for
        it), ``AWS_REGION`` or ``AWS_DEFAULT_REGION`` (default ``us-east-1``),
        ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and ``AWS_SESSION_TOKEN``
        (or the instance's or pod's role when they are unset). Requests are path-style
        when an endpoint is given (MinIO, Ceph and moto want that).

        Every request is bounded: ``timeout_s`` for the whole request (its body
        included), ``connect_timeout_s`` to connect, ``retries`` quick retries within
        ``timeout_s``. :meth:`probe` uses a client of its own that never retries and
        gives up after ``probe_timeout_s`` (default: ``timeout_s``).
        """
        try:
            from obstore.store import S3Store
        except ImportError as exc:
            raise ImportError(
                "an s3:// store needs obstore: pip install 'kcache-core[s3]'"
            ) from exc
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
        if not (timeout_s > 0 and connect_timeout_s > 0 and retries >= 0):
            raise ValueError(
                f"S3 timeouts must be positive and retries not negative (timeout_s={timeout_s}, "
                f"connect_timeout_s={connect_timeout_s}, retries={retries})"
            )
        allow_http = bool(endpoint and endpoint.startswith("http://"))

        def client(timeout_s: float, retries: int) -> S3Store:
            timeout = timedelta(seconds=timeout_s)
            return S3Store(
                bucket,
                prefix=prefix or None,
                config=config,  # type: ignore[arg-type]  # keys checked against S3Config above
                client_options={
                    "allow_http": allow_http,
                    "timeout": timeout,
                    "connect_timeout": timedelta(seconds=min(connect_timeout_s, timeout_s)),
                },
                # A few quick retries, bounded in time: a bucket that is down must surface as
                # StoreUnavailableError (503 + Retry-After) within a request's lifetime, not
                # after obstore's default of 10 retries over 3 minutes.
                retry_config={
                    "max_retries": retries,
                    "retry_timeout": timeout,
                    "backoff": {
                        "init_backoff": timedelta(milliseconds=50),
                        "max_backoff": timedelta(seconds=1),
                        "base": 2,
                    },
                },
            )

        return cls(
            client(timeout_s, retries),
            f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}",
            probe_store=client(probe_timeout_s or timeout_s, 0),
        )

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

    def local_file(self, digest: str) -> str | None:
        """None: a bucket keeps no file on this machine (the digest is still validated)."""
        require_hex_key(digest, "digest")
        return None

    # ------------------------------------------------------------------ the contract
    def put(self, data: bytes) -> str:
        """Publish ``data`` under its sha256 with one conditional PUT; idempotent."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        digest = hashlib.sha256(data).hexdigest()
        key = self.key(digest)
        try:
            obstore.put(self._store, key, data, mode="create", use_multipart=False)
        except (AlreadyExistsError, PreconditionError):
            # The same name holds the same bytes (reads verify anyway); renew an old one's
            # Last-Modified, as a local store touches the file (the collector's grace).
            info = self.blob_info(digest)
            if info is None or info[1] < time.time() - REFRESH_AFTER_S:
                try:
                    obstore.put(self._store, key, data, use_multipart=False)
                except Exception as exc:
                    self._raise(exc, digest, "store")
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

    def probe(self) -> None:
        """Ask the bucket one cheap question (a listing of at most one name under
        :data:`PROBE_KEY`); raise if it cannot answer.

        An empty listing is an answer: the bucket exists and takes the credentials. A
        listing, not a HEAD of one object: a HEAD's 404 carries no body, so a bucket
        that does not exist (a typo in ``KCACHE_STORE_URL``) would read as reachable,
        while a listing's 404 says ``NoSuchBucket``. (The collector lists the bucket
        anyway, so the server's credentials need that right.) Anything else (no bucket,
        no connection, a timeout, refused credentials, a 5xx) raises
        :class:`~kcache.errors.StoreUnavailableError` saying which. Never retried, and
        bounded by the probe's own timeout (:meth:`from_url`), so a readiness check can
        afford it.
        """
        import obstore

        try:
            next(iter(obstore.list(self._probe_store, prefix=PROBE_KEY, chunk_size=1)), None)
        except Exception as exc:
            self._raise(exc, None, "reach")

    def blob_info(self, digest: str) -> BlobInfo | None:
        """``(size, Last-Modified as unix seconds)`` of the object, None when it is absent."""
        import obstore

        try:
            meta = obstore.head(self._store, self.key(digest))
        except Exception as exc:
            try:
                self._raise(exc, digest, "look up")
            except ArtifactNotFoundError:
                return None
        return BlobInfo(int(meta["size"]), meta["last_modified"].timestamp())

    def collect_many(
        self,
        digests: Sequence[str],
        older_than: float,
        named: NamedNow,
        *,
        dry_run: bool = False,
    ) -> Collected:
        """Delete the objects no row names that were last written before ``older_than``.

        ``named`` is asked first, once per batch (a row committed since the caller's
        snapshot keeps its blob), then each object's age is read once more (a writer
        that reused it since renewed it), then it is deleted. See the module docstring
        for the one window this leaves.
        """
        import obstore

        done = Collected()
        for start in range(0, len(digests), COLLECT_BATCH):
            batch = [require_hex_key(d, "digest") for d in digests[start : start + COLLECT_BATCH]]
            still = named(batch)
            for digest in batch:
                if digest in still:
                    continue
                info = self.blob_info(digest)
                if info is None:
                    continue
                if info.written_at >= older_than:
                    done.young[digest] = info.written_at
                    continue
                if not dry_run:
                    try:
                        obstore.delete(self._store, self.key(digest))
                    except Exception as exc:
                        try:
                            self._raise(exc, digest, "delete")
                        except ArtifactNotFoundError:
                            continue
                done.freed[digest] = info.size
        return done

    def sweep_leftovers(self, older_than: float, *, dry_run: bool = False) -> Leftovers:
        """Nothing to sweep: a blob is one PUT, which leaves no staging object behind."""
        return Leftovers()

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

        if _NO_SUCH_BUCKET in str(exc):  # every answer of a missing bucket but a HEAD's
            _log.warning("%s: could not %s: %s", self.url, action, exc)
            raise BucketMissingError(
                self.url,
                f"the bucket {parse_s3_url(self.url)[0]!r} does not exist: create it, or "
                "correct the bucket in KCACHE_STORE_URL",
            ) from exc
        if isinstance(exc, (NotFoundError, FileNotFoundError)):  # obstore raises either
            raise ArtifactNotFoundError(f"no blob {digest} in {self.url}") from exc
        if isinstance(exc, (BaseError, OSError, TimeoutError)):
            what = f"blob {digest}" if digest else "its blobs"
            # The vendor's text (endpoint, request ids) goes to the log, not to HTTP callers.
            _log.warning("%s: could not %s %s: %s", self.url, action, what, exc)
            raise StoreUnavailableError(self.url, f"could not {action} {what}") from exc
        raise exc
