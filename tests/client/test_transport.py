"""Retries, Retry-After, error mapping and audit-event batching, against real scripted HTTP servers."""

from __future__ import annotations

import threading
import time

import pytest
from client_harness import Scripted, Seen, json_response
from kcache_client import (
    AuthenticationError,
    EventSink,
    RemoteCompileError,
    RemoteNotFoundError,
    RequestRejectedError,
    RetryPolicy,
    ServerBusyError,
    ServerUnavailableError,
)
from kcache_client._command_settings import announce_retry
from kcache_client._http import RetryNotice, Transport, parse_retry_after

from kcache.errors import ArtifactNotFoundError, CompileError, KCacheError
from tests.support import FAST, free_port


def test_503_with_retry_after_is_waited_out_then_succeeds() -> None:
    answers = iter([json_response(503, {"error": "busy"}, **{"Retry-After": "1"})])

    def route(seen: Seen) -> tuple[int, dict[str, str], bytes]:
        return next(answers, json_response(200, {"ok": True}))

    server = Scripted(route)
    try:
        transport = Transport(server.url, retry=FAST)
        started = time.monotonic()
        assert transport.request("GET", "/v1/toolchains").json() == {"ok": True}
        # Retry-After: 1 was honoured (the jittered backoff alone would be < 0.05 s).
        assert time.monotonic() - started >= 0.95
        assert server.count("GET") == 2
        assert transport.requests == 2
    finally:
        server.close()


def test_429_forever_gives_a_busy_error_after_bounded_attempts() -> None:
    server = Scripted(lambda s: json_response(429, {"error": "slow_down"}, **{"Retry-After": "0"}))
    try:
        with pytest.raises(ServerBusyError) as info:
            Transport(server.url, retry=FAST).request("POST", "/v1/resolve", json={})
        assert server.count("POST") == FAST.attempts
        assert info.value.status == 429
        assert server.url in str(info.value)
        assert isinstance(info.value, ServerUnavailableError)  # callers fall back the same way
    finally:
        server.close()


def test_retry_budget_bounds_a_long_retry_after() -> None:
    server = Scripted(lambda s: json_response(503, {"error": "busy"}, **{"Retry-After": "3600"}))
    policy = RetryPolicy(attempts=5, budget_s=1.0, max_retry_after_s=30.0)
    try:
        started = time.monotonic()
        with pytest.raises(ServerBusyError):
            Transport(server.url, retry=policy).request("GET", "/x")
        assert time.monotonic() - started < 10.0  # did not sleep an hour, nor 30 s
        assert server.count() == 1
    finally:
        server.close()


def test_connection_refused_names_the_url_and_cause() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnavailableError) as info:
        Transport(url, retry=FAST).request("GET", "/v1/toolchains")
    assert url in str(info.value)
    assert "ConnectError" in info.value.cause
    assert isinstance(info.value, ConnectionError) and isinstance(info.value, KCacheError)


def test_error_statuses_map_to_typed_errors_and_the_token_is_sent() -> None:
    def route(seen: Seen) -> tuple[int, dict[str, str], bytes]:
        if seen.headers.get("authorization") != "Bearer s3cret":
            return json_response(401, {"error": "unauthorized", "detail": "no token"})
        return {
            "/compile": json_response(
                422,
                {
                    "error": "compile_error",
                    "detail": "1 error",
                    "log": "kernel.cu(1): error: x",
                    "recipe_key": "k",
                },
            ),
            "/bad": json_response(
                422, {"error": "invalid_recipe", "detail": "flags[0]: -I is not allowed"}
            ),
            "/missing": json_response(404, {"error": "not_found", "detail": "no such recipe"}),
        }[seen.path]

    server = Scripted(route)
    try:
        with pytest.raises(AuthenticationError) as auth:
            Transport(server.url, retry=FAST).request("GET", "/bad")
        assert auth.value.status == 401 and isinstance(auth.value, PermissionError)
        transport = Transport(server.url, "s3cret", retry=FAST)
        with pytest.raises(RemoteCompileError) as comp:
            transport.request("POST", "/compile")
        assert isinstance(comp.value, CompileError)
        assert comp.value.log == "kernel.cu(1): error: x" and comp.value.recipe_key == "k"
        with pytest.raises(RequestRejectedError) as bad:
            transport.request("POST", "/bad")
        assert bad.value.detail == "flags[0]: -I is not allowed" and isinstance(
            bad.value, ValueError
        )
        with pytest.raises(RemoteNotFoundError) as missing:
            transport.request("GET", "/missing")
        assert isinstance(missing.value, ArtifactNotFoundError)
        assert server.count() == 4  # errors other than 429/503 are not retried
    finally:
        server.close()


