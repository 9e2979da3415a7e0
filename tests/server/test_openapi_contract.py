"""Real responses of every JSON route validate against the schema the server publishes.

One real server (uvicorn, NVRTC, SQLite) answers a sample of requests per route;
each JSON body is validated with ``jsonschema`` against the response schema that
``/openapi.json`` declares for its route and status, with every object closed
(``additionalProperties: false`` where the schema lists properties), so a body
with a field the schema lacks fails as surely as one missing a required field.
Every operation that answers JSON must have a sample here that succeeds (2xx):
a new route without one fails :func:`test_every_json_route_has_a_sample`.
"""

from __future__ import annotations

import copy
import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import sqlalchemy as sa

if TYPE_CHECKING:
    from jsonschema import Draft202012Validator

from tests.support import ServerThread, unique, vector_add

_FOREIGN_BYTES = b"\x7fELF-ish"
_FOREIGN_DIGEST = hashlib.sha256(_FOREIGN_BYTES).hexdigest()
_FOREIGN_NS = {"version": "14.2.0", "target": "sm_90", "toolchain": "nvrtc-13.0"}
BROKEN = {"source": "__global__ void broken() { this is not cuda; }", "target": "sm_80"}


@dataclass
class Sample:
    """One request and the status it must get."""

    method: str
    route: str  # the OpenAPI path template
    url: str
    status: int
    json: Any = None
    params: dict[str, Any] = field(default_factory=dict)
    content: bytes | None = None  # a raw body instead of ``json``


@dataclass
class Contract:
    """The server, its published schema, and what its samples answered."""

    server: ServerThread
    openapi: dict[str, Any]
    answers: list[tuple[Sample, httpx.Response]]
    recipe_key: str
    digest: str


def _closed(node: Any) -> Any:
    """``node`` with ``additionalProperties: false`` on every object schema that lists its properties."""
    if isinstance(node, dict):
        out = {k: _closed(v) for k, v in node.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_closed(v) for v in node]
    return node


def _json_schema(
    openapi: dict[str, Any], route: str, method: str, status: int
) -> dict[str, Any] | None:
    """The declared JSON schema of a response (None when that response is not JSON)."""
    responses = openapi["paths"][route][method.lower()]["responses"]
    declared = responses.get(str(status))
    assert declared is not None, (
        f"{method} {route} answered {status}, which its OpenAPI entry does not declare"
    )
    content = declared.get("content", {})
    if "application/json" not in content:
        return None
    schema: dict[str, Any] = content["application/json"]["schema"]
    return schema


