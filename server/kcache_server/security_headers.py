"""The headers every answer carries against content sniffing and foreign scripts.

- ``X-Content-Type-Options: nosniff`` on every answer: a browser never reads a blob
  (``application/octet-stream``) or a JSON error as a script or a page.
- ``Content-Security-Policy`` on every HTML answer: a page that sets its own (the
  dashboard's allows its own script and style) keeps it; any other HTML gets
  :data:`HTML_CSP`, which allows nothing to load or run.

The framework's answers get them from the request-id middleware in
:mod:`kcache_server.serving.app` (:func:`secure`), which already rewrites every answer's
headers; the fast paths (:mod:`~kcache_server.serving.artifact_fastpath`,
:mod:`~kcache_server.serving.resolve_fastpath`) put :data:`NOSNIFF` into the header lists they
encode once, so a warm answer costs nothing more.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["CSP", "HTML_CSP", "NOSNIFF", "secure"]

#: ``X-Content-Type-Options: nosniff`` as an ASGI header pair.
NOSNIFF = (b"x-content-type-options", b"nosniff")
#: The policy of an HTML answer that states none: nothing loads, runs or frames it.
HTML_CSP = "default-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
_CSP_NAME = b"content-security-policy"
#: ``Content-Security-Policy`` with :data:`HTML_CSP`, as an ASGI header pair.
CSP = (_CSP_NAME, HTML_CSP.encode())


def secure(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` (lower-case ASGI pairs) with :data:`NOSNIFF`, and :data:`CSP` if HTML has none."""
    out = list(headers)
    html = has_csp = has_nosniff = False
    for name, value in out:
        if name == b"content-type":
            html = value[:9].lower() == b"text/html"
        elif name == _CSP_NAME:
            has_csp = True
        elif name == NOSNIFF[0]:
            has_nosniff = True
    if not has_nosniff:
        out.append(NOSNIFF)
    if html and not has_csp:
        out.append(CSP)
    return out
