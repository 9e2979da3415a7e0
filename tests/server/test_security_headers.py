"""Every answer carries ``X-Content-Type-Options: nosniff``, every HTML one a CSP; no /docs page.

Before: no answer carried ``nosniff``, and ``/docs`` (no token needed) sent Swagger UI
without a CSP, loading its script and stylesheet from a public CDN, on the origin
whose dashboard holds a bearer token. Now every route of the app (found by walking
its routes, so a new one is covered without naming it here), every refusal (401,
403, 404, 405, 413, 422) and both fast paths (the warm fetch answered in the HTTP
protocol's parser callback and through ASGI, the resolve hit likewise) carry the
header, and ``/docs`` and ``/redoc`` are not served.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from kcache_server.serving.artifact_fastpath import ArtifactFastPath
from kcache_server.serving.resolve_fastpath import ResolveFastPath

from tests.support import ServerThread, unique, vector_add


@dataclass
class Served:
    """The server, its tokens by scope, and one compiled recipe."""

    server: ServerThread
    tokens: dict[str, str]
    recipe: dict[str, Any]
    recipe_key: str
    digest: str

    def client(self, scope: str | None = "admin") -> httpx.Client:
        return self.server.client(self.tokens[scope] if scope else None)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One server with tokens (so the gate refuses) and a compiled recipe (stopped after the module)."""
    from kcache_server import Settings

    data = tmp_path_factory.mktemp("headers") / "data"
    server = ServerThread(
        Settings(
            data_dir=data,
            compile_workers=1,
            auth_cache_s=60.0,  # the fast paths answer only for tokens the cache decided
            max_request_bytes=1 << 20,
            verify={"enabled": False},
        )
    )
    try:
        tokens = {s: server.state.tokens.create(f"h-{s}", [s]) for s in ("admin", "read")}
        recipe = vector_add(unique("headers"))
        with server.client(tokens["admin"]) as http:
            answer = http.post("/v1/resolve", json={"recipe": recipe})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        yield Served(server, tokens, recipe, body["recipe_key"], body["artifact"]["digest"])
    finally:
        server.stop()


def _routes(app: Any) -> list[tuple[str, str]]:
    """Every (method, path template) the app routes, included routers opened up."""
    found: list[tuple[str, str]] = []
    routes = list(app.router.routes)
    while routes:
        route = routes.pop()
        inner = getattr(route, "original_router", None)
        if inner is not None:
            routes.extend(inner.routes)
            continue
        for method in getattr(route, "methods", None) or ():
            found.append((method, route.path))
    return sorted(found)


def _nosniff(reply: httpx.Response) -> bool:
    return reply.headers.get("x-content-type-options") == "nosniff"


def test_every_route_answers_with_nosniff_and_html_with_a_csp(served: Served) -> None:
    params = {
        "recipe_key": served.recipe_key,
        "digest": served.digest,
        "name": "dashboard.js",
        "job_id": "security-headers-job",
        "library": "cupy",  # a foreign entry (section 10 of docs/design.md) nobody published
        "key": "0123abcd",
    }
    routes = _routes(served.server.app)
    assert len(routes) >= 20, routes
    seen_html = 0
    with served.client("admin") as admin, served.client("read") as reader:
        for method, template in routes:
            path = re.sub(r"\{(\w+)\}", lambda m: params[m.group(1)], template)
            if method in ("GET", "HEAD"):
                reply = admin.request(method, path, follow_redirects=False)
            else:  # a read token and a body that is not an object: refused, nothing changes
                reply = reader.request(
                    method, path, content=b"[]", headers={"content-type": "application/json"}
                )
            assert reply.status_code < 500, (method, path, reply.text)
            assert _nosniff(reply), (method, path, reply.status_code, dict(reply.headers))
            if reply.headers.get("content-type", "").startswith("text/html"):
                seen_html += 1
                assert "content-security-policy" in reply.headers, (method, path)
    assert seen_html >= 1  # the dashboard


def test_refusals_carry_nosniff(served: Served) -> None:
    with served.client(None) as anonymous, served.client("read") as reader:
        refused = [
            anonymous.get(f"/v1/recipes/{served.recipe_key}"),  # 401
            reader.get("/v1/cache"),  # 403
            reader.get("/no/such/path"),  # 404
            reader.put("/v1/resolve"),  # 405
            reader.post("/v1/resolve", content=b"{" * (2 << 20)),  # 413
            reader.post("/v1/resolve", json={"recipe": {}}),  # 422
            reader.get("/v1/recipes/not-a-key"),  # 400
        ]
    assert [r.status_code for r in refused] == [401, 403, 404, 405, 413, 422, 400]
    for reply in refused:
        assert _nosniff(reply), (reply.status_code, dict(reply.headers))


def test_the_fast_paths_answer_with_nosniff(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    answered = {"fetch": 0, "resolve": 0}
    finish, count = ArtifactFastPath.finish, ResolveFastPath.count

    def counted_finish(self: ArtifactFastPath, *args: Any) -> None:
        answered["fetch"] += 1
        finish(self, *args)

    def counted_count(self: ResolveFastPath, *args: Any) -> None:
        answered["resolve"] += 1
        count(self, *args)

    monkeypatch.setattr(ArtifactFastPath, "finish", counted_finish)
    monkeypatch.setattr(ResolveFastPath, "count", counted_count)
    path = f"/v1/recipes/{served.recipe_key}/artifact"
    body = {"recipe": served.recipe, "compile": False}
    with served.client("read") as http:
        assert http.get(path).status_code == 200  # the route fills the memory caches
        warm = http.post("/v1/resolve", json=body)  # the route fills the resolver's
        assert warm.status_code == 200 and _nosniff(warm)
        before = dict(answered)
        replies = [
            http.get(path),  # answered in the protocol's parser callback
            # An escaped path: through uvicorn's ASGI cycle (the protocol leaves escapes to it).
            http.get(path.replace("/recipes/", "/recip%65s/")),
            http.get(path, headers={"If-None-Match": f'"{served.digest}"'}),  # a 304
            http.post("/v1/resolve", json=body),  # a hit read by the protocol
            # A chunked body (no Content-Length): the ASGI side of the resolve fast path.
            http.post(
                "/v1/resolve",
                content=iter([httpx.Request("POST", "/", json=body).content]),
                headers={"content-type": "application/json"},
            ),
        ]
    assert [r.status_code for r in replies] == [200, 200, 304, 200, 200]
    assert answered == {"fetch": before["fetch"] + 3, "resolve": before["resolve"] + 2}
    for reply in replies:
        assert _nosniff(reply), (reply.request.url, dict(reply.headers))


def test_no_docs_page_is_served_and_no_page_references_another_host(served: Served) -> None:
    with served.client(None) as anonymous, served.client("admin") as admin:
        for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            for http in (anonymous, admin):
                reply = http.get(path)
                assert reply.status_code in (401, 404), (path, reply.status_code)
                assert "text/html" not in reply.headers.get("content-type", "")
        page = anonymous.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assets = [anonymous.get(f"/dashboard/{n}").text for n in ("dashboard.js", "dashboard.css")]
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "http" not in csp
    for text in (page.text, *assets):
        # No script, style, image or font from elsewhere: every reference is this origin's.
        assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", text)
        assert not re.search(r"""url\(\s*["']?(?:https?:)?//""", text)
        assert not re.search(r"""import\s*\(?\s*["'](?:https?:)?//""", text)