def _samples(recipe_key: str, digest: str, server: ServerThread) -> list[Sample]:
    recipe = vector_add(unique("contract"))
    missing = "0" * 64
    event = {
        "time": time.time(),
        "outcome": "local_hit",
        "tier": "node",
        "recipe_key": recipe_key,
        "digest": digest,
        "kernel": "vadd",
        "job_id": "contract-job",
        "rank": 0,
        "world_size": 1,
    }
    # A withdrawal (of a binding no recipe has), so the feed's sample lists a row.
    server.state.backends.index.withdraw_binding(missing, digest, "contract", base_key=missing)
    return [
        Sample("POST", "/v1/resolve", "/v1/resolve", 200, {"recipe": recipe}),  # compiled
        Sample("POST", "/v1/resolve", "/v1/resolve", 200, {"recipe": recipe}),  # a hit, from memory
        Sample(
            "POST",
            "/v1/resolve",
            "/v1/resolve",
            404,
            {"recipe": vector_add(unique()), "compile": False},
        ),
        Sample("POST", "/v1/resolve", "/v1/resolve", 422, {"recipe": BROKEN}),
        Sample("POST", "/v1/resolve", "/v1/resolve", 422, {"recipe": {"source": 3}}),
        Sample("POST", "/v1/resolve", "/v1/resolve", 400, content=b'{"recipe": '),
        Sample(
            "POST",
            "/v1/resolve/batch",
            "/v1/resolve/batch",
            200,
            {
                "recipes": [recipe, BROKEN, {"target": "sm_80"}],
                "context": {"job_id": "contract-job"},
            },
        ),
        Sample("GET", "/v1/recipes/{recipe_key}", f"/v1/recipes/{recipe_key}", 200),
        Sample("GET", "/v1/keys", "/v1/keys", 200),
        Sample("GET", "/v1/recipes/{recipe_key}", f"/v1/recipes/{missing}", 404),
        Sample("GET", "/v1/recipes/{recipe_key}", "/v1/recipes/not-a-key", 400),
        Sample("GET", "/v1/recipes/{recipe_key}/artifact", f"/v1/recipes/{missing}/artifact", 404),
        Sample("POST", "/v1/explain", "/v1/explain", 200, {"recipe": vector_add(unique())}),
        Sample("POST", "/v1/explain", "/v1/explain", 422, {"recipe": {"source": 3}}),
        Sample("GET", "/v1/recipes/{recipe_key}/explain", f"/v1/recipes/{recipe_key}/explain", 200),
        Sample("GET", "/v1/recipes/{recipe_key}/explain", f"/v1/recipes/{missing}/explain", 404),
        Sample("GET", "/v1/recipes/{recipe_key}/recipe", f"/v1/recipes/{recipe_key}/recipe", 200),
        Sample("GET", "/v1/recipes/{recipe_key}/recipe", f"/v1/recipes/{missing}/recipe", 404),
        Sample("GET", "/v1/blobs/{digest}", f"/v1/blobs/{missing}", 404),
        Sample("GET", "/v1/toolchains", "/v1/toolchains", 200),
        Sample("GET", "/healthz", "/healthz", 200),
        Sample("GET", "/readyz", "/readyz", 200),
        Sample("POST", "/v1/events", "/v1/events", 200, {"events": [event]}),
        Sample("POST", "/v1/events", "/v1/events", 422, {"events": [{**event, "outcome": "hit"}]}),
        Sample("GET", "/v1/stats", "/v1/stats", 200, params={"since": "1h"}),
        Sample("GET", "/v1/jobs/{job_id}/manifest", "/v1/jobs/contract-job/manifest", 200),
        Sample("POST", "/v1/bundle", "/v1/bundle", 422, {"recipe_keys": []}),
        Sample(
            "GET",
            "/v1/stats",
            "/v1/stats",
            200,
            params={"group_by": "rank", "job_id": "contract-job"},
        ),
        Sample("GET", "/v1/stats", "/v1/stats", 422, params={"since": "yesterday-ish"}),
        # Foreign artifacts (an open loopback server grants publish): a file, its group, lookups.
        Sample(
            "PUT",
            "/v1/blobs/{digest}",
            f"/v1/blobs/{_FOREIGN_DIGEST}",
            200,
            content=_FOREIGN_BYTES,
        ),
        Sample(
            "PUT",
            "/v1/foreign/{library}/{key}",
            "/v1/foreign/cupy/contract.cubin",
            200,
            {
                **_FOREIGN_NS,
                "files": [
                    {"name": "payload", "digest": _FOREIGN_DIGEST, "size": len(_FOREIGN_BYTES)}
                ],
            },
        ),
        Sample(
            "PUT",
            "/v1/foreign/{library}/{key}",
            "/v1/foreign/cupy/contract2.cubin",
            404,
            {**_FOREIGN_NS, "files": [{"name": "payload", "digest": missing, "size": 9}]},
        ),
        Sample(
            "GET",
            "/v1/foreign/{library}/{key}",
            "/v1/foreign/cupy/contract.cubin",
            200,
            params=_FOREIGN_NS,
        ),
        Sample(
            "GET",
            "/v1/foreign/{library}/{key}",
            "/v1/foreign/cupy/absent.cubin",
            404,
            params=_FOREIGN_NS,
        ),
        Sample(
            "DELETE",
            "/v1/foreign/{library}/{key}",
            "/v1/foreign/cupy/contract.cubin",
            200,
            params=_FOREIGN_NS,
        ),
        # Storage (admin; an open loopback server grants it): clearing comes last.
        Sample(
            "POST", "/v1/pins", "/v1/pins", 200, {"recipe_keys": [recipe_key], "group": "contract"}
        ),
        Sample("POST", "/v1/pins", "/v1/pins", 422, {"recipe_keys": []}),
        Sample("GET", "/v1/pins", "/v1/pins", 200),
        Sample("GET", "/v1/cache", "/v1/cache", 200),
        Sample("GET", "/v1/verification", "/v1/verification", 200),
        Sample("GET", "/v1/verification", "/v1/verification", 422, params={"days": "0"}),
        Sample("GET", "/v1/withdrawals", "/v1/withdrawals", 200, params={"after": "0"}),
        Sample("GET", "/v1/withdrawals", "/v1/withdrawals", 422, params={"limit": "0"}),
        Sample("GET", "/v1/cache/entries", "/v1/cache/entries", 200),
        Sample("POST", "/v1/cache/remove", "/v1/cache/remove", 200, {"keys": [missing]}),
        Sample("POST", "/v1/cache/remove", "/v1/cache/remove", 400, {"keys": ["not-a-key"]}),
        Sample("DELETE", "/v1/pins", "/v1/pins", 200, params={"group": "contract"}),
        Sample("POST", "/v1/cache/clear", "/v1/cache/clear", 200),
    ]


