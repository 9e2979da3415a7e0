"""Untrusted input: each kind of bad request gets the right 4xx, names the problem, and leaves no file."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcache.keys import is_hex_key
from tests.support import ServerThread, never_finishes, unique, vector_add

OK = vector_add("bad-input-base")


def recipe(**changes: Any) -> dict[str, Any]:
    """The valid base recipe with some fields changed."""
    return {**OK, **changes}


def resolve(body: Any) -> dict[str, Any]:
    return {"method": "POST", "url": "/v1/resolve", "json": body}


# One case per line, a table to read down: kept out of `ruff format`.
# fmt: off
# (id, request, status, error code, text that must appear in detail or field)
CASES: list[tuple[str, dict[str, Any], int, str, str]] = [
    ("malformed-json", {"method": "POST", "url": "/v1/resolve", "content": b'{"recipe": {',
                        "headers": {"content-type": "application/json"}}, 400, "bad_request", "not valid JSON"),
    ("body-not-object", resolve([1, 2]), 422, "invalid_request", "JSON object"),
    ("missing-recipe", resolve({"compile": True}), 422, "invalid_request", "recipe"),
    ("missing-source", resolve({"recipe": {"target": "sm_80"}}), 422, "invalid_recipe", "source"),
    ("unknown-request-field", resolve({"recipe": OK, "hurry": True}), 422, "invalid_request", "hurry"),
    ("unknown-recipe-field", resolve({"recipe": recipe(optimize=3)}), 422, "invalid_recipe", "optimize"),
    ("unknown-context-field", resolve({"recipe": OK, "context": {"gpu": 1}}), 422, "invalid_request", "context.gpu"),
    ("context-wrong-type", resolve({"recipe": OK, "context": {"rank": "x"}}), 422, "invalid_request", "context.rank"),
    ("context-bool-as-int", resolve({"recipe": OK, "context": {"rank": True}}), 422, "invalid_request", "context.rank"),
    ("compile-not-bool", resolve({"recipe": OK, "compile": 1}), 422, "invalid_request", "compile"),
    ("not-json-content-type", {"method": "POST", "url": "/v1/resolve", "content": b'{"recipe": {}}',
                               "headers": {"content-type": "text/plain"}}, 422, "invalid_request", "Content-Type"),
    ("dotdot-include", resolve({"recipe": recipe(headers={"../secret.h": "int x;"})}), 422, "invalid_recipe", ".."),
    ("absolute-include", resolve({"recipe": recipe(headers={"/etc/passwd": "x"})}), 422, "invalid_recipe",
     "absolute path"),
    ("nul-in-source", resolve({"recipe": recipe(source="int x;\u0000")}), 422, "invalid_recipe", "NUL"),
    ("nul-in-header", resolve({"recipe": recipe(headers={"a.h": "\u0000"})}), 422, "invalid_recipe", "NUL"),
    ("oversized-source", resolve({"recipe": recipe(source="a" * ((1 << 20) + 1))}), 422, "invalid_recipe",
     "limit of 1048576 bytes"),
    ("oversized-header-set", resolve({"recipe": recipe(headers={f"h{i}.h": "b" * (3 << 20) for i in range(3)})}),
     422, "invalid_recipe", "total size"),
    ("too-many-headers", resolve({"recipe": recipe(headers={f"h{i}.h": "" for i in range(257)})}), 422,
     "invalid_recipe", "at most 256 headers"),
    ("unsupported-target", resolve({"recipe": recipe(target="sm_20")}), 422, "invalid_recipe", "not supported"),
    ("malformed-target", resolve({"recipe": recipe(target="gfx90a")}), 422, "invalid_recipe", "not a target"),
    # Schemathesis sent sm_75a with lto: NVRTC's "Compilation terminated" came back as a
    # compile error hinting at files; no SM below 90 has an architecture-specific target.
    ("arch-specific-target-too-old", resolve({"recipe": recipe(target="sm_75a", lto=True)}), 422,
     "invalid_recipe", "begin at sm_90a"),
    ("family-target-too-old", resolve({"recipe": recipe(target="sm_90f")}), 422, "invalid_recipe",
     "begin at sm_100f"),
    ("auto-target", resolve({"recipe": recipe(target="auto")}), 400, "unresolved_recipe", "auto"),
    ("flag-include-path", resolve({"recipe": recipe(flags=["-I/etc"])}), 422, "invalid_recipe", "flags[0]"),
    ("flag-include-path-long", resolve({"recipe": recipe(flags=["-lineinfo", "--include-path=/root"])}), 422,
     "invalid_recipe", "flags[1]"),
    ("flag-pch", resolve({"recipe": recipe(flags=["--create-pch=/tmp/evil.pch"])}), 422, "invalid_recipe", "PCH"),
    ("flag-trace-output", resolve({"recipe": recipe(flags=["--fdevice-time-trace=/tmp/evil"])}), 422,
     "invalid_recipe", "flags[0]"),
    ("flags-not-list", resolve({"recipe": recipe(flags="-lineinfo")}), 422, "invalid_recipe", "flags"),
    ("include-set-unregistered", resolve({"recipe": recipe(include_sets=["cutlass"])}), 422, "invalid_recipe",
     "not registered"),
    ("unknown-toolchain", resolve({"recipe": recipe(toolchain="nvrtc9.0-old")}), 422, "invalid_recipe",
     "not available on this server"),
    ("bad-link-digest", resolve({"recipe": recipe(lto=True, link=[{"digest": "zz"}])}), 422, "invalid_recipe",
     "link[0].digest"),
    ("body-too-large", {"method": "POST", "url": "/v1/resolve", "content": b"x" * (13 << 20),
                        "headers": {"content-type": "application/json"}}, 413, "too_large", "limit"),
    ("bad-recipe-key", {"method": "GET", "url": "/v1/recipes/not-a-key"}, 400, "bad_request", "recipe_key"),
    ("path-traversal", {"method": "GET", "url": "/v1/blobs/..%2F..%2Fetc%2Fpasswd"}, 404, "not_found", "Not Found"),
    ("bad-artifact-key", {"method": "GET", "url": "/v1/recipes/ABC/artifact"}, 400, "bad_request", "recipe_key"),
    ("bad-digest", {"method": "GET", "url": "/v1/blobs/" + "g" * 64}, 400, "bad_request", "digest"),
    ("batch-too-large", {"method": "POST", "url": "/v1/resolve/batch", "json": {"recipes": [OK] * 9}}, 422,
     "invalid_request", "at most 8 recipes"),
    ("unknown-route", {"method": "GET", "url": "/v1/nothing"}, 404, "not_found", "Not Found"),
]
# fmt: on


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    from kcache_server import Settings

    root = tmp_path_factory.mktemp("bad-input")
    settings = Settings(
        data_dir=root / "data",
        compile_workers=1,
        max_request_bytes=12 << 20,
        max_batch=8,
        audit={"flush_s": 0.05},
    )
    # This process's temporary files (an in-process compile's trace directory) go where no
    # other process on the machine writes, so a file left behind is this server's.
    process_tmp = root / "process-tmp"
    process_tmp.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", str(process_tmp))
        server = ServerThread(settings)
        yield server
        server.stop()


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def _stray_traces() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("kcache-trace-*")}


@pytest.mark.parametrize(
    ("request_args", "status", "code", "names"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_is_refused_precisely(
    server: ServerThread, request_args: dict[str, Any], status: int, code: str, names: str
) -> None:
    data_dir = server.settings.data_dir
    outside = data_dir.parent
    before_outside = _files(outside) - {str(p) for p in _files(outside) if p.startswith("data/")}
    before_blobs = _files(data_dir / "blobs")
    before_scratch = _files(data_dir / "tmp")  # the compile workers' scratch directories
    traces = _stray_traces()
    with server.client() as client:
        response = client.request(**request_args)
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"] == code
    assert names in body["detail"] or names in (body.get("field") or ""), body
    after_outside = {p for p in _files(outside) if not p.startswith("data/")}
    assert after_outside == before_outside
    assert _files(data_dir / "blobs") == before_blobs  # nothing was compiled or published
    assert _files(data_dir / "tmp") == before_scratch
    assert _stray_traces() <= traces
    with server.client() as client:  # and the server keeps serving
        assert client.get("/healthz").status_code == 200


def test_every_code_the_server_answers_bad_input_with_has_a_case() -> None:
    """The table provokes each input error of the server's one error table: a new one needs a case.

    Input errors are those answered 400 or 413, and the 422s that name a wrong request or
    recipe field (the other 422s are compile outcomes, tested with the compiler).
    """
    from kcache_server.errors import ERROR_TABLE, InvalidRequestError, RecipeError

    input_codes = {info.code for info in ERROR_TABLE.values() if info.status in (400, 413)}
    input_codes |= {ERROR_TABLE[InvalidRequestError].code, ERROR_TABLE[RecipeError].code}
    assert input_codes - {code for *_, code, _ in CASES} == set()


def test_a_template_that_never_finishes_times_out_and_the_server_keeps_serving(
    make_settings: Any, serve: Any
) -> None:
    settings = make_settings(compile_timeout_s=2.0)
    server = serve(settings)
    endless = never_finishes(unique())
    with server.client() as client:
        response = client.post("/v1/resolve", json={"recipe": endless})
        assert response.status_code == 422, response.text
        assert response.headers["content-type"] == "application/json"
        body = response.json()
        assert body["error"] == "compile_timeout"
        assert (
            "KCACHE_COMPILE_TIMEOUT_S" in body["detail"]
            or "KCACHE_COMPILE_TIMEOUT_S" in body["log"]
        )
        # A fresh worker replaced the killed one: the next compile works.
        ok = client.post("/v1/resolve", json={"recipe": vector_add(unique())})
        assert ok.status_code == 200 and ok.json()["status"] == "compiled"
    assert server.state.backends.compiler.restarts == 1
    scratch = settings.data_dir / "tmp"
    assert not [p for p in scratch.rglob("*") if p.is_file()]  # the killed worker's scratch is gone
    # The error body carries the compile error's fields: the key of the refused recipe, the
    # log, and that this answer came from a fresh compile, not from a remembered failure.
    assert set(body) == {"error", "detail", "log", "recipe_key", "cached"}, body
    assert is_hex_key(body["recipe_key"]) and body["cached"] is False, body
