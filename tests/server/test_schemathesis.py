"""Schema-driven fuzzing: the server against its own ``/openapi.json``, with every schemathesis check.

Schemathesis (property-based testing from the published schema) sends requests the
schema allows and requests it forbids to one real server (uvicorn, NVRTC, SQLite,
tokens), and checks every answer: no 500; every status, content type, header and
body as documented; every schema-valid request accepted and every schema-violating
one refused; 401 without a token, 405 with a correct ``Allow`` for undocumented
methods. A failure means the server and its contract disagree: fix the server or
the schema, never the check.

Runs: a fixed seed in deterministic mode (the same requests every time), a random
seed (new requests every run, the seed in any failure message; ``pytest --slow``), both
with an admin token, and a read-scope token run (403s documented and returned).

What the test changes in the generated requests, and why (``_adapt``):

- ``compile`` is false in resolves: a random recipe the schema allows is valid CUDA
  only by accident, so compiling it is a correct 422 compile error the positive check
  would count as a rejection, and hundreds of NVRTC runs would take minutes. The
  compile path is covered by ``test_openapi_contract.py`` and ``test_api.py``.
- Schema-valid specializations whose keys render to one macro, or whose macros are
  over the size limit, are dropped from the recipe: JSON Schema cannot state either
  (the field's description says it).
- A schema-valid batch of client events whose counts add up to more than one token may
  report a minute (``audit.max_reported_per_minute``) loses events from its end until it
  fits: JSON Schema cannot bound a sum (the batch's description states it), and such a
  batch is a correct 422. What the token reported already this minute may still make a
  batch a 429, which the schema documents.
- A schema-valid upload of a foreign file (``PUT /v1/blobs/{digest}``) gets the digest of
  its bytes in its path: that they must hash to it is for the description to say.
- A schema-valid ``GET /v1/stats`` whose ``until`` is before its ``since`` loses its
  ``until``: JSON Schema cannot relate two parameters, and such a window is a correct 422
  (``until``'s description says it ends after ``since``).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kcache_server.auditing.query_times import parse_window
from kcache_server.errors import InvalidRequestError

from kcache.errors import RecipeError
from kcache.specialization import normalize_specialization
from tests.support import ServerThread

# Every test here is schemathesis': without it (the GPU image has none) the module is
# skipped at collection instead of stopping the collection of the whole tree.
pytest.importorskip("schemathesis", reason="schema fuzzing needs schemathesis")

import schemathesis  # (these after the skip above)
import schemathesis.specs.openapi.checks
from schemathesis import engine
from schemathesis.checks import CHECKS
from schemathesis.engine import events

#: Examples per operation in the fuzzing phase (the coverage phase adds its own).
EXAMPLES = 25
FIXED_SEED = 20_240_520
#: The operations that compile on a miss unless told not to.
_RESOLVES = ("POST /v1/resolve", "POST /v1/resolve/batch")


@dataclass
class Fuzzed:
    """The server under test and its tokens by scope."""

    server: ServerThread
    tokens: dict[str, str]


@dataclass
class Outcome:
    """What one schemathesis run found."""

    failures: list[str]
    statuses: dict[tuple[str, int], int]  # (operation, status) -> responses

    def count(self, status: int) -> int:
        """Responses with ``status``, over every operation."""
        return sum(n for (_, s), n in self.statuses.items() if s == status)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    """One real server with an admin and a read token (stopped after the module)."""
    from kcache_server import Settings

    data = tmp_path_factory.mktemp("schemathesis") / "data"
    server = ServerThread(Settings(data_dir=data, compile_workers=1, audit={"flush_s": 0.05}))
    try:
        tokens = {
            scope: server.state.tokens.create(f"fuzz-{scope}", [scope])
            for scope in ("admin", "read")
        }
        yield Fuzzed(server, tokens)
    finally:
        server.stop()


def _drop_colliding_specializations(recipe: Any) -> None:
    """Drop a specialization whose macros collide or are too large, in ``recipe`` and its linked recipes."""
    if not isinstance(recipe, dict):
        return
    spec = recipe.get("specialization")
    if isinstance(spec, dict):
        try:
            normalize_specialization(spec)
        except RecipeError as exc:
            if exc.field == "specialization" and (
                "same macro" in exc.detail or "renders to" in exc.detail
            ):
                del recipe["specialization"]
    for item in recipe.get("link") or []:
        if isinstance(item, dict):
            _drop_colliding_specializations(item.get("recipe"))


def _fit_reported_bound(body: dict[str, Any], bound: int) -> None:
    """Drop events from the end of a batch until its counts add up to at most ``bound``."""
    events = body.get("events")
    if not isinstance(events, list):
        return
    counts = [e.get("count", 1) if isinstance(e, dict) else 1 for e in events]
    while events and sum(c for c in counts if isinstance(c, int)) > bound:
        events.pop()
        counts.pop()


def _drop_backward_until(case: Any) -> None:
    """Drop a stats query's ``until`` that comes before its ``since`` (a refused window)."""
    query = dict(case.query or {})
    try:
        parse_window(query.get("since"), query.get("until"), ("query.since", "query.until"))
    except InvalidRequestError as exc:
        if exc.field == "query.until" and "is before" in exc.detail:
            del query["until"]
            case.query = query
    except Exception:  # a time that is no time: the server says so, as the schema does
        pass


