"""The resolve-hit fast path: answers exactly as the route would, and leaves the rest to it.

Two real servers share one data directory: ``fast`` is what ``kcache serve`` runs (both
fast paths in front of the app), ``route`` serves the bare FastAPI app. The same request
to each must get the same status, bytes and headers. Driving the middleware directly,
in front of a stand-in app, shows which requests it answered itself.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from kcache_server.routes._deps import INLINE_BODY_BYTES
from kcache_server.serving.resolve_fastpath import ROUTE, ResolveFastPath

from tests.support import ServerThread, audit_rows, requests_counted, unique, vector_add


@dataclass
class Pair:
    """Both servers, and a token of each scope that matters here."""

    fast: ServerThread
    route: ServerThread
    compiler: str
    reader: str
    library: Path


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    import kcache_server.serving.app
    from kcache_server import Settings

    root = tmp_path_factory.mktemp("resolve-fastpath")
    library = root / "lib"
    library.mkdir()
    (library / "v.h").write_text("#define V 1\n")
    settings = Settings(
        data_dir=root / "data",
        compile_workers=1,
        audit={"flush_s": 0.05},
        auth_cache_s=600.0,  # the fast path answers only what the token cache decides
        include_sets={"lib": library},
    )
    fast = ServerThread(settings)
    # Tokens before the second server starts: each caches "tokens exist" on first use.
    compiler = fast.state.tokens.create("compiler", ["compile"])
    reader = fast.state.tokens.create("reader", ["read"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kcache_server.serving.app, "serving_app", lambda app: app)  # the bare app
        route = ServerThread(settings)
    try:
        yield Pair(fast, route, compiler, reader, library)
    finally:
        route.stop()
        fast.stop()


def _post(
    server: ServerThread,
    body: Any,
    token: str | None,
    *,
    raw: bytes | None = None,
    content_type: str | None = "application/json",
    chunked: bool = False,
) -> httpx.Response:
    """POST ``body`` (or ``raw``) to ``server``; ``chunked`` sends it in pieces, without a length."""
    data = json.dumps(body).encode() if raw is None else raw
    headers = {"Content-Type": content_type} if content_type else {}
    content: Any = iter([data[:10], data[10:100], data[100:]]) if chunked else data
    with server.client(token) as client:
        return client.post("/v1/resolve", content=content, headers=headers)


def _same_answer(pair: Pair, body: Any, token: str | None, **kwargs: Any) -> httpx.Response:
    """Post ``body`` to both servers; assert the answers are the same; return the fast one."""
    fast = _post(pair.fast, body, token, **kwargs)
    route = _post(pair.route, body, token, **kwargs)
    assert (fast.status_code, fast.content) == (route.status_code, route.content), (
        fast.text,
        route.text,
    )
    for name in ("content-type", "content-length", "allow", "retry-after", "www-authenticate"):
        assert fast.headers.get(name) == route.headers.get(name), name
    assert fast.headers["x-request-id"] != route.headers["x-request-id"]
    return fast


class _Inner:
    """Stands in for the app behind the middleware; records the bodies that reached it."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 599, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def _call(
    app: Any, body: bytes, headers: list[tuple[bytes, bytes]], chunks: int = 1
) -> tuple[int, dict[bytes, bytes], bytes]:
    """Drive ``app`` with one POST /v1/resolve whose body arrives in ``chunks`` messages."""
    size = -(-len(body) // chunks) or 1
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    messages = [
        {"type": "http.request", "body": part, "more_body": i < len(parts) - 1}
        for i, part in enumerate(parts)
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": ROUTE, "headers": headers}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


def _headers(token: str, content_type: bytes = b"application/json") -> list[tuple[bytes, bytes]]:
    return [(b"authorization", b"Bearer " + token.encode()), (b"content-type", content_type)]


def _compiled(pair: Pair, recipe: dict[str, Any]) -> dict[str, Any]:
    """Compile ``recipe`` through the fast server and warm both servers' memory from the index.

    The compiling server remembers the compile's own metadata, whose ``created_at`` has
    more digits than the index keeps: both servers must hold the index's to answer alike.
    """
    answer = _post(pair.fast, {"recipe": recipe}, pair.compiler).json()
    assert answer["status"] == "compiled", answer
    pair.fast.state.resolver.forget(answer["recipe_key"])
    for server in (pair.fast, pair.route):  # the index answers once, then memory does
        assert _post(server, {"recipe": recipe}, pair.compiler).json()["status"] == "hit"
    return answer


def test_a_hit_gets_the_routes_answer_byte_for_byte(pair: Pair) -> None:
    recipe = vector_add(unique())
    compiled = _compiled(pair, recipe)
    bodies = [
        {"recipe": recipe},
        {"recipe": recipe, "compile": False},
        {"recipe": recipe, "context": {"job_id": "j1", "rank": 3.0, "world_size": 8, "pid": 7}},
        {"context": {"host": "n\u00e9ud"}, "recipe": {**recipe, "name": "kernel.cu"}},
    ]
    for body in bodies:
        answer = _same_answer(pair, body, pair.compiler).json()
        assert answer["status"] == "hit" and answer["recipe_key"] == compiled["recipe_key"]
        assert answer["artifact"]["digest"] == compiled["artifact"]["digest"]
        # Sent in several chunks without a Content-Length, it is still the same answer.
        chunked = _same_answer(pair, body, pair.compiler, chunked=True)
        assert chunked.json() == answer and "content-length" not in chunked.request.headers

    # Those hits were the middleware's own: the app behind it saw none of them.
    inner = _Inner()
    fast = ResolveFastPath(inner, pair.fast.state)
    route_answer = _post(pair.route, bodies[0], pair.compiler).content
    for chunks in (1, 3):
        raw = json.dumps(bodies[0]).encode()
        status, headers, data = _call(fast, raw, _headers(pair.compiler), chunks)
        assert (status, data, inner.bodies) == (200, route_answer, [])
        assert headers[b"content-type"] == b"application/json"
        assert headers[b"content-length"] == str(len(data)).encode()
    # A read token may take a hit that does not ask to compile, once the token cache knows it.
    raw = json.dumps({"recipe": recipe, "compile": False}).encode()
    assert _call(fast, raw, _headers(pair.reader))[0] == 599 and inner.bodies == [raw]
    _same_answer(pair, {"recipe": recipe, "compile": False}, pair.reader)  # checked by the route
    assert _call(fast, raw, _headers(pair.reader))[0] == 200 and inner.bodies == [raw]


def _resolves_counted(server: ServerThread, token: str) -> float:
    """``kcache_http_requests_total`` of ``POST /v1/resolve`` answered 200, from ``/metrics``."""
    with server.client(token) as client:
        metrics = client.get("/metrics").text
    return requests_counted(metrics, ROUTE, "POST", "200")


def test_hits_are_audited_and_counted_as_the_routes_are(pair: Pair) -> None:
    recipe = vector_add(unique())
    key = _compiled(pair, recipe)["recipe_key"]
    hits = 7
    for name, server in (("fast", pair.fast), ("route", pair.route)):
        before = _resolves_counted(server, pair.compiler)
        body = {"recipe": recipe, "context": {"client_id": name, "rank": 1, "job_id": "audit"}}
        for _ in range(hits):
            assert _post(server, body, pair.compiler).json()["status"] == "hit"
        assert _resolves_counted(server, pair.compiler) == before + hits
    pair.fast.state.audit.flush()
    pair.route.state.audit.flush()
    url = pair.fast.settings.database_url
    rows = {
        name: audit_rows(url, route="resolve", outcome="hit", recipe_key=key, client_id=name)
        for name in ("fast", "route")
    }
    assert sum(r.count for r in rows["fast"]) == sum(r.count for r in rows["route"]) == hits
    # Each hit saved the compile time of the artifact its server holds.
    for name, server in (("fast", pair.fast), ("route", pair.route)):
        meta = server.state.resolver.cached_artifact(key)
        saved = sum(r.compile_seconds_saved for r in rows[name])
        assert meta.compile_seconds > 0 and saved == pytest.approx(hits * meta.compile_seconds)

    def record(row: Any) -> dict[str, Any]:
        skip = {"id", "at", "latency_ms", "count", "compile_seconds_saved", "client_id"}
        return {k: v for k, v in row._mapping.items() if k not in skip}

    assert {json.dumps(record(r), default=str) for r in rows["fast"]} == {
        json.dumps(record(r), default=str) for r in rows["route"]
    }


@pytest.mark.parametrize(
    ("case", "raw", "content_type", "token"),
    [
        ("not JSON", b'{"recipe": ', b"application/json", "compiler"),
        ("not an object", b"[1]", b"application/json", "compiler"),
        (
            "unknown field",
            b'{"recipe": {"source": "x", "target": "sm_80"}, "x": 1}',
            None,
            "compiler",
        ),
        ("bad recipe", b'{"recipe": {"source": "x", "target": "sm_1"}}', None, "compiler"),
        ("bad context", b'{"recipe": {}, "context": {"rank": true}}', None, "compiler"),
        ("a form", b"recipe=x", b"application/x-www-form-urlencoded", "compiler"),
        ("miss, compile false", b"MISS", None, "compiler"),
        ("hit, compile by a reader", b"HIT", None, "reader"),
        ("hit, no token", b"HIT", None, None),
        ("hit, unknown token", b"HIT", None, "kc_unknown-token-of-enough-length"),
    ],
)
def test_everything_but_a_hit_is_the_routes_answer(
    pair: Pair, case: str, raw: bytes, content_type: bytes | None, token: str | None
) -> None:
    recipe = vector_add(unique())
    if raw == b"HIT":
        _compiled(pair, recipe)
        raw = json.dumps({"recipe": recipe}).encode()
    elif raw == b"MISS":
        raw = json.dumps({"recipe": recipe, "compile": False}).encode()
    value = {"compiler": pair.compiler, "reader": pair.reader}.get(token or "", token)
    kind = content_type.decode() if content_type else None
    answer = _same_answer(pair, None, value, raw=raw, content_type=kind)
    assert answer.status_code >= 400, case
    assert set(answer.json()) >= {"error", "detail"}

    # The middleware handed it on, with the body it had read replayed in full.
    if value is not None:
        inner = _Inner()
        fast = ResolveFastPath(inner, pair.fast.state)
        hdrs = _headers(value, content_type or b"application/json")
        assert _call(fast, raw, hdrs, chunks=2)[0] == 599 and inner.bodies == [raw], case


def test_large_bodies_and_unservable_hits_go_to_the_route(pair: Pair) -> None:
    inner = _Inner()
    fast = ResolveFastPath(inner, pair.fast.state)
    # Over the inline size: neither read here nor parsed on the event loop.
    big = {**vector_add(unique()), "headers": {"big.h": "// " + "x" * INLINE_BODY_BYTES}}
    raw = json.dumps({"recipe": big}).encode()
    _compiled(pair, big)
    assert _same_answer(pair, {"recipe": big}, pair.compiler).json()["status"] == "hit"
    length = [(b"content-length", str(len(raw)).encode())]
    assert _call(fast, raw, _headers(pair.compiler) + length)[0] == 599
    assert _call(fast, raw, _headers(pair.compiler), chunks=4)[0] == 599
    assert inner.bodies == [raw, raw]

    # A lost blob and an edited include-set file are noticed by the resolver's own checks.
    recipe = {
        "source": f'// {unique()}\n#include <v.h>\nextern "C" __global__ void k(int* o) {{ o[0] = V; }}',
        "target": "sm_80",
        "include_sets": ["lib"],
    }
    first = _compiled(pair, recipe)
    body = json.dumps({"recipe": recipe}).encode()
    assert _call(fast, body, _headers(pair.compiler))[0] == 200
    pair.fast.state.backends.store.delete(first["artifact"]["digest"])
    assert _call(fast, body, _headers(pair.compiler))[0] == 599
    again = _post(pair.fast, {"recipe": recipe}, pair.compiler).json()
    assert again["status"] == "compiled"
    assert again["artifact"]["digest"] == first["artifact"]["digest"]
    assert _call(fast, body, _headers(pair.compiler))[0] == 200
    (pair.library / "v.h").write_text("#define V 2\n")
    assert _call(fast, body, _headers(pair.compiler))[0] == 599
    edited = _post(pair.fast, {"recipe": recipe}, pair.compiler).json()
    assert edited["status"] == "compiled"
    assert edited["artifact"]["digest"] != first["artifact"]["digest"]


def test_a_declined_body_is_parsed_once_and_answered_by_the_route(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A miss, a compile and a refused scope pass the fast path to the route: one parse each."""
    checks = pair.fast.state.recipes
    parse = checks.parse_resolve
    parsed: list[bytes] = []

    def counted(raw: bytes, **kwargs: Any) -> Any:
        parsed.append(raw)
        return parse(raw, **kwargs)

    monkeypatch.setattr(checks, "parse_resolve", counted)
    recipe = vector_add(unique())
    cases = [
        ({"recipe": recipe, "compile": False}, pair.compiler, 404),  # a miss
        ({"recipe": recipe}, pair.reader, 403),  # compiling takes the compile scope
        ({"recipe": recipe}, pair.compiler, 200),  # compiled by the route
    ]
    for body, token, status in cases:
        parsed.clear()
        answer = _post(pair.fast, body, token)
        assert answer.status_code == status, answer.text
        assert parsed == [json.dumps(body).encode()]
    assert answer.json()["status"] == "compiled"
    assert answer.json()["base_key"]  # the route computed what the fast path left to it
    parsed.clear()
    assert _post(pair.fast, {"recipe": recipe}, pair.compiler).json()["status"] == "hit"
    assert len(parsed) == 1  # answered by the fast path (memory), or by the route: one parse


def _in_chain(app: Any) -> ResolveFastPath | None:
    """The resolve fast path in uvicorn's app chain (under uvicorn's own middleware), if any."""
    while app is not None and not isinstance(app, ResolveFastPath):
        app = getattr(app, "app", None)
    return app


class _Spy:
    """Counts the requests that reached the resolve fast path on a running server."""

    def __init__(self, server: ServerThread, patch: pytest.MonkeyPatch) -> None:
        middleware = _in_chain(server.server.config.loaded_app)
        assert middleware is not None
        self.calls = 0
        serve = middleware._serve

        async def counted(*args: Any) -> Any:
            self.calls += 1
            return await serve(*args)

        patch.setattr(middleware, "_serve", counted)


def _raw_exchange(server: ServerThread, data: bytes, answers: int) -> list[bytes]:
    """Send ``data`` on one connection; the ``answers`` responses read back (heads and bodies)."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(data)
        buffer, responses = b"", list[bytes]()
        while len(responses) < answers:
            while b"\r\n\r\n" not in buffer:
                chunk = conn.recv(65536)
                assert chunk, (buffer, responses)
                buffer += chunk
            head, buffer = buffer.split(b"\r\n\r\n", 1)
            length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
            while len(buffer) < length:
                buffer += conn.recv(65536)
            responses.append(head + b"\r\n\r\n" + buffer[:length])
            buffer = buffer[length:]
        return responses


def _request(body: bytes, token: str, *extra: str) -> bytes:
    head = [
        "POST /v1/resolve HTTP/1.1",
        "Host: t",
        f"Authorization: Bearer {token}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *extra,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def test_hits_on_a_connection_are_answered_in_order_as_the_route_would(pair: Pair) -> None:
    """Pipelined hit, miss, hit on one connection: 200, the route's 404, 200, each offered once."""
    recipe = vector_add(unique())
    _compiled(pair, recipe)
    hit = json.dumps({"recipe": recipe, "context": {"rank": 5}}).encode()
    miss = json.dumps({"recipe": vector_add(unique()), "compile": False}).encode()
    route = _post(pair.route, None, pair.compiler, raw=hit)
    with pytest.MonkeyPatch.context() as patch:
        spy = _Spy(pair.fast, patch)
        answers = _raw_exchange(
            pair.fast,
            _request(hit, pair.compiler)
            + _request(miss, pair.compiler)
            + _request(hit, pair.compiler),
            3,
        )
        assert [a.split(b" ", 2)[1:2] for a in answers] == [[b"200"], [b"404"], [b"200"]], answers
        assert answers[0].endswith(b"\r\n\r\n" + route.content)
        assert answers[2].endswith(b"\r\n\r\n" + route.content)
        assert b'"not_found"' in answers[1] or b"no artifact" in answers[1]
        assert spy.calls == 3
        # Chunked (no length): the fast path reads it whole and answers the hit.
        chunked = _same_answer(pair, json.loads(hit), pair.compiler, chunked=True)
        assert chunked.json()["status"] == "hit" and spy.calls == 4
        # Connection: close is honoured.
        closing = _raw_exchange(pair.fast, _request(hit, pair.compiler, "Connection: close"), 1)[0]
        assert b"connection: close" in closing.lower() and closing.endswith(route.content)
    first_line, *header_lines = answers[0].split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    names = {line.split(b":", 1)[0].lower() for line in header_lines}
    assert first_line == b"HTTP/1.1 200 OK"
    assert {b"date", b"server", b"content-length", b"content-type", b"x-request-id"} <= names
    assert b"x-content-type-options" in names


def test_expect_100_continue_gets_its_interim_answer_then_the_hit(pair: Pair) -> None:
    """A client that waits for ``100 Continue`` before its body gets it, then the route's answer."""
    recipe = vector_add(unique())
    _compiled(pair, recipe)
    body = json.dumps({"recipe": recipe}).encode()
    route = _post(pair.route, None, pair.compiler, raw=body)
    port = int(pair.fast.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        head = _request(body, pair.compiler, "Expect: 100-continue")[: -len(body)]
        conn.sendall(head)
        interim = b""
        while b"\r\n\r\n" not in interim:
            chunk = conn.recv(4096)
            assert chunk, interim
            interim += chunk
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n")
        conn.sendall(body)
        answer = interim.split(b"\r\n\r\n", 1)[1]
        while not answer.endswith(route.content):
            chunk = conn.recv(65536)
            assert chunk, answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
