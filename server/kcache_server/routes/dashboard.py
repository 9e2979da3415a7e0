"""``GET /dashboard``: the cache-hit auditing page, plain HTML, CSS and JavaScript (``GET /`` leads there).

The page is static and holds no data (so it needs no token); its script reads
``/v1/stats`` with the token the user enters, if the server asks for one, for what the
page's address says: the fleet, or one job (``?job_id=``), kernel (``?kernel=``) or target
(``?target=``), in a window. Every job, kernel and target it lists links to its own page. The
files are read from the package: no build step, nothing fetched from the network.
The page carries the outcome lists of :mod:`kcache.outcomes` in two ``<meta>`` tags
(data, not code, so the page's CSP still allows only its own script), which the
script draws from: the dashboard shows the outcomes the server records, whatever they are.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from kcache.errors import ArtifactNotFoundError
from kcache.outcomes import HIT_OUTCOMES, OUTCOMES

router = APIRouter(tags=["dashboard"])

_STATIC = files("kcache_server") / "static" / "dashboard"
_ASSETS = {
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
}
# A page that runs only its own script: no inline code, nothing from elsewhere.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; frame-ancestors 'none'"
)


def _read(name: str) -> str:
    return (_STATIC / name).read_text(encoding="utf-8")


def _page() -> str:
    """``index.html`` with the outcome lists written into its ``<meta>`` tags (words of [a-z_])."""
    return (
        _read("index.html")
        .replace("{{OUTCOMES}}", " ".join(OUTCOMES))
        .replace("{{HIT_OUTCOMES}}", " ".join(o for o in OUTCOMES if o in HIT_OUTCOMES))
    )


@router.get("/", include_in_schema=False)
async def root() -> RedirectResponse:
    """The server's address opened in a browser leads to the dashboard."""
    return RedirectResponse("/dashboard", status_code=307)


#: What the page's address may say; its script reads them (see :func:`dashboard`).
_Text = Annotated[str | None, Query(max_length=1024)]


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
async def dashboard(
    job_id: _Text = None,
    kernel: _Text = None,
    target: _Text = None,
    since: _Text = None,
    until: _Text = None,
    window: _Text = None,
    refresh: _Text = None,
) -> HTMLResponse:
    """The dashboard page, showing what its address says (read by its script, not here).

    ``job_id``, ``kernel``, ``target``: one job, kernel or target (as ``/v1/stats`` takes
    them), so each is one URL away; ``since`` and ``until``: a fixed window (as
    ``/v1/stats`` reads them), else ``window`` (15m ... 30d, default 24h) up to now;
    ``refresh``: seconds between reloads. Any other parameter is refused, as on every route.
    """
    return HTMLResponse(
        _page(), headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-cache"}
    )


@router.get("/dashboard/{name}", include_in_schema=False)
async def dashboard_asset(name: str) -> Response:
    """The page's stylesheet and script (a fixed list: a path is never built from the URL)."""
    media_type = _ASSETS.get(name)
    if media_type is None:
        raise ArtifactNotFoundError(f"no dashboard file {name!r}")
    return Response(_read(name), media_type=media_type, headers={"Cache-Control": "no-cache"})
