"""The fetch-by-key fast path: answered below the framework when warm, the route otherwise."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import httpx
from kcache_server.serving.artifact_fastpath import ROUTE, ArtifactFastPath

from tests.support import (
    VECTOR_ADD,
    ServerProcess,
    audit_rows,
    requests_counted,
    unique,
    upgrade,
    vector_add,
)


class _Inner:
    """Stands in for the app behind the fast path; records what reached it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 599, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def _call(
    app: Any, path: str, headers: list[tuple[bytes, bytes]] | None = None
) -> tuple[int, dict[bytes, bytes], bytes]:
    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": "GET", "path": path, "headers": headers or []}
    asyncio.run(app(scope, receive, send))
    return messages[0]["status"], dict(messages[0]["headers"]), messages[1]["body"]


def test_warm_fetches_skip_the_app_and_are_all_audited(make_settings: Any, serve: Any) -> None:
    server = serve(make_settings(auth_cache_s=60.0))
    with server.client() as client:
        body = client.post("/v1/resolve", json={"recipe": vector_add(unique())}).json()
        key, digest = body["recipe_key"], body["artifact"]["digest"]
        assert (
            client.get(f"/v1/recipes/{key}/artifact").status_code == 200
        )  # the route warms the caches
        for _ in range(20):  # through real uvicorn, answered by the fast path
            reply = client.get(f"/v1/recipes/{key}/artifact")
            assert reply.status_code == 200 and hashlib.sha256(reply.content).hexdigest() == digest
            assert (
                reply.headers["etag"] == f'"{digest}"'
                and reply.headers["x-kcache-digest"] == digest
            )
        metrics = client.get("/metrics").text

    inner = _Inner()
    fast = ArtifactFastPath(inner, server.state)
    status, headers, data = _call(fast, f"/v1/recipes/{key}/artifact")
    assert (status, inner.calls) == (200, [])
    assert (
        hashlib.sha256(data).hexdigest() == digest
        and headers[b"content-length"] == str(len(data)).encode()
    )
    status, _, data = _call(
        fast, f"/v1/recipes/{key}/artifact", [(b"if-none-match", f'"{digest}"'.encode())]
    )
    assert (status, data, inner.calls) == (304, b"", [])
    cold = "0" * 64
    assert _call(fast, f"/v1/recipes/{cold}/artifact")[0] == 599 and inner.calls == [
        f"/v1/recipes/{cold}/artifact"
    ]

    assert requests_counted(metrics, ROUTE, "GET", "200") == 21
    server.stop()  # flushes the audit log
    rows = audit_rows(server.settings.database_url, route="fetch", outcome="hit", recipe_key=key)
    # Identical warm fetches are tallied into few rows; together they count every lookup.
    assert sum(row.count for row in rows) == 23 and len(rows) < 23


def test_tokens_the_cache_cannot_decide_go_to_the_route(make_settings: Any, serve: Any) -> None:
    server = serve(make_settings(auth_cache_s=60.0))
    with server.client() as open_client:
        key = open_client.post("/v1/resolve", json={"recipe": vector_add(unique())}).json()[
            "recipe_key"
        ]
        open_client.get(f"/v1/recipes/{key}/artifact")
    token = server.state.tokens.create("reader", ["read"])
    with server.client() as anonymous:
        denied = anonymous.get(f"/v1/recipes/{key}/artifact")
    assert denied.status_code == 401 and denied.json()["error"] == "unauthorized"
    with server.client(token) as reader:
        assert reader.get(f"/v1/recipes/{key}/artifact").status_code == 200
        assert reader.get(f"/v1/recipes/{key}/artifact").status_code == 200
    with server.client("not-a-token") as wrong:
        assert wrong.get(f"/v1/recipes/{key}/artifact").status_code == 401