@pytest.fixture(scope="module")
def contract(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Contract]:
    """A real server and the answers to every sample (the server stops after the module)."""
    from kcache_server import Settings

    data = tmp_path_factory.mktemp("contract") / "data"
    server = ServerThread(Settings(data_dir=data, compile_workers=1, audit={"flush_s": 0.05}))
    try:
        with server.client() as http:
            seed = http.post("/v1/resolve", json={"recipe": vector_add(unique("seed"))}).json()
            samples = _samples(seed["recipe_key"], seed["artifact"]["digest"], server)
            answers = [
                (s, http.request(s.method, s.url, json=s.json, params=s.params, content=s.content))
                for s in samples
            ]
            openapi = http.get("/openapi.json").json()
        yield Contract(server, openapi, answers, seed["recipe_key"], seed["artifact"]["digest"])
    finally:
        server.stop()


def _validator(openapi: dict[str, Any], schema: dict[str, Any]) -> Draft202012Validator:
    # Imported here: a test run without jsonschema (the GPU image has none) still collects
    # this module, and only the tests that validate a body skip.
    jsonschema = pytest.importorskip("jsonschema", reason="validating bodies needs jsonschema")
    # References ("#/components/schemas/...") resolve against a root holding the components.
    root = {**_closed(schema), "components": _closed(copy.deepcopy(openapi["components"]))}
    validator: Draft202012Validator = jsonschema.Draft202012Validator(root)
    return validator


def test_every_sample_answers_its_status_and_validates(contract: Contract) -> None:
    for sample, response in contract.answers:
        where = f"{sample.method} {sample.url}"
        assert response.status_code == sample.status, (
            f"{where}: {response.status_code} {response.text[:300]}"
        )
        schema = _json_schema(contract.openapi, sample.route, sample.method, sample.status)
        if schema is None:
            continue
        assert response.headers["content-type"].startswith("application/json"), where
        errors = sorted(
            _validator(contract.openapi, schema).iter_errors(response.json()),
            key=lambda e: list(e.path),
        )
        assert not errors, f"{where}: " + "; ".join(
            f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors
        )


