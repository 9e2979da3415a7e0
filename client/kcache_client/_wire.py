"""How a request goes to the server and its answer comes back: :class:`Wire`.

A :class:`~kcache_client._http.Transport` sends every try through one wire, picked once,
when it is made (:func:`open_wire`); the retries, the request count and the mapping of
errors are the transport's, whichever wire carries the bytes:

* :class:`LeanWire`, for everything kcache itself sends: every method, no body or a JSON
  body (encoded as httpx encodes it), any path and query (percent-encoded as httpx
  would), a whole answer or one streamed (a bundle), through
  :class:`~kcache_client._lean_http.LeanClient`, a keep-alive ``http.client`` pool that
  costs a third of httpx's CPU per request (a warm fetch is one such GET). Proxies from
  the environment (``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY``, ``NO_PROXY``) are
  honoured by it as httpx honours them (:mod:`kcache_client._lean_request`).
* :class:`~kcache_client._httpx_wire.HttpxWire`, only when the caller injects its own
  ``httpx.Client``: its hooks, proxies and transport apply (redirects are never
  followed). httpx is imported for that wire alone.

The lean wire ends every try by its ``until`` (connect, send, headers and the whole
body; past it, :class:`~kcache_client._lean_answer.DeadlineExceeded`): every socket read
and its TLS handshake wait no longer than it, a streamed body's reads included. The
injected-httpx wire caps httpx's timeouts by it and checks it between the pieces of the
body (:mod:`kcache_client._httpx_wire` states that bound). Both read a body against the
limit decided from its status and headers before it is read
(:class:`~kcache_client._lean_answer.AnswerRefused` past it, the connection dropped),
refuse oversized headers, and raise the
:class:`~kcache_client._lean_errors.TransportError` of the name httpx would raise for a
connection that fails (the injected-httpx wire translates httpx's own into it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from kcache_client._lean_answer import BodyLimit, LeanResponse, LeanStream
from kcache_client._lean_http import LeanClient
from kcache_client._lean_request import json_body
from kcache_client._waits import Timeouts

if TYPE_CHECKING:
    import httpx

__all__ = ["LeanWire", "Reply", "StreamReply", "Wire", "open_wire"]

#: Methods httpx sends an empty body with (``Content-Length: 0``) when given none.
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class Reply(Protocol):
    """A whole answer, as a wire hands it back: a :class:`~kcache_client._lean_answer.LeanResponse`."""

    @property
    def status_code(self) -> int:
        """The answer's status."""
        ...

    @property
    def headers(self) -> Mapping[str, str]:
        """Its headers, looked up case-insensitively."""
        ...

    @property
    def content(self) -> bytes:
        """Its whole body."""
        ...

    @property
    def text(self) -> str:
        """Its body decoded by the ``Content-Type`` charset (UTF-8 if none)."""
        ...

    @property
    def url(self) -> object:
        """The URL the request went to."""
        ...

    def json(self, **kwargs: Any) -> Any:
        """Its body parsed as JSON (ValueError if it is not)."""
        ...


class StreamReply(Protocol):
    """An answer whose body is read as it arrives: a
    :class:`~kcache_client._lean_answer.LeanStream`, or an injected client's answer."""

    @property
    def status_code(self) -> int:
        """The answer's status."""
        ...

    @property
    def headers(self) -> Mapping[str, str]:
        """Its headers, looked up case-insensitively."""
        ...

    def iter_bytes(self, chunk_size: int | None = ...) -> Iterator[bytes]:
        """Its body, piece by piece, read as this is iterated."""
        ...