def test_a_changed_include_set_file_is_never_served_from_memory(
    make_settings: Any, serve: Any, tmp_path: Path
) -> None:
    library = tmp_path / "lib"
    library.mkdir()
    (library / "scale.h").write_text("#define SCALE 2\n")
    server = serve(make_settings(auth_cache_s=60.0, include_sets={"lib": library}))
    recipe = {
        "source": f'// {unique()}\n#include <scale.h>\nextern "C" __global__ void k(int* o) {{ o[0] = SCALE; }}',
        "target": "sm_80",
        "include_sets": ["lib"],
    }
    with server.client() as client:
        key = client.post("/v1/resolve", json={"recipe": recipe}).json()["recipe_key"]
        assert client.get(f"/v1/recipes/{key}/artifact").status_code == 200
        (library / "scale.h").write_text("#define SCALE 3\n")
        stale = client.get(f"/v1/recipes/{key}/artifact")
    assert (
        stale.status_code == 404 and "include-set files that have changed" in stale.json()["detail"]
    )


def test_warm_resolve_hits_still_notice_a_lost_blob_and_an_edited_include_set(
    make_settings: Any, serve: Any, tmp_path: Path
) -> None:
    library = tmp_path / "lib2"
    library.mkdir()
    (library / "v.h").write_text("#define V 1\n")
    server = serve(make_settings(include_sets={"lib": library}))
    recipe = {
        "source": f'// {unique()}\n#include <v.h>\nextern "C" __global__ void k(int* o) {{ o[0] = V; }}',
        "target": "sm_80",
        "include_sets": ["lib"],
    }
    with server.client() as client:
        first = client.post("/v1/resolve", json={"recipe": recipe}).json()
        assert first["status"] == "compiled"
        assert client.post("/v1/resolve", json={"recipe": recipe}).json()["status"] == "hit"
        server.state.backends.store.delete(first["artifact"]["digest"])  # gc'd, or lost
        again = client.post("/v1/resolve", json={"recipe": recipe}).json()
        assert (
            again["status"] == "compiled"
            and again["artifact"]["digest"] == first["artifact"]["digest"]
        )
        (library / "v.h").write_text("#define V 2\n")
        edited = client.post("/v1/resolve", json={"recipe": recipe}).json()
    assert (
        edited["status"] == "compiled"
        and edited["artifact"]["digest"] != first["artifact"]["digest"]
    )


def test_artifacts_recorded_without_an_exact_dependency_list_are_never_fetched(
    make_settings: Any, serve: Any
) -> None:
    """A legacy row (``dependencies_exact`` false) is refused by the route and the fast path, as resolve refuses it."""
    import sqlalchemy as sa
    from kcache_server.resolving import _Known

    settings = make_settings(auth_cache_s=60.0)
    recipe = vector_add(unique("legacy"))
    first = serve(settings)
    with first.client() as client:
        body = client.post("/v1/resolve", json={"recipe": recipe}).json()
    key, digest = body["recipe_key"], body["artifact"]["digest"]
    first.stop()
    engine = sa.create_engine(settings.database_url)
    with engine.begin() as conn:  # what a server from before exact dependency tracking recorded
        conn.execute(
            sa.text("UPDATE artifacts SET dependencies_exact = false WHERE digest = :d"),
            {"d": digest},
        )
    engine.dispose()

    server = serve(settings)
    with server.client() as client:
        for path in (
            f"/v1/recipes/{key}/artifact",
            f"/v1/recipes/{key}/artifact",
            f"/v1/recipes/{key}",
        ):
            refused = client.get(path)
            assert refused.status_code == 404, refused.text
            assert "without an exact list of the files it read" in refused.json()["detail"]
        # Memory never serves one either, however it got there: the fast path hands it on.
        resolver = server.state.resolver
        meta = server.state.backends.index.artifact(digest)
        assert meta is not None and meta.dependencies_exact is False
        resolver._known.put(key, _Known(meta))
        inner = _Inner()
        assert _call(ArtifactFastPath(inner, server.state), f"/v1/recipes/{key}/artifact")[0] == 599
        assert (
            inner.calls == [f"/v1/recipes/{key}/artifact"] and resolver.cached_artifact(key) is None
        )
        # Resolving compiles it afresh (the engine refuses the row too); then it is fetched again.
        again = client.post("/v1/resolve", json={"recipe": recipe}).json()
        assert again["status"] == "compiled" and again["artifact"]["dependencies_exact"] is True
        fetched = client.get(f"/v1/recipes/{key}/artifact")
    assert fetched.status_code == 200 and hashlib.sha256(fetched.content).hexdigest() == digest