def test_on_retry_is_told_before_each_wait_of_the_transports_own_policy_only() -> None:
    answers = iter(
        [
            json_response(503, {"error": "busy"}, **{"Retry-After": "0"}),
            json_response(502, {"error": "bad_gateway"}),
        ]
    )
    server = Scripted(lambda s: next(answers, json_response(200, {"ok": True})))
    notices: list[RetryNotice] = []
    try:
        transport = Transport(server.url, retry=FAST, on_retry=notices.append)
        assert transport.request("GET", "/v1/toolchains").json() == {"ok": True}
        assert [(n.url, n.method, n.path, n.next_try, n.attempts, n.cause) for n in notices] == [
            (server.url, "GET", "/v1/toolchains", 2, FAST.attempts, "HTTP 503"),
            (server.url, "GET", "/v1/toolchains", 3, FAST.attempts, "HTTP 502"),
        ]
        assert notices[0].wait_s == 0.0  # the server's Retry-After
        assert 0.0 <= notices[1].wait_s <= FAST.cap_s  # a backoff
        # A call with a policy of its own (the audit events) is retried by it alone, untold.
        busy = Scripted(lambda s: json_response(503, {"error": "busy"}, **{"Retry-After": "0"}))
        try:
            told = len(notices)
            with pytest.raises(ServerBusyError):
                Transport(busy.url, retry=FAST, on_retry=notices.append).request(
                    "POST", "/v1/events", json={}, retry=FAST
                )
            assert busy.count("POST") == FAST.attempts and len(notices) == told
        finally:
            busy.close()
    finally:
        server.close()


def test_a_retry_the_budget_forbids_is_not_announced() -> None:
    server = Scripted(lambda s: json_response(503, {"error": "busy"}, **{"Retry-After": "3600"}))
    notices: list[RetryNotice] = []
    try:
        transport = Transport(
            server.url, retry=RetryPolicy(attempts=5, budget_s=1.0), on_retry=notices.append
        )
        with pytest.raises(ServerBusyError):
            transport.request("GET", "/x")
        assert server.count() == 1 and notices == []
    finally:
        server.close()


