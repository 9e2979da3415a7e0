"""Explained misses on a real server: each kind of difference, in the audit row, ``/v1/stats``,
``POST /v1/explain``, ``GET /v1/recipes/{key}/explain`` and ``kcache explain``.

One server (uvicorn, NVRTC, SQLite) for the module. Each case compiles a recipe of its
own kernel, then resolves a variant of it (compiled, or a miss with ``compile`` false)
and reads the reason the server gave the variant's miss.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kcache.recipe import Recipe
from tests.support import KCACHE, ServerThread, audit_rows, unique

ADD1 = "#define ADD 1.0f\n"
ADD2 = "#define ADD 2.0f\n"


def _sha8(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """A real server with one include set, for the module."""
    from kcache_server import Settings
    from kcache_server.settings import AuditSettings

    cutlass = tmp_path_factory.mktemp("cutlass")
    (cutlass / "cutlass.h").write_text("#pragma once\n")
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("explained") / "data",
        compile_workers=1,
        audit=AuditSettings(flush_s=0.05),
        auth_cache_s=0.0,
        include_sets={"cutlass": cutlass},
    )
    running = ServerThread(settings)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


def kernel(name: str, **fields: Any) -> dict[str, Any]:
    """A small valid recipe of kernel ``name`` (a vector add of a header's constant)."""
    recipe: dict[str, Any] = {
        "source": (
            '#include "add.cuh"\n'
            f'extern "C" __global__ void {name}(float* out, const float* a, int n) {{\n'
            "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
            "  if (i < n) out[i] = a[i] + ADD;\n"
            "}\n"
        ),
        "name": "k.cu",
        "headers": {"add.cuh": ADD1},
        "flags": ["-DA", "-DB"],
        "target": "sm_80",
    }
    recipe.update(fields)
    return recipe


def _key(server: ServerThread, recipe: dict[str, Any]) -> str:
    """The key the server gives ``recipe``: its toolchain, its include sets pinned to their contents."""
    return server.state.backends.engine.prepare(Recipe.from_dict(recipe)).key()


def _resolve(http: httpx.Client, recipe: dict[str, Any], *, compile: bool = True) -> None:
    r = http.post("/v1/resolve", json={"recipe": recipe, "compile": compile})
    assert r.status_code == (200 if compile else 404), r.text
    if compile:
        assert r.json()["status"] == "compiled"


def _reasons(server: ServerThread, http: httpx.Client, name: str, key: str) -> tuple[str, str]:
    """The variant's audit-row reason and ``/v1/stats``' explanation of the kernel's last miss.

    Both are for any read token: no macro or specialization value in them (only the
    explain routes show those, to a compile token; tests/server/test_explain_scopes.py).
    """
    stats = http.get("/v1/stats", params={"kernel": name, "top": 1}).json()  # flushes first
    (missed,) = stats["top_missed"]
    assert missed["recipe_key"] == key
    rows = [r for r in audit_rows(server.settings.database_url, recipe_key=key)]
    (row,) = [r for r in rows if r.outcome in ("compiled", "miss")]
    return row.miss_reason, missed["last_miss_explanation"]


# (id, the first recipe's fields, the variant's, what the variant differs in, compile the variant)
CASES: list[tuple[str, dict[str, Any], dict[str, Any], list[str], bool]] = [
    (
        "header_changed",
        {},
        {"headers": {"add.cuh": ADD2}},
        [f"header add.cuh changed ({_sha8(ADD1)}.. -> {_sha8(ADD2)}..)"],
        True,
    ),
    (
        "header_added",
        {},
        {"headers": {"add.cuh": ADD1, "extra.cuh": "\n"}},
        ["header extra.cuh added"],
        True,
    ),
    (
        "header_removed",
        {"headers": {"add.cuh": ADD1, "old.cuh": "\n"}},
        {},
        ["header old.cuh removed"],
        True,
    ),
    ("flag_added", {}, {"flags": ["-DA", "-DB", "-lineinfo"]}, ["flag -lineinfo added"], True),
    ("flag_removed", {}, {"flags": ["-DA"]}, ["flag -DB removed"], True),
    (
        "flags_reordered",
        {},
        {"flags": ["-DB", "-DA"]},
        ["flags reordered: -DA -DB -> -DB -DA"],
        True,
    ),
    ("flag_not_compiled", {}, {"flags": ["-DA", "-DB", "-DN=4"]}, ["flag -DN=4 added"], False),
    ("target", {}, {"target": "sm_90"}, ["target sm_80 -> sm_90"], True),
    (
        "output",
        {},
        {"target": "compute_80", "output": "ptx"},
        ["target sm_80 -> compute_80", "output cubin -> ptx"],
        True,
    ),
    (
        "specialization_changed",
        {"specialization": {"N": 4}},
        {"specialization": {"N": 8}},
        ["specialization N 4 -> 8"],
        True,
    ),
    (
        "specialization_added",
        {},
        {"specialization": {"N": 4}},
        ["specialization N added (4)"],
        True,
    ),
    (
        "specialization_removed",
        {"specialization": {"N": 4, "dtype": "float16"}},
        {"specialization": {"N": 4}},
        ["specialization dtype removed (float16)"],
        True,
    ),
    ("include_set", {}, {"include_sets": ["cutlass"]}, ["include set cutlass added"], True),
    ("name_expressions", {}, {"name_expressions": ["x"]}, ["name expressions changed"], False),
]


#: What the audit row and /v1/stats say where the explain routes name values (first line -> all).
HIDDEN = {
    "flag -DN=4 added": ["flag -DN=… added"],
    "specialization N 4 -> 8": ["specialization N changed"],
    "specialization N added (4)": ["specialization N added"],
    "specialization dtype removed (float16)": ["specialization dtype removed"],
}


@pytest.mark.parametrize(
    ("first", "variant", "expected", "compile"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_each_kind_of_difference_is_the_misses_reason(
    server: ServerThread,
    http: httpx.Client,
    first: dict[str, Any],
    variant: dict[str, Any],
    expected: list[str],
    compile: bool,
) -> None:
    name = f"k_{unique().replace('-', '_')}"
    base = kernel(name, **first)
    _resolve(http, base)
    changed = kernel(name, **variant)
    if "name_expressions" in variant:  # the kernel the audit names is the first expression
        name = variant["name_expressions"][0]
    _resolve(http, changed, compile=compile)
    want = f"nearest {_key(server, base)[:16]}: {'; '.join(expected)}"
    stored = f"nearest {_key(server, base)[:16]}: {'; '.join(HIDDEN.get(expected[0], expected))}"
    assert _reasons(server, http, name, _key(server, changed)) == (stored, stored)
    # The same, asked of the server afterwards, by body and by key; a compiled variant is
    # held now (that says so first: tests/server/test_explain_held.py), and what set it
    # apart from its nearest other recipe is the same.
    body = http.post("/v1/explain", json={"recipe": changed}).json()
    assert {k: body[k] for k in ("nearest_key", "differences")} == {
        "nearest_key": _key(server, base),
        "differences": expected,
    }
    assert body["held"] == ("key" if compile else None)
    if not compile:
        assert body["text"] == want
    if compile:
        by_key = http.get(f"/v1/recipes/{_key(server, changed)}/explain").json()
        assert by_key["nearest_key"] == _key(server, base)


def test_a_new_kernel_is_never_seen(server: ServerThread, http: httpx.Client) -> None:
    name = f"k_{unique().replace('-', '_')}"
    recipe = kernel(name)
    _resolve(http, recipe, compile=False)
    assert _reasons(server, http, name, _key(server, recipe)) == ("never seen", "never seen")
    body = http.post("/v1/explain", json={"recipe": recipe}).json()
    assert {k: body[k] for k in ("nearest_key", "differences", "text", "held")} == {
        "nearest_key": None,
        "differences": [],
        "text": "never seen",
        "held": None,
    }
    r = http.get(f"/v1/recipes/{_key(server, recipe)}/explain")  # never recorded: not compiled
    assert r.status_code == 404 and r.json()["error"] == "not_found"


def test_another_toolchain_is_named(server: ServerThread, http: httpx.Client) -> None:
    """A recipe recorded under a toolchain this server no longer runs (as after an upgrade)."""
    name = f"k_{unique().replace('-', '_')}"
    recipe = kernel(name)
    old = Recipe.from_dict({**recipe, "toolchain": "nvrtc-0.1"})
    server.state.recipe_records.record(old)
    _resolve(http, recipe)
    current = server.state.backends.engine.toolchain_id
    want = f"nearest {old.key()[:16]}: toolchain nvrtc-0.1 -> {current}"
    assert _reasons(server, http, name, _key(server, recipe)) == (want, want)


def test_every_compiled_recipe_is_kept_whole(server: ServerThread, http: httpx.Client) -> None:
    recipe = kernel(f"k_{unique().replace('-', '_')}", specialization={"N": 2})
    _resolve(http, recipe)
    server.state.audit.flush()
    kept = server.state.recipe_records.recipe(_key(server, recipe))
    toolchain = server.state.backends.engine.toolchain_id
    assert kept == Recipe.from_dict(recipe).with_defaults(toolchain=toolchain)


def test_kcache_explain_prints_one_line_per_difference(
    server: ServerThread, http: httpx.Client, tmp_path: Path
) -> None:
    name = f"k_{unique().replace('-', '_')}"
    base = kernel(name)
    _resolve(http, base)
    variant = kernel(name, headers={"add.cuh": ADD2}, flags=["-DA", "-DB", "-lineinfo"])
    path = tmp_path / "variant.json"
    path.write_text(json.dumps(variant))

    def explain(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [KCACHE, "explain", *args, "--server", server.url],
            capture_output=True,
            text=True,
            check=False,
            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        )

    result = explain(str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"header add.cuh changed ({_sha8(ADD1)}.. -> {_sha8(ADD2)}..)",
        "flag -lineinfo added",
    ]
    assert f"nearest {_key(server, base)}" in result.stderr
    # A .cu source with options builds the same recipe.
    source = tmp_path / "k.cu"
    source.write_text(variant["source"])
    header = tmp_path / "add.cuh"
    header.write_text(ADD2)
    flags = ["--flag=-DA", "--flag=-DB", "--flag=-lineinfo", "--header", f"add.cuh={header}"]
    result = explain(str(source), "--target", "sm_80", *flags)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1:] == ["flag -lineinfo added"]
    # By key: the base recipe, which the server compiled: held, not "never seen".
    result = explain(_key(server, base))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("held by its exact key: artifact "), result.stdout
    # A new kernel; and the JSON answer.
    path.write_text(json.dumps(kernel(f"k_{unique().replace('-', '_')}")))
    result = explain(str(path), "--json")
    assert json.loads(result.stdout)["text"] == "never seen"
    assert explain(str(path)).stdout == "never seen\n"
