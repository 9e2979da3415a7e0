"""Server compile workers: probes for host files get 4xx and leave nothing behind; workers are confined.

Two real servers for the module: one with the default sandbox setting (confined by
Landlock where the kernel has it) and one forced into the degraded mode with
``KCACHE_COMPILE_SANDBOX=off``. Their processes hold a secret marker in the
environment and run from a working directory with a header in it.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcache.errors import CompileError, ToolchainError
from kcache.include_sets import IncludeSets
from kcache.nvrtc import compile_recipe
from kcache.recipe import Recipe
from kcache.sandbox import probe
from kcache.toolchain import load_toolchain
from tests.support import ServerThread, unique

KERNEL = 'extern "C" __global__ void k(int* o) { o[0] = 1; }\n'
MARKER = f"kc-secret-{uuid.uuid4().hex}"
PASSWD_LINE = next(iter(Path("/etc/passwd").read_text().splitlines()), "root:x:0:0")
HAS_ESCAPE = "#if __has_include(<lib/escape.h>)\n#error the compile opened a file outside its roots\n#endif\n"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An include set with a link out of it, a world-readable file outside, a working directory."""
    base = tmp_path_factory.mktemp("confinement")
    outside = base / "outside"
    outside.mkdir()
    secret = outside / "secret.h"
    secret.write_text(f"#define ESCAPED 1\n// {MARKER}\n")
    secret.chmod(0o644)
    library = base / "lib"
    (library / "lib").mkdir(parents=True)
    (library / "lib" / "value.h").write_text("#pragma once\n#define LIB_VALUE 5\n")
    (library / "lib" / "escape.h").symlink_to(secret)
    cwd = base / "cwd"
    cwd.mkdir()
    (cwd / "memsys.cuh").write_text("#define MEMSYS 1\n")
    return {"outside": outside, "secret": secret, "library": library, "cwd": cwd, "base": base}


def _start(
    roots: dict[str, Path], name: str, **env: str
) -> Iterator[tuple[ServerThread, _Records]]:
    from kcache_server import Settings

    records = _Records()
    logging.getLogger("kcache_server.compile_pool").addHandler(records)
    saved = {k: os.environ.get(k) for k in ("KCACHE_TEST_SECRET", *env)}
    os.environ.update(KCACHE_TEST_SECRET=MARKER, **env)
    here = os.getcwd()
    os.chdir(roots["cwd"])  # the stale-hit setup: a header where the server runs
    try:
        settings = Settings(
            data_dir=roots["base"] / name,
            compile_workers=1,
            audit={"flush_s": 0.05},
            auth_cache_s=0.0,
            include_sets={"lib": roots["library"]},
        )
        server = ServerThread(settings)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        yield server, records
    finally:
        server.stop()
        os.chdir(here)
        logging.getLogger("kcache_server.compile_pool").removeHandler(records)


@pytest.fixture(scope="module")
def confined(roots: dict[str, Path]) -> Iterator[tuple[ServerThread, _Records]]:
    yield from _start(roots, "confined")


@pytest.fixture(scope="module")
def degraded(roots: dict[str, Path]) -> Iterator[tuple[ServerThread, _Records]]:
    yield from _start(roots, "degraded", KCACHE_COMPILE_SANDBOX="off")


def _recipe(source: str, **fields: Any) -> dict[str, Any]:
    return {"source": f"// {unique()}\n{source}", "target": "sm_80", **fields}


def _key(recipe: dict[str, Any], roots: dict[str, Path]) -> str:
    """The key the server gives ``recipe``: its toolchain, the set "lib" pinned to its contents."""
    sets = IncludeSets({"lib": roots["library"]}, max_age_s=0).digests()
    return (
        Recipe.from_dict(recipe)
        .with_defaults(toolchain=load_toolchain().id, include_sets=sets)
        .key()
    )


def _assert_clean(body: str) -> None:
    assert MARKER not in body and PASSWD_LINE not in body and "root:x:" not in body
    assert "KCACHE_" not in body