def test_the_samples_reach_every_branch_of_the_models(contract: Contract) -> None:
    """The bodies above are not trivially valid: each kind of result is among them (last sample per route)."""
    bodies = {(s.method, s.route): r.json() for s, r in contract.answers if s.status == 200}
    results = bodies[("POST", "/v1/resolve/batch")]["results"]
    assert (
        results[0]["status"] in ("hit", "compiled")
        and [r["status"] for r in results[1:]] == ["error"] * 2
    )
    assert results[1]["error"] == "compile_error" and results[1]["log"]
    assert results[2]["field"] and "log" not in results[2]  # only the fields its error carries
    assert [r.json()["status"] for s, r in contract.answers[:2]] == ["compiled", "hit"]
    assert bodies[("GET", "/v1/stats")]["groups"]
    assert [p["group"] for p in bodies[("GET", "/v1/pins")]["pins"]] == ["contract"]
    assert bodies[("GET", "/v1/cache/entries")]["entries"]


def test_every_json_route_has_a_sample(contract: Contract) -> None:
    sampled = {(s.route, s.method.lower()) for s, r in contract.answers if 200 <= s.status < 300}
    missing = []
    for route, operations in contract.openapi["paths"].items():
        for method, operation in operations.items():
            ok = {k: v for k, v in operation["responses"].items() if k.startswith("2")}
            answers_json = any("application/json" in v.get("content", {}) for v in ok.values())
            if answers_json and (route, method) not in sampled:
                missing.append(f"{method.upper()} {route}")
    assert missing == [], f"add a succeeding sample to _samples() for: {missing}"
    stale = {(s.route, s.method.lower()) for s, _ in contract.answers} - {
        (route, method) for route, ops in contract.openapi["paths"].items() for method in ops
    }
    assert not stale, f"samples for operations the server does not publish: {stale}"


def test_a_schema_with_a_field_too_few_or_too_many_fails(contract: Contract) -> None:
    """The check itself can fail: a body with an undeclared field, or without a required one."""
    body = next(r.json() for s, r in contract.answers if s.route == "/v1/toolchains")
    schema = _json_schema(contract.openapi, "/v1/toolchains", "GET", 200)
    assert schema is not None
    validator = _validator(contract.openapi, schema)
    assert validator.is_valid(body)
    assert not validator.is_valid({**body, "surprise": 1})
    assert not validator.is_valid({k: v for k, v in body.items() if k != "default"})


def test_artifact_body_has_every_field_of_the_artifact_metadata() -> None:
    """A field added to ArtifactMeta.to_dict() must be added to ArtifactBody, or the API would drop it."""
    from kcache_server.schemas import ArtifactBody

    from kcache.artifact import ArtifactMeta

    meta = ArtifactMeta(digest="0" * 64, size=1, kind="cubin", target="sm_80", toolchain="t")
    assert set(ArtifactBody.model_fields) == set(meta.to_dict())


