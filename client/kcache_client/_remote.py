"""The server as a client speaks to it: a fetch in one round trip, resolves, batches, blobs.

Every answer is checked before anything is handed back: the metadata is well formed
(:func:`kcache.artifact_header.parse_meta`), fits the recipe that was asked for (its
kind, target and toolchain), and the bytes hash to its digest and have its size. A
fetch by key is one request: ``GET /v1/recipes/{key}/artifact`` answers with the bytes
and their metadata (``X-KCache-Meta``, design §5). Bytes damaged on the way are
fetched again by digest (bounded); metadata that contradicts its own response is
refused with :class:`~kcache_client.errors.MetadataError`.

No body is read further than it may go: an artifact's by the size its metadata names
(the header is checked before the body is read, and a size over this client's
``max_artifact_bytes`` is refused unread), a blob's by the size its resolve named,
JSON answers by the transport's fixed cap; one byte more is
:class:`~kcache_client.errors.ResponseRefusedError` at once, with no refetch (bytes
that only differ are refetched: damage on the way; bytes beyond the promise are not).

And no artifact is handed back without the server's signature of the recipe key ->
its metadata, by a key this client trusts (given, or pinned on first contact:
:mod:`~kcache_client._trust`), checked once the bytes match their digest; else
:class:`~kcache_client.errors.UntrustedArtifactError`. The signature is handed back
with the artifact, for the node tier to store beside it.

A fetch's answer also says how far the server's withdrawals behind it go
(``X-KCache-Withdrawals-Through``); a checked answer hands that id to
:attr:`Remote.withdrawals_through` (the withdrawal watch's: a node that knows the feed
that far needs no read of it, :mod:`kcache_client._withdrawals`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from kcache.artifact import ArtifactMeta
from kcache.artifact_header import HEADER as META_HEADER
from kcache.artifact_header import (
    WITHDRAWALS_HEADER,
    decode_meta,
    parse_meta,
    parse_withdrawals_through,
)
from kcache.outcomes import ResolveStatus
from kcache.recipe import Recipe
from kcache.signing import HEADER as SIGNATURE_HEADER
from kcache.signing import BundleDigest, Signature, SignatureError
from kcache_client._http import Limit, Transport, batch_item_error
from kcache_client._settings import RetryPolicy, max_artifact_bytes_from_env
from kcache_client._stats import CacheStats
from kcache_client._trust import Trust, default_known_servers
from kcache_client._withdrawal_feed import PAGE, WithdrawalPage, parse_page
from kcache_client.errors import (
    ClientError,
    DigestMismatchError,
    MetadataError,
    RemoteNotFoundError,
    ResponseRefusedError,
    UntrustedArtifactError,
)

__all__ = ["Fetched", "Remote", "ResolveAnswer"]

#: Tries of a download whose bytes do not match their digest.
_DIGEST_TRIES = 3
_RESOLVED: frozenset[str] = frozenset({"hit", "compiled", "waited"})

#: What a resolve answered: its status, the (checked) artifact metadata and its signature.
ResolveAnswer = tuple[ResolveStatus, ArtifactMeta, Signature]
#: What a fetch by key brought: the metadata, the verified bytes and their signature.
Fetched = tuple[ArtifactMeta, bytes, Signature]


class Remote:
    """One server, through a :class:`Transport`; see the module docstring.

    ``max_artifact_bytes`` is the largest artifact accepted (None: the environment's
    ``KCACHE_CLIENT_MAX_ARTIFACT_BYTES``, else 256 MiB); ``trust`` the keys signatures
    are checked against (None: the environment's ``KCACHE_TRUSTED_KEYS``, else pins in
    ``KCACHE_KNOWN_SERVERS``).
    """

    def __init__(
        self,
        transport: Transport,
        stats: CacheStats,
        *,
        max_artifact_bytes: int | None = None,
        trust: Trust | None = None,
    ) -> None:
        self.transport = transport
        self.url = transport.url
        self._stats = stats
        self.trust = trust or Trust.from_settings(
            os.environ.get("KCACHE_TRUSTED_KEYS"), default_known_servers(), self.url
        )
        self.max_artifact_bytes = (
            max_artifact_bytes if max_artifact_bytes is not None else max_artifact_bytes_from_env()
        )
        #: Told the withdrawal id a checked fetch answer was right as of (module docstring).
        self.withdrawals_through: Callable[[int], None] | None = None

    def toolchains(self) -> dict[str, Any]:
        """``GET /v1/toolchains``: the server's toolchain ids, default and targets."""
        body = self.transport.request_json("GET", "/v1/toolchains")
        if not isinstance(body, dict) or not isinstance(body.get("default"), str):
            raise ClientError(f"{self.url}/v1/toolchains did not name a default toolchain")
        return body

    def keys(self) -> Any:
        """``GET /v1/keys``: the keys the server signs with (checked by :class:`Trust`)."""
        return self.transport.request_json("GET", "/v1/keys")

    def withdrawals(
        self, *, after: int, limit: int = PAGE, retry: RetryPolicy | None = None
    ) -> WithdrawalPage:
        """``GET /v1/withdrawals``: the bindings withdrawn after id ``after``, at most ``limit``.

        The answer is checked (:func:`~kcache_client._withdrawal_feed.parse_page`: ids ints in
        order above ``after``, keys and digests hex, ``last_id`` their last) or refused
        with ResponseRefusedError; a server without the route raises RemoteNotFoundError.
        ``retry``: this call's policy instead of the transport's.
        """
        path = f"/v1/withdrawals?after={int(after)}&limit={int(limit)}"
        body = self.transport.request_json("GET", path, retry=retry)
        try:
            return parse_page(body, after, limit)
        except ValueError as exc:
            raise ResponseRefusedError(self.url + path, str(exc)) from None

    def fetch(self, concrete: Recipe, key: str) -> Fetched | None:
        """The artifact of ``key`` and its verified bytes in one round trip; None when unknown.

        One ``GET /v1/recipes/{key}/artifact``. Only an artifact whose metadata is too
        long for a header costs a second request (the metadata route), and only bytes
        damaged on the way are fetched again (by digest). The metadata header is
        checked (well formed, of this response's digest, fitting the recipe, within
        ``max_artifact_bytes``) before the body is read, and the body is read no
        further than the size it names; the signature once the bytes are verified.
        """
        path = f"/v1/recipes/{key}/artifact"
        where = self.url + path
        headed: list[ArtifactMeta] = []
        signed: list[str | None] = []
        through: list[int | None] = [None]

        def expect(headers: Mapping[str, str]) -> Limit:
            headed.clear()
            signed[:] = [headers.get(SIGNATURE_HEADER)]
            through[0] = parse_withdrawals_through(headers.get(WITHDRAWALS_HEADER))
            encoded = headers.get(META_HEADER)
            if encoded is None:  # too long for a header (design §5): the metadata route says it
                return self._artifact_limit()
            try:
                meta = decode_meta(encoded)
            except ValueError as exc:
                raise MetadataError(where, str(exc)) from None
            claimed = headers.get("X-Kcache-Digest")
            if claimed != meta.digest:
                raise MetadataError(
                    where, f"{META_HEADER} names digest {meta.digest}, the response {claimed}"
                )
            _check_fits(meta, concrete, where)
            self._check_size(meta, where)
            headed.append(meta)
            return Limit(meta.size, f"its {META_HEADER} names")

        try:
            response = self.transport.request("GET", path, expect=expect)
        except RemoteNotFoundError:
            return None
        if headed:
            meta = headed[0]
            signature = _header_signature(signed[0] if signed else None, where)
        else:
            try:
                meta, signature = self._metadata(key)
            except RemoteNotFoundError:
                return None  # forgotten in between (evicted, collected)
            _check_fits(meta, concrete, where)
            self._check_size(meta, where)
        data = response.content
        actual = hashlib.sha256(data).hexdigest()
        if actual != meta.digest:
            # Damaged on the way (or, without the header, the alias moved between the two
            # requests): the blob by digest is immutable, so fetch that, verified.
            self._stats.add("digest_mismatches")
            try:
                data = self.blob(meta.digest, meta.size)
            except RemoteNotFoundError:  # no such blob: the metadata named bytes nobody has
                raise DigestMismatchError(where, meta.digest, actual) from None
        if len(data) != meta.size:
            raise MetadataError(where, f"its size is {meta.size}, its bytes are {len(data)}")
        checked = self._check_signature(key, meta, signature, where)
        if through[0] is not None and self.withdrawals_through is not None:
            self.withdrawals_through(through[0])
        return meta, data, checked

    def resolve(
        self, concrete: Recipe, key: str, *, compile: bool, context: Mapping[str, Any]
    ) -> ResolveAnswer:
        """``POST /v1/resolve``: hit, or compiled (or joined) on the server; the bytes are not sent."""
        body = {"recipe": concrete.to_dict(), "compile": compile, "context": dict(context)}
        answer = self.transport.request_json("POST", "/v1/resolve", json=body, compiles=True)
        return self._answer_of(answer, concrete, key, f"{self.url}/v1/resolve")

    def resolve_batch(
        self,
        recipes: Sequence[tuple[str, Recipe]],
        *,
        compile: bool,
        context: Mapping[str, Any],
    ) -> list[ResolveAnswer | ClientError]:
        """``POST /v1/resolve/batch`` of ``(key, concrete recipe)`` pairs: a result per recipe.

        A recipe that failed on the server is its typed error (see
        :func:`~kcache_client._http.batch_item_error`); a failure of the whole request
        raises.
        """
        where = f"{self.url}/v1/resolve/batch"
        body = {
            "recipes": [recipe.to_dict() for _, recipe in recipes],
            "compile": compile,
            "context": dict(context),
        }
        answer = self.transport.request_json("POST", "/v1/resolve/batch", json=body, compiles=True)
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list) or len(results) != len(recipes):
            raise ClientError(f"{where} returned a malformed results list")
        out: list[ResolveAnswer | ClientError] = []
        for (key, recipe), result in zip(recipes, results, strict=True):
            if isinstance(result, dict) and result.get("status") == "error":
                out.append(batch_item_error(where, result, key))
            else:
                out.append(self._answer_of(result, recipe, key, where))
        return out

    def blob(self, digest: str, size: int | None = None) -> bytes:
        """``GET /v1/blobs/{digest}``, fetched again until the bytes hash to ``digest`` (bounded).

        ``size``, when known (the metadata's), bounds each body; else ``max_artifact_bytes``.
        """
        path = f"/v1/blobs/{digest}"
        limit = Limit(size, "its metadata names") if size is not None else self._artifact_limit()
        actual = ""
        for _ in range(_DIGEST_TRIES):
            data = self.transport.request("GET", path, expect=limit).content
            actual = hashlib.sha256(data).hexdigest()
            if actual == digest:
                return data
            self._stats.add("digest_mismatches")
        raise DigestMismatchError(self.url + path, digest, actual)

    def download(self, meta: ArtifactMeta) -> bytes:
        """The verified bytes of a resolved artifact (by digest), which must have its size."""
        where = f"{self.url}/v1/blobs/{meta.digest}"
        self._check_size(meta, where)
        data = self.blob(meta.digest, meta.size)
        if len(data) != meta.size:
            raise MetadataError(where, f"its size is {meta.size}, its bytes are {len(data)}")
        return data

    @contextmanager
    def bundle(
        self,
        keys: Sequence[str],
        *,
        context: Mapping[str, Any],
        foreign: Sequence[Mapping[str, str]] = (),
    ) -> Iterator[Iterator[bytes]]:
        """``POST /v1/bundle`` of ``keys`` (and the ``foreign`` groups by name, whose section
        comes first): the answer's bytes as they arrive (one request).

        Not retried: a prefetch cut short keeps what it verified and published, and its
        next call asks for the rest. Error statuses raise the transport's typed errors
        (the JSON body read within the transport's cap); a connection that fails raises
        ServerUnavailableError. The caller parses and checks the stream
        (:class:`kcache.bundle_format.BundleReader`, :meth:`check_size`, and
        :meth:`check_bundle` or :meth:`check_entry`). Once the caller's block ends without an
        error, :attr:`withdrawals_through` is told how far the answer's withdrawals went, as
        for a fetch.
        """
        body: dict[str, Any] = {"recipe_keys": list(keys)}
        if foreign:
            body["foreign"] = [dict(group) for group in foreign]
        body["context"] = dict(context)
        through: list[int | None] = [None]

        def seen(headers: Mapping[str, str]) -> None:
            through[0] = parse_withdrawals_through(headers.get(WITHDRAWALS_HEADER))

        with self.transport.stream("POST", "/v1/bundle", json=body, headers_seen=seen) as chunks:
            yield chunks
        if through[0] is not None and self.withdrawals_through is not None:
            self.withdrawals_through(through[0])

    def check_entry(
        self, key: str, meta: ArtifactMeta, signature: Signature, where: str
    ) -> Signature:
        """A bundle entry's signature, by a key trusted for this server (UntrustedArtifactError),
        and its size within ``max_artifact_bytes`` (ResponseRefusedError)."""
        self._check_size(meta, where)
        return self._check_signature(key, meta, signature, where)

    def check_size(self, meta: ArtifactMeta, where: str) -> None:
        """Refuse an artifact larger than ``max_artifact_bytes`` (ResponseRefusedError)."""
        self._check_size(meta, where)

    def check_bundle(self, entries: BundleDigest, signature: Signature, where: str) -> None:
        """A bundle answer's signature over all of its ``entries``, by a key trusted for this
        server (UntrustedArtifactError)."""
        self.trust.check_bundle(self.url, entries, signature, self.keys, where)

    # ------------------------------------------------------------------ internals
    def _metadata(self, key: str) -> tuple[ArtifactMeta, Signature | None]:
        path = f"/v1/recipes/{key}"
        where = self.url + path
        reply = self.transport.request("GET", path)
        try:
            body = reply.json()
        except ValueError:
            raise ResponseRefusedError(where, "HTTP 200 with a body that is not JSON") from None
        signature = _header_signature(reply.headers.get(SIGNATURE_HEADER), where)
        return _parse(body, where), signature

    def _check_signature(
        self, key: str, meta: ArtifactMeta, signature: Signature | None, where: str
    ) -> Signature:
        return self.trust.check_answer(self.url, key, meta, signature, self.keys, where)

    def _artifact_limit(self) -> Limit:
        return Limit(self.max_artifact_bytes, "this client accepts (max_artifact_bytes)")

    def _check_size(self, meta: ArtifactMeta, where: str) -> None:
        """Refuse an artifact larger than this client accepts, before a byte of it is read."""
        if meta.size > self.max_artifact_bytes:
            raise ResponseRefusedError(
                where,
                f"its metadata names {meta.size} bytes, more than the {self.max_artifact_bytes} "
                "this client accepts (max_artifact_bytes, KCACHE_CLIENT_MAX_ARTIFACT_BYTES)",
            )

    def _answer_of(self, answer: Any, concrete: Recipe, key: str, where: str) -> ResolveAnswer:
        """A resolve body (alone or in a batch), checked against the recipe asked for."""
        if not isinstance(answer, dict) or answer.get("status") not in _RESOLVED:
            raise MetadataError(
                where, "a resolve answer without a status of hit, compiled or waited"
            )
        if answer.get("recipe_key") not in (None, key):
            raise ClientError(
                f"the server keyed the recipe as {answer.get('recipe_key')}, this client as {key}: "
                "client and server run different kcache versions"
            )
        meta = _parse(answer.get("artifact"), where)
        _check_fits(meta, concrete, where)
        signature = None
        if answer.get("signature") is not None:
            try:
                signature = Signature.from_dict(answer["signature"])
            except SignatureError as exc:
                raise UntrustedArtifactError(where, str(exc)) from None
        status: ResolveStatus = answer["status"]
        return status, meta, self._check_signature(key, meta, signature, where)


def _header_signature(value: str | None, where: str) -> Signature | None:
    if value is None:
        return None
    try:
        return Signature.from_header(value)
    except SignatureError as exc:
        raise UntrustedArtifactError(where, str(exc)) from None


def _parse(data: Any, where: str) -> ArtifactMeta:
    try:
        return parse_meta(data, "artifact")
    except ValueError as exc:
        raise MetadataError(where, str(exc)) from None


def _check_fits(meta: ArtifactMeta, concrete: Recipe, where: str) -> None:
    """Refuse metadata of an artifact that is not what ``concrete`` asks for."""
    for name, wanted in (
        ("kind", concrete.produces),
        ("target", concrete.target),
        ("toolchain", concrete.toolchain),
    ):
        got = getattr(meta, name)
        if got != wanted:
            raise MetadataError(where, f"its {name} is {got!r}, the recipe asks for {wanted!r}")