PROBES = {
    "absolute": ('#include "/etc/passwd"\n', "unlisted_include"),
    "proc environ": ('#include "/proc/self/environ"\n', "unlisted_include"),
    "escape": ("#include <../../../../../../../../etc/passwd>\n", "unlisted_include"),
    "computed": ("#define P(x) #x\n#include P(/etc/passwd)\n", "unlisted_include"),
    "has_include": ('#if __has_include("/etc/shadow")\n#endif\n', "unlisted_include"),
    "has_include computed": (
        "#define S(x) #x\n#if __has_include(S(/etc/shadow))\n#endif\n",
        "invalid_recipe",
    ),
    "working directory": ('#include "memsys.cuh"\n', "unlisted_include"),
    "link out of a set": ("#include <lib/escape.h>\n", "unlisted_include"),
    "outside file": ("#include SECRET_PATH\n", "unlisted_include"),
}


@pytest.mark.parametrize("server_name", ["confined", "degraded"])
@pytest.mark.parametrize("probe_name", list(PROBES))
def test_probes_get_4xx_and_leave_nothing_for_later_callers(
    request: pytest.FixtureRequest, roots: dict[str, Path], server_name: str, probe_name: str
) -> None:
    server, _ = request.getfixturevalue(server_name)
    prefix, code = PROBES[probe_name]
    prefix = prefix.replace("SECRET_PATH", f'"{roots["secret"]}"')
    recipe = _recipe(prefix + KERNEL, include_sets=["lib"])
    with server.client() as client:
        response = client.post("/v1/resolve", json={"recipe": recipe})
        assert response.status_code == 422, response.text
        assert response.json()["error"] == code
        _assert_clean(response.text)
        if code == "unlisted_include":
            assert "give it in `headers` or register an include set" in response.json()["detail"]
        key = _key(recipe, roots)
        for later in (
            client.post("/v1/resolve", json={"recipe": recipe, "compile": False}),
            client.get(f"/v1/recipes/{key}"),
            client.get(f"/v1/recipes/{key}/artifact"),
        ):
            assert later.status_code == 404, later.text  # no artifact and no negative entry
            _assert_clean(later.text)


def test_a_working_directory_header_never_answers_for_the_recipe(
    confined: tuple[ServerThread, _Records], roots: dict[str, Path]
) -> None:
    server, _ = confined
    source = '#include "memsys.cuh"\nextern "C" __global__ void k(int* o) { o[0] = MEMSYS; }\n'
    tag = unique()
    with server.client() as client:
        for value in (1, 2):
            (roots["cwd"] / "memsys.cuh").write_text(f"#define MEMSYS {value}\n")
            refused = client.post(
                "/v1/resolve", json={"recipe": {"source": f"// {tag}\n{source}", "target": "sm_80"}}
            )
            assert refused.status_code == 422 and refused.json()["error"] == "unlisted_include"
        digests = []
        for value in (1, 2):
            recipe = {
                "source": f"// {tag}\n{source}",
                "target": "sm_80",
                "headers": {"memsys.cuh": f"#define MEMSYS {value}\n"},
            }
            body = client.post("/v1/resolve", json={"recipe": recipe}).json()
            assert body["status"] == "compiled" and body["artifact"]["dependencies_exact"]
            digests.append(body["artifact"]["digest"])
        assert digests[0] != digests[1]


def test_compile_logs_hold_only_the_recipes_own_messages(
    confined: tuple[ServerThread, _Records], roots: dict[str, Path]
) -> None:
    server, _ = confined
    recipe = _recipe('#include "h.cuh"\n' + KERNEL, headers={"h.cuh": "int bad = ;\n"})
    with server.client() as client:
        first = client.post("/v1/resolve", json={"recipe": recipe})
        again = client.post("/v1/resolve", json={"recipe": recipe, "compile": False})
    assert first.status_code == again.status_code == 422
    assert first.json()["log"] == again.json()["log"] and again.json()["cached"]
    assert "h.cuh(1): error" in first.json()["log"]
    assert (
        str(roots["base"]) not in first.text and str(load_toolchain().include_dir) not in first.text
    )