def test_after_one_call_went_unanswered_later_calls_try_once_when_told_to_give_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What a command does (kcache_client._command_settings): its user is waiting."""
    url = f"http://127.0.0.1:{free_port()}"
    transport = Transport(url, retry=FAST, on_retry=announce_retry, give_up_after_outage=True)
    with pytest.raises(ServerUnavailableError):
        transport.request("GET", "/v1/toolchains")
    assert transport.requests == FAST.attempts and transport.gave_up
    assert capsys.readouterr().err.splitlines() == [
        f"kcache: waiting for the server at {url} (try {n} of {FAST.attempts})"
        for n in range(2, FAST.attempts + 1)
    ]
    with pytest.raises(ServerUnavailableError) as again:
        transport.request("GET", "/v1/recipes/k/artifact")
    assert transport.requests == FAST.attempts + 1  # one try, no wait
    assert "ConnectError" in again.value.cause and capsys.readouterr().err == ""
    with pytest.raises(ServerUnavailableError):  # a call with its own policy keeps it
        transport.request("POST", "/v1/events", json={}, retry=FAST)
    assert transport.requests == 2 * FAST.attempts + 1 and capsys.readouterr().err == ""
    # Without being told to, a transport retries each call in full, however the last one ended.
    patient = Transport(url, retry=FAST)
    for _ in range(2):
        with pytest.raises(ServerUnavailableError):
            patient.request("GET", "/v1/toolchains")
    assert patient.requests == 2 * FAST.attempts and not patient.gave_up


def test_a_stream_is_one_request_its_errors_mapped_as_a_requests_are() -> None:
    def route(seen: Seen) -> tuple[int, dict[str, str], bytes]:
        if seen.path == "/v1/bundle":
            return 200, {"Content-Type": "application/octet-stream"}, b"x" * 100_000
        return json_response(404, {"error": "not_found", "detail": "no such job"})

    server = Scripted(route)
    try:
        transport = Transport(server.url, "s3cret", retry=FAST)
        with transport.stream("POST", "/v1/bundle", json={"recipe_keys": []}) as chunks:
            assert b"".join(chunks) == b"x" * 100_000
        (seen,) = server.seen
        assert seen.json() == {"recipe_keys": []}
        assert seen.headers.get("authorization") == "Bearer s3cret"
        with (
            pytest.raises(RemoteNotFoundError) as missing,
            transport.stream("POST", "/v1/gone", json={}),
        ):
            pass
        assert (
            missing.value.url == f"{server.url}/v1/gone" and missing.value.detail == "no such job"
        )
        assert transport.requests == server.count() == 2  # counted, not retried
    finally:
        server.close()
    url = f"http://127.0.0.1:{free_port()}"
    refused = Transport(url, retry=FAST)
    with pytest.raises(ServerUnavailableError) as info, refused.stream("POST", "/v1/bundle"):
        pass
    assert info.value.url == url and info.value.cause.startswith("ConnectError")
    assert refused.requests == 1


def test_retry_after_parses_seconds_and_http_dates() -> None:
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25.0 <= (parse_retry_after(date) or 0.0) <= 31.0


def test_events_are_batched_in_the_background_and_flushed_on_close() -> None:
    release = threading.Event()
    answered: list[int] = []

    def route(seen: Seen) -> tuple[int, dict[str, str], bytes]:
        release.wait(30)  # a slow server must not slow the recording side
        answered.append(len(seen.json()["events"]))
        return json_response(202, {"accepted": len(seen.json()["events"])})

    server = Scripted(route)
    try:
        sink = EventSink(Transport(server.url, retry=FAST), batch_size=100, interval_s=0.05)
        for i in range(250):
            sink.record({"outcome": "local_hit", "i": i})
        # Recording never waited on the slow server: it held every post it got meanwhile
        # (one that waited would have waited until the server's 30 s ran out).
        assert answered == []
        release.set()
        sink.close(timeout=10)
        posted = [e["i"] for s in server.seen for e in s.json()["events"]]
        assert sorted(posted) == list(range(250))  # nothing lost, nothing sent twice
        assert all(len(s.json()["events"]) <= 100 for s in server.seen)
        assert sink.sent == 250 and sink.pending() == 0
    finally:
        release.set()
        server.close()


def test_events_survive_a_server_outage_and_go_out_with_the_next_batch() -> None:
    up = threading.Event()
    accepted: list[int] = []

    def route(seen: Seen) -> tuple[int, dict[str, str], bytes]:
        if not up.is_set():
            return json_response(503, {"error": "down"}, **{"Retry-After": "0"})
        accepted.extend(e["i"] for e in seen.json()["events"])
        return json_response(202, {})

    server = Scripted(route)
    try:
        sink = EventSink(Transport(server.url, retry=FAST), batch_size=10, interval_s=0.05)
        for i in range(5):
            sink.record({"i": i})
        assert not sink.flush(timeout=1)  # refused: kept, not dropped
        assert sink.pending() == 5 and sink.dropped == 0
        up.set()
        sink.close()
        assert accepted == [0, 1, 2, 3, 4]  # in order, once each
    finally:
        server.close()


def test_identical_hits_are_tallied_into_one_event_per_batch() -> None:
    posted: list[dict[str, object]] = []

    def route(seen: Seen) -> tuple[int, dict[str, str], bytes]:
        posted.extend(seen.json()["events"])
        return json_response(202, {})

    server = Scripted(route)
    try:
        sink = EventSink(Transport(server.url, retry=FAST), batch_size=100, interval_s=60)
        hit = {"outcome": "local_hit", "tier": "memory", "recipe_key": "a" * 64, "digest": "b" * 64}
        for i in range(1000):
            sink.record({**hit, "time": 1000.0 + i, "latency_ms": 0.002 if i % 2 else 0.004})
        sink.record({**hit, "tier": "node", "time": 3000.0, "latency_ms": 0.05})
        assert sink.pending() == 1001  # lookups, not rows
        sink.close(timeout=10)
        assert [(e["tier"], e["count"]) for e in posted] == [("memory", 1000), ("node", 1)]
        assert posted[0]["time"] == 1999.0 and abs(posted[0]["latency_ms"] - 0.003) < 1e-9  # type: ignore[operator]
        assert sink.sent == 1001 and sink.pending() == 0
    finally:
        server.close()