def _raw(url: str, request: bytes) -> bytes:
    """Send ``request`` bytes on a new connection and read until the server closes it."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_warm_fetches_are_answered_as_the_route_answers_them(
    make_settings: Any, serve: Any
) -> None:
    """A warm fetch answered by the fast path in front of the app gets the route's status,
    bytes and headers (but the request id and date), ``nosniff`` among them; an escaped
    path (``recip%65s``, decoded by uvicorn) and pipelined or HTTP/1.0 requests too; every
    one audited and counted."""
    server = serve(make_settings(auth_cache_s=60.0))
    with server.client() as client:
        key = client.post("/v1/resolve", json={"recipe": vector_add(unique())}).json()["recipe_key"]
        path = f"/v1/recipes/{key}/artifact"
        state = server.state
        state.resolver.forget(key)  # the next fetch is the route's, which warms the caches
        routed = client.get(path)
        assert state.resolver.cached_artifact(key) is not None
        # A query string would go to the app, which refuses unknown parameters.
        escaped = path.replace("/recipes/", "/recip%65s/")
        direct, through_escape = client.get(path), client.get(escaped)
        etag = direct.headers["etag"]
        fresh = client.get(path, headers={"If-None-Match": etag})
        fresh_escaped = client.get(escaped, headers={"If-None-Match": etag})

    def same(reply: Any) -> tuple[int, bytes, list[tuple[str, str]]]:
        skip = {"x-request-id", "date"}
        return (
            reply.status_code,
            reply.content,
            sorted((k, v) for k, v in reply.headers.items() if k not in skip),
        )

    assert same(direct) == same(routed)
    assert direct.headers["x-content-type-options"] == "nosniff"
    assert same(direct) == same(through_escape) and direct.status_code == 200
    assert same(fresh) == same(fresh_escaped) and fresh.status_code == 304
    assert direct.headers["x-request-id"] != through_escape.headers["x-request-id"]
    assert direct.headers["server"] == through_escape.headers["server"] == "uvicorn"

    # Pipelined on one connection, then closed as asked: each answered in order.
    one = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    last = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    raw = _raw(server.url, one + one + last)
    assert raw.count(b"HTTP/1.1 200 OK\r\n") == 3 and raw.endswith(direct.content)
    assert raw.count(direct.content) == 3 and b"connection: close\r\n" in raw.lower()
    http10 = _raw(server.url, f"GET {path} HTTP/1.0\r\n\r\n".encode())
    assert http10.startswith(b"HTTP/1.1 200 OK\r\n") and http10.endswith(direct.content)

    with server.client() as client:
        metrics = client.get("/metrics").text
    # The route's warming fetch, 2 + 3 + 1 warm ones; two 304s.
    assert requests_counted(metrics, ROUTE, "GET", "200") == 7
    assert requests_counted(metrics, ROUTE, "GET", "304") == 2
    server.stop()
    rows = audit_rows(server.settings.database_url, route="fetch", outcome="hit", recipe_key=key)
    assert sum(row.count for row in rows) == 9


def test_kcache_serve_answers_on_stock_uvicorn(tmp_path: Path) -> None:
    """The real command (stock uvicorn, the fast paths in front): a compile, a fetch, a 304, a 404."""
    db_url = f"sqlite:///{tmp_path / 'kcache.db'}"
    upgrade(db_url)
    with (
        ServerProcess(tmp_path / "data", db_url=db_url) as server,
        httpx.Client(base_url=server.url) as c,
    ):
        body = {"recipe": {"source": VECTOR_ADD, "target": "sm_90"}, "compile": True}
        key = c.post("/v1/resolve", json=body, timeout=120).raise_for_status().json()["recipe_key"]
        first = c.get(f"/v1/recipes/{key}/artifact")
        assert first.status_code == 200 and first.content.startswith(b"\x7fELF")
        assert int(first.headers["content-length"]) == len(first.content)
        again = c.get(
            f"/v1/recipes/{key}/artifact", headers={"If-None-Match": first.headers["etag"]}
        )
        assert again.status_code == 304 and again.content == b""
        assert c.get(f"/v1/recipes/{'0' * 64}/artifact").status_code == 404