class Wire(Protocol):
    """One way to one server: sends a request and reads its answer, nothing more.

    Made with the server's URL, the :class:`~kcache_client._waits.Timeouts` of every
    wait for bytes and the headers of every request. It does not retry (beyond sending a GET again on a fresh
    connection when a kept one turns out closed before its answer began), count or map
    statuses: its caller (:class:`~kcache_client._http.Transport`) does.
    """

    def send(
        self,
        method: str,
        path: str,
        json: Any,
        timeout: float | None,
        until: float,
        limit: BodyLimit,
    ) -> Reply:
        """One try of ``method path`` (``json``, when not None, its body), its answer read whole.

        ``timeout`` (seconds) replaces each wait for bytes of the wire's timeouts;
        ``until`` (a ``time.monotonic()`` instant) ends the whole exchange, connect to
        last byte (DeadlineExceeded); ``limit`` decides from the status and headers how
        long the body may be (AnswerRefused past it, or raised by ``limit`` itself).
        A failure to connect, send or read raises the
        :class:`~kcache_client._lean_errors.TransportError` httpx would; a redirect is
        answered as it is, never followed. The injected-httpx wire bounds the exchange
        less tightly than ``until`` alone (its module says how).
        """
        ...

    def stream(
        self, method: str, path: str, json: Any, until: float
    ) -> AbstractContextManager[StreamReply]:
        """``method path`` whose answer is handed over once its headers are in, its body unread.

        The body is read as the caller iterates ``iter_bytes()``; the whole exchange,
        connect to the last byte read, ends by ``until`` (DeadlineExceeded), however
        slowly the bytes come (on the injected-httpx wire, as its module says), and
        nothing of the body is read ahead of the caller (no limit on its length: the
        caller bounds what it reads). The connection is released when the context
        ends. Raises :class:`~kcache_client._lean_errors.TransportError` for a failure to
        connect, send or read; a redirect is not followed.
        """
        ...

    def close(self) -> None:
        """Close the connections this wire opened (never an injected client: its owner closes it).

        Later requests of the lean wire raise RuntimeError.
        """
        ...


def open_wire(
    url: str, timeout: Timeouts, headers: Mapping[str, str], client: httpx.Client | None
) -> Wire:
    """The wire of a transport to ``url``: ``client``'s when one is injected, else the lean one.

    ``client``, when given, carries every request (its hooks, proxies and transport must
    apply); ``timeout`` is then its own.
    """
    if client is not None:
        from kcache_client._httpx_wire import HttpxWire

        return HttpxWire(url, headers, client)
    return LeanWire(url, timeout, headers)


class LeanWire:
    """Every request through a :class:`~kcache_client._lean_http.LeanClient`; see the module docstring."""

    def __init__(self, url: str, timeout: Timeouts, headers: Mapping[str, str]) -> None:
        self._client = LeanClient(url, timeout)
        # Made once: a warm fetch allocates nothing of its own here.
        self._headers = dict(headers)
        self._json_headers = {**self._headers, "Content-Type": "application/json"}

    def send(
        self,
        method: str,
        path: str,
        json: Any,
        timeout: float | None,
        until: float,
        limit: BodyLimit,
    ) -> LeanResponse:
        """See :meth:`Wire.send`."""
        headers, body = self._body(method, json)
        return self._client.request(
            method, path, headers, body, timeout=timeout, until=until, limit=limit
        )

    def stream(
        self, method: str, path: str, json: Any, until: float
    ) -> AbstractContextManager[LeanStream]:
        """See :meth:`Wire.stream`."""
        headers, body = self._body(method, json)
        return self._client.stream(method, path, headers, body, until=until)

    def close(self) -> None:
        """See :meth:`Wire.close`."""
        self._client.close()

    def _body(self, method: str, json: Any) -> tuple[Mapping[str, str], bytes | None]:
        """The headers and body of ``method`` with ``json``, as httpx sends them.

        No ``json``: no body and no content type (an empty one, ``Content-Length: 0``,
        for a POST, PUT or PATCH); else its compact UTF-8 (NaN refused: ValueError).
        """
        if json is None:
            return self._headers, b"" if method in _BODY_METHODS else None
        return self._json_headers, json_body(json)
