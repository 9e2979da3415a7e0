"""What the lean client sends, and by which way: the request line as httpx would write it.

:class:`~kcache_client._lean_http.LeanClient` speaks every request kcache sends, so it
writes each the way httpx would have written it:

* the request target (:func:`request_target`): the path and query percent-encoded as
  httpx encodes them (``urllib.parse.quote`` with httpx's safe sets: what is already a
  ``%XX`` escape stays one), ``.`` and ``..`` segments removed, the fragment not sent;
* a JSON body (:func:`json_body`): compact UTF-8, NaN refused;
* credentials in the server's URL (``https://user:pass@host``): sent as Basic auth, as
  httpx sends them (:func:`basic_auth`);
* the way to the server (:class:`Route`), judged once, as httpx reads its proxies once:
  straight to the host, unless ``urllib.request.getproxies()`` (``HTTP_PROXY``,
  ``HTTPS_PROXY``, ``ALL_PROXY``) names a proxy for the URL's scheme that
  ``urllib.request.proxy_bypass`` (``NO_PROXY``) does not lift. Through a proxy, an
  ``http://`` server is asked in absolute form (``GET http://host/path``) and an
  ``https://`` one through a ``CONNECT`` tunnel (``HTTPSConnection.set_tunnel``), TLS
  verified end to end with the server. The proxy itself is spoken to in plain HTTP
  (an ``http://`` proxy URL, or one without a scheme, as httpx reads it); its
  credentials go as ``Proxy-Authorization``.
"""

from __future__ import annotations

import base64
import json as jsonlib
import urllib.request
from typing import Any, NamedTuple
from urllib.parse import SplitResult, quote, unquote, urlsplit

__all__ = ["Route", "basic_auth", "json_body", "request_target", "route_to"]

#: What httpx leaves as it is in a query: printable ASCII but space, ``"``, ``#``, ``<``, ``>``.
_QUERY_SAFE = "".join(chr(i) for i in range(0x21, 0x7F) if chr(i) not in '"#<>')
#: ... and in a path: the query's set without ``?``, `````, ``{``, ``}``.
_PATH_SAFE = "".join(c for c in _QUERY_SAFE if c not in "?`{}")


class Route(NamedTuple):
    """How to reach a server: the host and port to connect to, and what a proxy needs.

    ``proxy`` False: ``host``/``port`` are the server's own. True: they are the proxy's;
    ``absolute`` is the ``scheme://host:port`` an ``http://`` server's requests are sent to
    in absolute form (empty for ``https://``, tunnelled), and ``proxy_headers`` the
    headers the proxy is sent (its credentials) with each request or the ``CONNECT``.
    """

    host: str
    port: int
    proxy: bool = False
    absolute: str = ""
    proxy_headers: tuple[tuple[str, str], ...] = ()


def route_to(url: SplitResult) -> Route:
    """The way to the server at ``url``: straight, or through the environment's proxy for it.

    Raises ValueError for a proxy the lean client cannot speak to (not plain ``http://``).
    """
    https = url.scheme == "https"
    host = url.hostname or ""
    port = url.port or (443 if https else 80)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(url.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass(url.netloc.rpartition("@")[2]):
        return Route(host, port)
    parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(
            f"the proxy {parts.scheme}://{parts.hostname or ''} (from the environment) "
            "is not one kcache speaks to: give an http:// proxy, or name the server in NO_PROXY"
        )
    headers: tuple[tuple[str, str], ...] = ()
    if parts.username is not None:
        headers = (("Proxy-Authorization", basic_auth(parts.username, parts.password)),)
    origin = "" if https else f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    return Route(parts.hostname, parts.port or 80, True, origin, headers)


def request_target(raw: str) -> str:
    """``raw`` (a path, perhaps with ``?query`` and ``#fragment``) as httpx sends it."""
    raw = raw.partition("#")[0]
    path, mark, query = raw.partition("?")
    if "." in path:
        path = _without_dot_segments(path)
    target = quote(path or "/", safe=_PATH_SAFE)
    return f"{target}?{quote(query, safe=_QUERY_SAFE)}" if mark else target


def _without_dot_segments(path: str) -> str:
    """``path`` with its ``.`` and ``..`` segments resolved, as httpx normalises a URL's path."""
    segments = path.split("/")
    if not any(s in (".", "..") for s in segments):
        return path
    kept: list[str] = []
    for segment in segments:
        if segment == ".":
            continue
        if segment == "..":
            if kept and kept != [""]:
                kept.pop()
            continue
        kept.append(segment)
    return "/".join(kept)


def json_body(value: Any) -> bytes:
    """``value`` as httpx sends a ``json=`` body: compact UTF-8, NaN refused (ValueError)."""
    return jsonlib.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def basic_auth(username: str, password: str | None) -> str:
    """The Basic ``Authorization`` value of a URL's (percent-encoded) user and password."""
    pair = f"{unquote(username)}:{unquote(password or '')}".encode()
    return "Basic " + base64.b64encode(pair).decode("ascii")