def test_readyz_with_an_unreachable_database_says_so_without_its_error_text(
    contract: Contract, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """503 with a body that validates, naming no host, user or driver text; the log has them."""
    secret = (
        "could not connect to server: Connection refused (host=10.9.8.7 user=kcache_secret_user)"
    )

    class Unreachable:
        def connect(self) -> Any:
            raise sa.exc.OperationalError("SELECT 1", {}, Exception(secret))

    state = contract.server.state
    monkeypatch.setattr(state.backends, "db", Unreachable())
    with caplog.at_level("WARNING"), contract.server.client() as http:
        response = http.get("/readyz")
    monkeypatch.undo()
    assert response.status_code == 503
    body = response.json()
    request_id = response.headers["x-request-id"]
    assert body["status"] == "not_ready"
    assert body["checks"]["database"] == (
        f"failed: database unreachable (the server log has the error under request id {request_id})"
    )
    for leak in ("10.9.8.7", "kcache_secret_user", "OperationalError", "Connection refused"):
        assert leak not in response.text
    assert any(request_id in r.getMessage() and secret in r.getMessage() for r in caplog.records)
    schema = _json_schema(contract.openapi, "/readyz", "GET", 503)
    assert schema is not None and _validator(contract.openapi, schema).is_valid(body)


def test_the_published_schema_is_the_one_the_models_generate(contract: Contract) -> None:
    """The OpenAPI components come from the response models themselves (no hand-kept copy)."""
    from kcache_server.schemas import ResolveResponse

    published = contract.openapi["components"]["schemas"]["ResolveResponse"]
    generated = ResolveResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    generated.pop("$defs", None)
    assert published == generated


def _admits_null(node: Any) -> bool:
    if isinstance(node, dict):
        kind = node.get("type")
        if kind == "null" or (isinstance(kind, list) and "null" in kind):
            return True
        return any(_admits_null(value) for value in node.values())
    if isinstance(node, list):
        return any(_admits_null(item) for item in node)
    return False


def test_no_parameter_schema_has_a_null_branch(contract: Contract) -> None:
    """An optional query, header or path parameter is left out, never null: no schema says null.

    FastAPI writes ``X | None`` as ``anyOf: [X, {"type": "null"}]``; the branch no request
    can take made schemathesis count a valid ``DELETE /v1/pins?recipe_key=..`` invalid.
    """
    parameters = [
        (path, method, parameter)
        for path, operations in contract.openapi["paths"].items()
        for method, operation in operations.items()
        for parameter in operation.get("parameters", [])
    ]
    assert len(parameters) > 20  # every route's, not none
    assert [p["name"] for _, _, p in parameters if _admits_null(p["schema"])] == []
    unpin = contract.openapi["paths"]["/v1/pins"]["delete"]["parameters"]
    keys = next(p["schema"] for p in unpin if p["name"] == "recipe_key")
    # The branch's keywords kept, the parameter's own won: an array of hex keys, bounded.
    assert keys["type"] == "array" and keys["maxItems"] > 0
    assert keys["items"] == {"type": "string", "pattern": "^(?:[0-9a-f]{64})$"}
    group = next(p["schema"] for p in unpin if p["name"] == "group")
    assert group["type"] == "string" and "pattern" in group


def test_head_answers_what_get_would_with_no_body(contract: Contract) -> None:
    """HEAD /v1/blobs/{digest}: GET's status, type, length and ETag, and no bytes."""
    with contract.server.client() as http:
        got = http.get(f"/v1/blobs/{contract.digest}")
        head = http.head(f"/v1/blobs/{contract.digest}")
    assert (head.status_code, got.status_code) == (200, 200)
    for header in ("content-type", "content-length", "etag", "cache-control"):
        assert head.headers[header] == got.headers[header], header
    assert head.headers["content-type"] == "application/octet-stream"
    assert head.content == b"" and len(got.content) == int(got.headers["content-length"])
    responses = contract.openapi["paths"]["/v1/blobs/{digest}"]["head"]["responses"]
    assert "application/octet-stream" in responses["200"]["content"]


@pytest.mark.parametrize(
    ("route", "method"),
    [
        (route, method)
        for route in ("/v1/blobs/{digest}", "/v1/pins", "/v1/recipes/{recipe_key}", "/v1/resolve")
        for method in ("OPTIONS", "PUT", "PATCH")
        if (route, method) != ("/v1/blobs/{digest}", "PUT")  # a foreign file's upload
    ]
    + [("/v1/blobs/{digest}", "DELETE")],
)
def test_a_405_allows_exactly_the_documented_methods(
    contract: Contract, method: str, route: str
) -> None:
    """``Allow`` names every method the path serves, even when they are separate routes."""
    url = route.format(digest=contract.digest, recipe_key=contract.recipe_key)
    with contract.server.client() as http:
        response = http.request(method, url)
    assert response.status_code == 405, response.text
    documented = {m.upper() for m in contract.openapi["paths"][route]}
    allowed = {m.strip() for m in response.headers["allow"].split(",")}
    assert allowed == documented
    assert response.json()["error"] == "method_not_allowed"
    assert method in response.json()["detail"]