def _adapt(reported_bound: int) -> Any:
    """The ``map_case`` hook: the changes the module docstring lists.

    Event times are left as generated: a time far ahead of the server's clock is
    accepted (recorded at its arrival, as the field's description says), so a
    schema-valid batch is never refused for it.
    """

    def adapt(_: Any, case: Any) -> Any:
        label, body = case.operation.label, case.body
        positive = case.meta is not None and case.meta.generation.mode.is_positive
        data = getattr(body, "data", body)  # schemathesis wraps bytes (its Binary)
        if positive and label == "PUT /v1/blobs/{digest}" and isinstance(data, bytes | bytearray):
            # The bytes must hash to the path's digest, which no schema can say.
            case.path_parameters = {
                **(case.path_parameters or {}),
                "digest": hashlib.sha256(data).hexdigest(),
            }
        if positive and label == "GET /v1/stats":
            _drop_backward_until(case)
        if not isinstance(body, dict):
            return case
        if label in _RESOLVES and body.get("compile", True) is True:
            body["compile"] = False  # a negative case's wrong "compile" is not True: kept
        if positive and label in ("POST /v1/resolve", "POST /v1/explain"):
            _drop_colliding_specializations(body.get("recipe"))
        if positive and label == "POST /v1/events":
            _fit_reported_bound(body, reported_bound)
        return case

    return adapt


def _describe(label: str, check: str, failure: Any, interaction: Any) -> str:
    request = interaction.request if interaction is not None else None
    response = interaction.response if interaction is not None else None
    body = (request.body or b"")[:300] if request is not None else b""
    return (
        f"{label}: {check}: {getattr(failure, 'title', failure)}\n"
        f"  {str(getattr(failure, 'message', ''))[:300]}\n"
        f"  {request.method if request else ''} {request.uri[:300] if request else ''} {body!r}\n"
        f"  -> {response.status_code if response else 'no response'}: "
        f"{(response.content or b'')[:300] if response else b''!r}"
    )


#: Every phase. Coverage (boundary values, every negation, undocumented methods) does
#: not depend on the seed and costs most of a run: the fixed-seed run alone takes it.
ALL_PHASES = ("examples", "coverage", "fuzzing", "stateful")


