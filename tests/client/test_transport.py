"""The transport's policy (retries, Retry-After, deadlines, error mapping), on a wire of the
tests' own, and audit-event batching, against real scripted HTTP servers.

:class:`MockWire` stands for the bytes on the network, as httpx's tests stand a mock
transport under a client: each try it is handed is answered by the test (a status,
headers and body, or an exception a real wire raises), and it records what the
transport asked of it (the path, the body, the deadline and the body limit of each try).
What the real wires do with sockets is tested on them (``test_lean_http.py``,
``test_hostile_answers.py``, ``test_hostile_bundles.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple

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
    ServerResponseError,
    ServerUnavailableError,
)
from kcache_client._command_settings import announce_retry
from kcache_client._http import (
    MAX_JSON_BYTES,
    OFFLINE_CAUSE,
    Limit,
    RetryNotice,
    Transport,
    parse_retry_after,
)
from kcache_client._lean_answer import (
    AnswerRefused,
    BodyLimit,
    DeadlineExceeded,
    LeanHeaders,
    LeanResponse,
)
from kcache_client._lean_errors import ConnectError, ReadTimeout
from kcache_client.errors import ResponseRefusedError

from kcache.errors import ArtifactNotFoundError, CompileError, KCacheError
from tests.support import FAST

URL = "http://kcache.test:8000"
#: What a test answers a try with: a status, headers and body, or an exception to raise.
Answer = tuple[int, dict[str, str], bytes] | BaseException


class Try(NamedTuple):
    """One try as the transport handed it to the wire."""

    method: str
    path: str
    json: Any
    timeout: float | None
    until: float
    limit: BodyLimit
    #: ``time.monotonic()`` when the wire got it.
    at: float


class _Streamed:
    def __init__(
        self, status: int, headers: Mapping[str, str], pieces: list[bytes | BaseException]
    ):
        self.status_code = status
        self.headers = LeanHeaders(list(headers.items()))
        self._pieces = pieces

    def iter_bytes(self, chunk_size: int | None = None) -> Iterator[bytes]:
        for piece in self._pieces:
            if isinstance(piece, BaseException):
                raise piece
            yield piece


class MockWire:
    """A :class:`~kcache_client._wire.Wire` whose every try is answered by ``answer(try)``.

    A body longer than the limit the transport decided for it is refused as the real
    wires refuse it (AnswerRefused). A streamed answer's body is ``pieces``: bytes, or an
    exception raised when the caller reaches it.
    """

    def __init__(
        self, answer: Callable[[Try], Answer], pieces: list[bytes | BaseException] | None = None
    ):
        self.answer = answer
        self.pieces = pieces or []
        self.tries: list[Try] = []
        self.closed = False

    def _try(
        self,
        method: str,
        path: str,
        json: Any,
        timeout: float | None,
        until: float,
        limit: BodyLimit,
    ) -> Answer:
        sent = Try(method, path, json, timeout, until, limit, time.monotonic())
        self.tries.append(sent)
        outcome = self.answer(sent)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def send(
        self,
        method: str,
        path: str,
        json: Any,
        timeout: float | None,
        until: float,
        limit: BodyLimit,
    ) -> LeanResponse:
        status, headers, body = self._try(method, path, json, timeout, until, limit)  # type: ignore[misc]
        reply_headers = LeanHeaders(list(headers.items()))
        bound = limit(status, reply_headers)
        if len(body) > bound.bytes:
            raise AnswerRefused(
                f"its body is longer than the {bound.bytes} bytes {bound.why}", status
            )
        return LeanResponse(status, reply_headers, body, URL + path)

    @contextmanager
    def stream(self, method: str, path: str, json: Any, until: float) -> Iterator[_Streamed]:
        status, headers, body = self._try(method, path, json, None, until, _no_limit)  # type: ignore[misc]
        yield _Streamed(status, headers, [body] if body else self.pieces)

    def close(self) -> None:
        self.closed = True


def _no_limit(status: int, headers: Mapping[str, str]) -> Limit:
    return Limit(1 << 62, "")


def on_mock(
    answers: Callable[[Try], Answer] | list[Answer], **kwargs: Any
) -> tuple[Transport, MockWire]:
    """A transport to :data:`URL` over a :class:`MockWire` answering from ``answers``
    (a function of the try, or a list: one per try, the last repeated)."""
    if isinstance(answers, list):
        queue = list(answers)

        def answer(sent: Try) -> Answer:
            return queue.pop(0) if len(queue) > 1 else queue[0]

        wire = MockWire(answer)
    else:
        wire = MockWire(answers)
    kwargs.setdefault("retry", FAST)
    return Transport(URL, wire=wire, **kwargs), wire


REFUSED = ConnectError("[Errno 111] Connection refused")
OK = json_response(200, {"ok": True})


# ------------------------------------------------------------------------------ retries
def test_503_with_retry_after_is_waited_out_then_succeeds() -> None:
    transport, wire = on_mock([json_response(503, {"error": "busy"}, **{"Retry-After": "1"}), OK])
    started = time.monotonic()
    assert transport.request("GET", "/v1/toolchains").json() == {"ok": True}
    # Retry-After: 1 was honoured (the jittered backoff alone would be < 0.05 s).
    assert time.monotonic() - started >= 0.95
    assert len(wire.tries) == transport.requests == 2


def test_429_forever_gives_a_busy_error_after_bounded_attempts() -> None:
    transport, wire = on_mock([json_response(429, {"error": "slow_down"}, **{"Retry-After": "0"})])
    with pytest.raises(ServerBusyError) as info:
        transport.request("POST", "/v1/resolve", json={})
    assert len(wire.tries) == FAST.attempts and [t.json for t in wire.tries] == [{}] * FAST.attempts
    assert info.value.status == 429
    assert URL in str(info.value)
    assert isinstance(info.value, ServerUnavailableError)  # callers fall back the same way


def test_retry_budget_bounds_a_long_retry_after() -> None:
    policy = RetryPolicy(attempts=5, budget_s=1.0, max_retry_after_s=30.0)
    transport, wire = on_mock(
        [json_response(503, {"error": "busy"}, **{"Retry-After": "3600"})], retry=policy
    )
    started = time.monotonic()
    with pytest.raises(ServerBusyError):
        transport.request("GET", "/x")
    assert time.monotonic() - started < 10.0  # did not sleep an hour, nor 30 s
    assert len(wire.tries) == 1


def test_a_transport_failure_is_retried_then_server_unavailable_naming_the_url_and_cause() -> None:
    transport, wire = on_mock([REFUSED])
    with pytest.raises(ServerUnavailableError) as info:
        transport.request("GET", "/v1/toolchains")
    assert URL in str(info.value) and info.value.url == URL
    assert info.value.cause == "ConnectError: [Errno 111] Connection refused"
    assert isinstance(info.value, ConnectionError) and isinstance(info.value, KCacheError)
    assert len(wire.tries) == transport.requests == FAST.attempts
    # Recovered on a later try: the answer, as if nothing had happened.
    transport, wire = on_mock([REFUSED, ReadTimeout("timed out"), OK])
    assert transport.request("GET", "/v1/toolchains").json() == {"ok": True}
    assert len(wire.tries) == 3


def test_each_try_has_its_deadline_and_a_missed_one_is_retried_as_a_failure() -> None:
    policy = RetryPolicy(
        attempts=3, base_s=0.01, cap_s=0.02, deadline_s=7.0, compile_deadline_s=70.0, budget_s=30.0
    )
    transport, wire = on_mock([DeadlineExceeded()], retry=policy)
    with pytest.raises(ServerUnavailableError) as info:
        transport.request("GET", "/v1/recipes/k/artifact", timeout=2.5)
    cause = info.value.cause
    assert cause == "DeadlineExceeded: no whole answer within 7s (connect, headers and body)"
    assert len(wire.tries) == 3 and all(t.timeout == 2.5 for t in wire.tries)
    assert all(6.5 < t.until - t.at <= 7.0 for t in wire.tries)
    # A budget shorter than a try: the call ends by the first try's deadline, and so does
    # every later try.
    short = RetryPolicy(attempts=3, base_s=0.01, cap_s=0.02, deadline_s=7.0, budget_s=3.0)
    transport, wire = on_mock([DeadlineExceeded()], retry=short)
    with pytest.raises(ServerUnavailableError):
        transport.request("GET", "/v1/recipes/k/artifact")
    first = wire.tries[0]
    assert len(wire.tries) == 3 and 6.5 < first.until - first.at <= 7.0
    assert all(t.until <= first.until + 0.05 for t in wire.tries[1:])
    # A request that may wait for a compile has the compile deadline, but never past the
    # call's bound (the budget, or one try's deadline when that is longer).
    transport, wire = on_mock([OK], retry=policy)
    transport.request("POST", "/v1/resolve", json={}, compiles=True)
    (sent,) = wire.tries
    assert 69.5 < sent.until - sent.at <= 70.0 and sent.timeout is None


def test_the_body_limit_is_the_callers_for_an_expected_status_and_json_s_for_the_rest() -> None:
    """What the wire is told (it refuses a body past it): ``expect`` for an answer in ``ok``,
    decided from its headers when a function; :data:`MAX_JSON_BYTES` for any other."""
    transport, wire = on_mock([(206, {"X-Size": "12"}, b"x" * 12)])
    transport.request(
        "GET",
        "/v1/blobs/d",
        ok=(200, 206),
        expect=lambda headers: Limit(int(headers["x-size"]), "its size"),
    )
    (sent,) = wire.tries
    assert sent.limit(206, {"x-size": "12"}) == Limit(12, "its size")
    assert sent.limit(404, {}).bytes == sent.limit(503, {}).bytes == MAX_JSON_BYTES
    # Refused (not retried): the same server would answer the same.
    transport, wire = on_mock([(200, {}, b"x" * 11)])
    with pytest.raises(ResponseRefusedError) as info:
        transport.request("GET", "/v1/blobs/d", expect=Limit(10, "the resolve promised"))
    assert str(info.value) == (
        f"answer from {URL}/v1/blobs/d refused: HTTP 200: its body is longer than the 10 bytes "
        "the resolve promised"
    )
    assert info.value.status == 200 and len(wire.tries) == 1
    transport, wire = on_mock([AnswerRefused("its status line or headers are too long")])
    with pytest.raises(
        ResponseRefusedError, match="refused: its status line or headers are too long"
    ):
        transport.request("GET", "/v1/toolchains")
    assert len(wire.tries) == 1


# ------------------------------------------------------------------------------ statuses
def test_error_statuses_map_to_typed_errors_once_without_retries() -> None:
    answers: dict[str, Answer] = {
        "/unauthorized": json_response(401, {"error": "unauthorized", "detail": ""}),
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
        "/broken": (500, {"Content-Type": "text/plain"}, b"it broke"),
        "/moved": (302, {"Location": "http://elsewhere.test/collect"}, b"moved"),
    }
    transport, wire = on_mock(lambda sent: answers[sent.path])
    with pytest.raises(AuthenticationError) as auth:
        transport.request("GET", "/unauthorized")
    assert auth.value.status == 401 and isinstance(auth.value, PermissionError)
    assert "set KCACHE_TOKEN to a valid token" in str(auth.value)
    with pytest.raises(RemoteCompileError) as comp:
        transport.request("POST", "/compile")
    assert isinstance(comp.value, CompileError)
    assert comp.value.log == "kernel.cu(1): error: x" and comp.value.recipe_key == "k"
    with pytest.raises(RequestRejectedError) as bad:
        transport.request("POST", "/bad")
    assert bad.value.detail == "flags[0]: -I is not allowed" and isinstance(bad.value, ValueError)
    with pytest.raises(RemoteNotFoundError) as missing:
        transport.request("GET", "/missing")
    assert (
        isinstance(missing.value, ArtifactNotFoundError) and missing.value.url == f"{URL}/missing"
    )
    with pytest.raises(ServerResponseError) as broken:
        transport.request("GET", "/broken")
    assert broken.value.status == 500 and broken.value.detail == "it broke"
    with pytest.raises(ResponseRefusedError) as moved:
        transport.request("GET", "/moved")
    assert str(moved.value).startswith(
        f"answer from {URL}/moved refused: HTTP 302 redirect to http://elsewhere.test/collect, not followed"
    )
    assert len(wire.tries) == transport.requests == 6  # errors other than 429/5xx-busy: one try


def test_request_json_refuses_an_answer_that_is_not_json() -> None:
    transport, _ = on_mock([(200, {"Content-Type": "text/html"}, b"<html>a portal</html>")])
    with pytest.raises(ResponseRefusedError, match="HTTP 200 with a body that is not JSON"):
        transport.request_json("GET", "/v1/toolchains")


def test_an_offline_transport_sends_nothing_and_close_closes_its_wire() -> None:
    transport, wire = on_mock([OK], offline=True)
    with pytest.raises(ServerUnavailableError) as info:
        transport.request("GET", "/v1/toolchains")
    assert info.value.cause == OFFLINE_CAUSE
    with pytest.raises(ServerUnavailableError), transport.stream("POST", "/v1/bundle"):
        pass
    assert wire.tries == [] and transport.requests == 0
    transport.close()
    assert wire.closed


# ------------------------------------------------------------------------------ the retry hook
def test_on_retry_is_told_before_each_wait_of_the_transports_own_policy_only() -> None:
    notices: list[RetryNotice] = []
    transport, _ = on_mock(
        [
            json_response(503, {"error": "busy"}, **{"Retry-After": "0"}),
            json_response(502, {"error": "bad_gateway"}),
            REFUSED,
            OK,
        ],
        on_retry=notices.append,
        retry=RetryPolicy(attempts=4, base_s=0.01, cap_s=0.05, budget_s=3.0),
    )
    assert transport.request("GET", "/v1/toolchains").json() == {"ok": True}
    assert [(n.url, n.method, n.path, n.next_try, n.attempts, n.cause) for n in notices] == [
        (URL, "GET", "/v1/toolchains", 2, 4, "HTTP 503"),
        (URL, "GET", "/v1/toolchains", 3, 4, "HTTP 502"),
        (URL, "GET", "/v1/toolchains", 4, 4, "ConnectError: [Errno 111] Connection refused"),
    ]
    assert notices[0].wait_s == 0.0  # the server's Retry-After
    assert 0.0 <= notices[1].wait_s <= 0.05  # a backoff
    # A call with a policy of its own (the audit events) is retried by it alone, untold.
    busy, wire = on_mock(
        [json_response(503, {"error": "busy"}, **{"Retry-After": "0"})], on_retry=notices.append
    )
    with pytest.raises(ServerBusyError):
        busy.request("POST", "/v1/events", json={}, retry=FAST)
    assert len(wire.tries) == FAST.attempts and len(notices) == 3


def test_a_retry_the_budget_forbids_is_not_announced() -> None:
    notices: list[RetryNotice] = []
    transport, wire = on_mock(
        [json_response(503, {"error": "busy"}, **{"Retry-After": "3600"})],
        retry=RetryPolicy(attempts=5, budget_s=1.0),
        on_retry=notices.append,
    )
    with pytest.raises(ServerBusyError):
        transport.request("GET", "/x")
    assert len(wire.tries) == 1 and notices == []


def test_after_one_call_went_unanswered_later_calls_try_once_when_told_to_give_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What a command does (kcache_client._command_settings): its user is waiting."""
    transport, _ = on_mock([REFUSED], on_retry=announce_retry, give_up_after_outage=True)
    with pytest.raises(ServerUnavailableError):
        transport.request("GET", "/v1/toolchains")
    assert transport.requests == FAST.attempts and transport.gave_up
    assert capsys.readouterr().err.splitlines() == [
        f"kcache: waiting for the server at {URL} (try {n} of {FAST.attempts})"
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
    patient, _ = on_mock([REFUSED])
    for _ in range(2):
        with pytest.raises(ServerUnavailableError):
            patient.request("GET", "/v1/toolchains")
    assert patient.requests == 2 * FAST.attempts and not patient.gave_up


# ------------------------------------------------------------------------------ streams
def test_a_stream_is_one_request_its_errors_mapped_as_a_requests_are() -> None:
    policy = RetryPolicy(attempts=3, base_s=0.01, cap_s=0.02, deadline_s=4.0, budget_s=1.0)
    answers: dict[str, Answer] = {
        "/v1/bundle": (200, {"Content-Type": "application/octet-stream"}, b""),
        "/v1/gone": json_response(404, {"error": "not_found", "detail": "no such job"}),
        "/v1/huge-error": (500, {}, b"e" * (MAX_JSON_BYTES + 100)),
        "/v1/refused": REFUSED,
    }
    transport, wire = on_mock(lambda sent: answers[sent.path], retry=policy)
    wire.pieces = [b"x" * 10, b"y" * 10]
    with transport.stream("POST", "/v1/bundle", json={"recipe_keys": []}) as chunks:
        assert b"".join(chunks) == b"x" * 10 + b"y" * 10
    (sent,) = wire.tries
    assert sent.json == {"recipe_keys": []}
    assert 3.5 < sent.until - sent.at <= 4.0  # one try's deadline, however short the budget
    with (
        pytest.raises(RemoteNotFoundError) as missing,
        transport.stream("POST", "/v1/gone", json={}),
    ):
        pass
    assert missing.value.url == f"{URL}/v1/gone" and missing.value.detail == "no such job"
    with pytest.raises(ServerResponseError) as huge, transport.stream("GET", "/v1/huge-error"):
        pass
    assert huge.value.status == 500  # its body read no further than a JSON answer's cap
    with pytest.raises(ServerUnavailableError) as info, transport.stream("POST", "/v1/refused"):
        pass
    assert info.value.url == URL and info.value.cause.startswith("ConnectError")
    assert transport.requests == len(wire.tries) == 4  # counted, not retried
    # A failure while the body is read is raised by the iteration, mapped the same way.
    wire.pieces = [b"x" * 10, DeadlineExceeded()]
    with (
        pytest.raises(ServerUnavailableError) as late,
        transport.stream("POST", "/v1/bundle") as chunks,
    ):
        assert next(chunks) == b"x" * 10
        next(chunks)
    assert late.value.cause.startswith("DeadlineExceeded: no whole answer within 4s")


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
