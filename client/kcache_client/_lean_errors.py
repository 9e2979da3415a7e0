"""The failures of kcache's HTTP client, named and ranked as httpx names and ranks its own.

A connection that cannot be made, a send or read that fails or stalls, an answer that
breaks HTTP: :class:`~kcache_client._lean_http.LeanClient` raises each as the exception
httpx would raise for it, under the same name and in the same hierarchy
(:class:`HTTPError` > :class:`RequestError` > :class:`TransportError` >
:class:`TimeoutException`, :class:`NetworkError`, :class:`ProtocolError`, ...), without
importing httpx. The names are what a caller reads (``ServerUnavailableError.cause``
says ``ConnectError: ...``, log lines too), and a retry loop catches
:class:`TransportError` whichever wire failed: the wire through an injected
``httpx.Client`` (:mod:`kcache_client._httpx_wire`) translates httpx's own into these
(:func:`from_httpx`), in one place.
"""

from __future__ import annotations

__all__ = [
    "CloseError",
    "ConnectError",
    "ConnectTimeout",
    "DecodingError",
    "HTTPError",
    "LocalProtocolError",
    "NetworkError",
    "PoolTimeout",
    "ProtocolError",
    "ProxyError",
    "ReadError",
    "ReadTimeout",
    "RemoteProtocolError",
    "RequestError",
    "TimeoutException",
    "TransportError",
    "UnsupportedProtocol",
    "WriteError",
    "WriteTimeout",
    "from_httpx",
]


class HTTPError(Exception):
    """Any failure of a request (httpx's ``HTTPError``)."""


class RequestError(HTTPError):
    """A request that got no usable answer (httpx's ``RequestError``)."""


class TransportError(RequestError):
    """The connection failed: worth another try (httpx's ``TransportError``)."""


class TimeoutException(TransportError):
    """A wait for bytes (or the exchange's deadline) ran out."""


class ConnectTimeout(TimeoutException):
    """No connection within the connect timeout."""


class ReadTimeout(TimeoutException):
    """No bytes of the answer within the read timeout."""


class WriteTimeout(TimeoutException):
    """The request could not be sent within the write timeout."""


class PoolTimeout(TimeoutException):
    """No pooled connection came free in time (an injected httpx client's only)."""


class NetworkError(TransportError):
    """The network failed: refused, reset, unreachable."""


class ConnectError(NetworkError):
    """The connection could not be made (refused, DNS, TLS verification, a proxy's refusal)."""


class ReadError(NetworkError):
    """Reading the answer failed (the connection reset)."""


class WriteError(NetworkError):
    """Sending the request failed (the connection reset, a broken pipe)."""


class CloseError(NetworkError):
    """Closing the connection failed."""


class ProtocolError(TransportError):
    """What came or went is not HTTP as it should be."""


class LocalProtocolError(ProtocolError):
    """The request broke HTTP."""


class RemoteProtocolError(ProtocolError):
    """The answer broke HTTP: malformed, cut short, or the server disconnected."""


class ProxyError(TransportError):
    """The proxy refused or failed the request."""


class UnsupportedProtocol(TransportError):
    """The URL's scheme is not one the client speaks."""


class DecodingError(RequestError):
    """The answer's body does not decode by its ``Content-Encoding``."""


#: Every class above by its name: httpx's of the same name maps to it.
_BY_NAME: dict[str, type[HTTPError]] = {
    name: value
    for name, value in list(globals().items())
    if isinstance(value, type) and issubclass(value, HTTPError)
}


def from_httpx(exc: BaseException) -> BaseException:
    """The exception of this module of the same name as httpx's ``exc`` (or as its nearest
    base class that has one here), with its message; ``exc`` itself when it is not httpx's."""
    for cls in type(exc).__mro__:
        mapped = _BY_NAME.get(cls.__name__) if cls.__module__.partition(".")[0] == "httpx" else None
        if mapped is not None:
            return mapped(str(exc))
    return exc