def run_schemathesis(
    fuzzed: Fuzzed,
    token: str,
    *,
    seed: int,
    deterministic: bool,
    examples: int = EXAMPLES,
    phases: tuple[str, ...] = ALL_PHASES,
) -> Outcome:
    """Every check, in ``phases``, against ``fuzzed``'s server; what failed and what was answered."""
    config = schemathesis.Config.from_dict(
        {
            "seed": seed,
            "headers": {"Authorization": f"Bearer {token}"},
            "workers": 1,  # hypothesis' lambda descriptions are not thread-safe in this version
            "generation": {
                "max-examples": examples,
                "deterministic": deterministic,
                "database": "none",
            },
            "checks": {name: {"enabled": True} for name in CHECKS.get_all_names()},
            "phases": {phase: {"enabled": phase in phases} for phase in ALL_PHASES},
        }
    )
    schema = schemathesis.openapi.from_url(f"{fuzzed.server.url}/openapi.json", config=config)
    schema.hook("map_case")(_adapt(fuzzed.server.settings.audit.max_reported_per_minute))
    failures: list[str] = []
    statuses: dict[tuple[str, int], int] = {}
    for event in engine.from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            recorder = event.recorder
            for interaction in recorder.interactions.values():
                if interaction.response is not None:
                    key = (recorder.label, interaction.response.status_code)
                    statuses[key] = statuses.get(key, 0) + 1
            for case_id, nodes in recorder.checks.items():
                for node in nodes:
                    if node.failure_info is not None:
                        failures.append(
                            _describe(
                                recorder.label,
                                node.name,
                                node.failure_info.failure,
                                recorder.interactions.get(case_id),
                            )
                        )
        elif isinstance(event, events.NonFatalError | events.FatalError):
            failures.append(
                f"schemathesis error: {event.info if hasattr(event, 'info') else event}"
            )
    return Outcome(sorted(set(failures)), statuses)


def _assert_clean(outcome: Outcome, seed: int) -> None:
    assert not outcome.failures, (
        f"{len(outcome.failures)} disagreements between the server and /openapi.json "
        f"(seed {seed}):\n" + "\n".join(outcome.failures[:20])
    )


def test_admin_token_fixed_seed(fuzzed: Fuzzed) -> None:
    outcome = run_schemathesis(fuzzed, fuzzed.tokens["admin"], seed=FIXED_SEED, deterministic=True)
    _assert_clean(outcome, FIXED_SEED)
    # The run reached the routes' logic, not only their doors: accepted requests of
    # every kind of body, refusals of each kind, and 401 without the token.
    for operation in (
        "POST /v1/events",
        "POST /v1/pins",
        "POST /v1/resolve/batch",
        "GET /v1/stats",
    ):
        assert outcome.statuses.get((operation, 200), 0) > 0, operation
    assert outcome.statuses.get(("POST /v1/resolve", 404), 0) > 0  # schema-valid recipes, misses
    for status in (400, 401, 405, 422):
        assert outcome.count(status) > 0, status


def _fuzz_clean(fuzzed: Fuzzed, seed: int) -> None:
    """The fuzzing phase with an admin token and ``seed``: no disagreement."""
    outcome = run_schemathesis(
        fuzzed, fuzzed.tokens["admin"], seed=seed, deterministic=False, phases=("fuzzing",)
    )
    _assert_clean(outcome, seed)


@pytest.mark.slow
def test_admin_token_random_seed(fuzzed: Fuzzed) -> None:
    """New requests every run: a --slow run's (the fixed seed and the known seeds run always)."""
    _fuzz_clean(fuzzed, random.randrange(2**31))


#: Random seeds that once found a disagreement, run again every time (what each found).
KNOWN_SEEDS = (
    # DELETE /v1/pins with two recipe_key values: the schema's null branch of the optional
    # query parameter let a mutation count as schema-violating that the server rightly took.
    1_939_861_150,
)


@pytest.mark.parametrize("seed", KNOWN_SEEDS)
def test_admin_token_known_seeds(fuzzed: Fuzzed, seed: int) -> None:
    _fuzz_clean(fuzzed, seed)


def test_read_token_gets_documented_403s(fuzzed: Fuzzed) -> None:
    """A read token is refused what needs more (pins, the store, events), with the documented 403."""
    outcome = run_schemathesis(
        fuzzed,
        fuzzed.tokens["read"],
        seed=FIXED_SEED,
        deterministic=True,
        examples=5,
        phases=("examples", "fuzzing"),
    )
    _assert_clean(outcome, FIXED_SEED)
    for operation in ("GET /v1/pins", "POST /v1/events", "GET /v1/cache"):
        assert outcome.statuses.get((operation, 403), 0) > 0, operation
    assert outcome.statuses.get(("GET /v1/toolchains", 200), 0) > 0