@pytest.mark.skipif(probe().abi <= 0, reason=f"Landlock is unavailable here: {probe().detail}")
def test_a_confined_worker_cannot_open_a_readable_file_outside_its_roots(
    confined: tuple[ServerThread, _Records], roots: dict[str, Path]
) -> None:
    """From inside a compile: NVRTC answers __has_include by opening the file; in the worker it cannot."""
    server, _ = confined
    secret = roots["secret"]
    assert secret.stat().st_mode & 0o004 and os.access(secret, os.R_OK)  # world-readable, exists
    source = HAS_ESCAPE + KERNEL
    toolchain = load_toolchain()
    unconfined = Recipe(
        source=source, target="sm_80", include_sets=("lib",), toolchain=toolchain.id
    )
    with pytest.raises(
        CompileError, match="opened a file outside its roots"
    ):  # this process can open it
        compile_recipe(unconfined, toolchain, IncludeSets({"lib": roots["library"]}))
    with server.client() as client:
        ready = client.get("/readyz").json()
        assert ready["checks"]["compile_sandbox"].startswith("ok (confined by Landlock ABI")
        response = client.post(
            "/v1/resolve", json={"recipe": _recipe(source, include_sets=["lib"])}
        )
    assert response.status_code == 200, (
        response.text
    )  # the worker could not open it: false, as if absent


def test_workers_start_with_a_scrubbed_environment(confined: tuple[ServerThread, _Records]) -> None:
    server, _ = confined
    workers = list(server.state.backends.compiler._all)
    assert workers
    for worker in workers:
        environ = Path(f"/proc/{worker.process.pid}/environ").read_bytes().split(b"\0")
        names = {item.split(b"=", 1)[0].decode() for item in environ if item}
        assert MARKER.encode() not in b"\0".join(environ)
        assert not {name for name in names if name.startswith("KCACHE")}
        assert f"TMPDIR={worker.scratch}".encode() in environ
        # Its working directory: an empty one inside its scratch, removed (nothing a quoted
        # include could find, and no directory recorded in -G or LTO-IR output).
        cwd = os.readlink(f"/proc/{worker.process.pid}/cwd")
        assert cwd.endswith(" (deleted)") and Path(cwd).parent == worker.scratch


def test_degraded_mode_serves_and_says_so(degraded: tuple[ServerThread, _Records]) -> None:
    server, records = degraded
    with server.client() as client:
        ready = client.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["checks"]["compile_sandbox"].startswith(
            "degraded: confinement turned off (compile_sandbox=off)"
        )
        ok = client.post("/v1/resolve", json={"recipe": _recipe(KERNEL)})
        assert ok.status_code == 200 and ok.json()["status"] == "compiled"
    assert any("COMPILE WORKERS ARE NOT CONFINED" in message for message in records.messages)


def test_the_sandbox_setting_decides_whether_an_unconfined_pool_may_serve(tmp_path: Path) -> None:
    from kcache_server import Settings
    from kcache_server.compile_pool import ProcessPoolCompiler

    assert Settings(host="0.0.0.0").compile_sandbox_mode == "required"
    assert Settings(host="127.0.0.1").compile_sandbox_mode == "best-effort"
    assert (
        Settings(host="0.0.0.0", compile_sandbox="best-effort").compile_sandbox_mode
        == "best-effort"
    )
    pool = ProcessPoolCompiler(
        load_toolchain(), IncludeSets(), workers=1, timeout_s=30, memory_mb=8192, queue_limit=0,
        tmp_dir=tmp_path / "tmp", compile_sandbox="required",
    )  # fmt: skip
    try:
        if probe().abi > 0:
            pool.start()
            assert pool.sandbox is not None and pool.sandbox.active
        else:
            with pytest.raises(
                ToolchainError,
                match="refusing to compile: the compile worker could not be confined",
            ):
                pool.start()
    finally:
        pool.close()
