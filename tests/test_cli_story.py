"""The ``kcache`` command as a user meets it: one story, honest messages, no tracebacks.

Every command runs as a real process with a clean environment; one real server serves
the module. Each mistake a user can make ends in one or two lines on stderr that name
the flag, file or variable to fix, a non-zero exit, and no traceback.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli_harness import PROGRESS, STILL, assert_user_error, kcache, user_env
from tests.support import KCACHE, VECTOR_ADD, ServerProcess, free_port


class Server(ServerProcess):
    """``kcache serve`` in a user's environment, with its data directory under ``root``."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        super().__init__(root / "server-data", env=user_env(root), cwd=root, log=root / "serve.log")
        self.start(ready="/readyz")

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(f"{self.url}/v1/stats?since=1h", timeout=10) as response:
            totals: dict[str, int] = json.load(response)["totals"]
            return totals


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("story"))
    yield running
    running.stop()


@pytest.fixture
def home(tmp_path: Path) -> Path:
    (tmp_path / "add.cu").write_text(VECTOR_ADD)
    return tmp_path


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


# ---------------------------------------------------------------------------- one story
def test_compile_uses_the_configured_server_and_never_writes_its_data_directory(
    server: Server, home: Path
) -> None:
    env = user_env(home, KCACHE_URL=server.url)
    before = sum(server.stats().values())
    source = home / "story.cu"
    source.write_text(VECTOR_ADD.replace("x[i] + y[i]", "x[i] + y[i] + 1.0f"))
    first = kcache("compile", str(source), "--target", "sm_90", env=env, cwd=home)
    second = kcache("compile", str(source), "--target", "sm_90", env=env, cwd=home)
    got = kcache("get", str(source), "--target", "sm_90", env=env, cwd=home)
    assert [json.loads(r.stdout)["status"] for r in (first, second, got)] == [
        "compiled",
        "hit",
        "local_hit",
    ], (first.stderr, second.stderr, got.stderr)
    assert sum(server.stats().values()) >= before + 2  # the server saw both compiles
    artifact = Path(json.loads(got.stdout)["path"])
    assert artifact.is_relative_to(home / "cache")  # the user's cache directory
    assert not (server.data_dir / "index").exists()  # no JSON index beside kcache.db
    assert not (home / ".kcache").exists()  # and no server directory in the working one
    for command in ("get", "compile"):  # named as a cache directory, it is still refused
        misused = kcache(
            command, str(source), "--target", "sm_90", "--cache-dir", str(server.data_dir), env=env
        )
        assert_user_error(misused, "--cache-dir", "server's data directory")
    assert not (server.data_dir / "index").exists()


def test_without_a_server_commands_share_the_cache_directory(home: Path) -> None:
    env = user_env(home)
    compiled = kcache("compile", "add.cu", "--target", "sm_80", env=env, cwd=home)
    assert json.loads(compiled.stdout)["status"] == "compiled", compiled.stderr
    for command in ("compile", "get"):
        again = kcache(command, "add.cu", "--target", "sm_80", env=env, cwd=home)
        assert json.loads(again.stdout)["status"] == "local_hit", again.stderr
    key = kcache("key", "add.cu", "--target", "sm_80", env=env, cwd=home)
    assert key.stdout.strip() == json.loads(compiled.stdout)["recipe_key"]
    verified = kcache("verify", env=env, cwd=home)
    assert json.loads(verified.stdout) == {"checked": 1, "corrupt": [], "missing": []}
    assert kcache("gc", env=env, cwd=home).returncode == 0
    assert not (home / ".kcache").exists()


def test_a_server_gone_down_is_reported_in_seconds_and_the_tier_answers_alike(
    home: Path,
) -> None:
    """Issue 15 item 4: with the server down, `compile` and `get` tell the same story."""
    gone = Server(home / "gone")
    env = user_env(home, KCACHE_URL=gone.url)
    compiled = kcache("compile", "add.cu", "--target", "sm_90", env=env, cwd=home)
    assert json.loads(compiled.stdout)["status"] == "compiled", compiled.stderr
    gone.stop()
    for command in ("compile", "get"):
        answered = kcache(command, "add.cu", "--target", "sm_90", env=env, cwd=home, timeout=30)
        assert answered.returncode == 0, answered.stderr
        assert json.loads(answered.stdout)["status"] == "local_hit"  # the same tier, the same word
        if command == "compile":  # it asked the server first: a status line, then what happened
            assert PROGRESS in answered.stderr
            assert f"server unreachable at {gone.url}; answered from the cache" in answered.stderr
        assert "Logged once per process" not in answered.stderr  # the library's line, not twice
    missing = kcache("compile", "add.cu", "--target", "sm_80", env=env, cwd=home, timeout=30)
    lines = assert_user_error(missing, f"server unreachable at {gone.url}", "--local-compile")
    assert "ConnectError" in lines[0]
    fallback = kcache(
        "compile", "add.cu", "--target", "sm_80", "--local-compile", env=env, cwd=home
    )
    assert json.loads(fallback.stdout)["status"] == "compiled", fallback.stderr
    never_seen = user_env(home, KCACHE_URL=_dead_url())
    unknown = kcache("get", "add.cu", "--target", "sm_90", env=never_seen, cwd=home, timeout=30)
    assert_user_error(unknown, "server unreachable", "toolchain", "--local-compile")


def test_warmup_local_compile_compiles_when_the_server_is_down(home: Path) -> None:
    recipes = home / "recipes.json"
    recipes.write_text(
        json.dumps(
            [
                {"source": VECTOR_ADD.replace("add(", "warm_a("), "target": "sm_90"},
                {"source": VECTOR_ADD.replace("add(", "warm_b("), "target": "sm_80"},
            ]
        )
    )
    env = user_env(home, KCACHE_URL=_dead_url())
    refused = kcache("warmup", str(recipes), "-q", env=env, cwd=home)
    assert_user_error(refused, "server unreachable", "--local-compile")
    warmed = kcache("warmup", str(recipes), "-q", "--local-compile", env=env, cwd=home)
    assert warmed.returncode == 0, warmed.stderr
    assert [json.loads(line)["status"] for line in warmed.stdout.splitlines()] == [
        "compiled",
        "compiled",
    ]


def test_warmup_prints_every_recipes_result_when_one_fails(home: Path) -> None:
    """A recipe that does not compile is its own line (and its log on stderr), beside the
    others': one failure printed nothing for the recipes that compiled."""
    recipes = home / "mixed.json"
    broken = {"source": 'extern "C" __global__ void broken( {', "target": "sm_90"}
    good = {"source": VECTOR_ADD.replace("add(", "mixed_ok("), "target": "sm_90"}
    too_old = {"source": VECTOR_ADD.replace("add(", "mixed_old("), "target": "sm_10"}
    recipes.write_text(json.dumps([good, broken, good, too_old]))
    env = user_env(home, KCACHE_URL="")
    result = kcache("warmup", str(recipes), "-q", env=env, cwd=home)
    assert result.returncode == 1, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["status"] for line in lines] == ["compiled", "error", "compiled", "error"], lines
    assert lines[1]["error"] == "compile_error" and lines[0]["digest"] == lines[2]["digest"]
    # A target this NVRTC does not compile is that recipe's failure, not the batch's (it
    # was reported as '--target: ...', a flag the command was never given).
    assert lines[3]["error"] == "RecipeError" and "sm_10" in lines[3]["detail"]
    assert "recipes[1]" in result.stderr and "recipes[3]" in result.stderr
    assert "--target" not in result.stderr and "Traceback" not in result.stderr


def test_python_warmup_with_local_compile_compiles_when_the_server_is_down(tmp_path: Path) -> None:
    from kcache_client import ClientSettings, KernelCache, RetryPolicy

    from kcache import Recipe

    fast = RetryPolicy(attempts=2, base_s=0.01, cap_s=0.02, budget_s=1.0)
    recipe = Recipe(source=VECTOR_ADD.replace("add(", "py_warm("), target="sm_90")
    settings = ClientSettings.from_env(local_compile=True, retry=fast)
    with KernelCache(_dead_url(), cache_dir=tmp_path, settings=settings) as cache:
        result = cache.warmup([recipe])
        assert result.statuses == ["compiled"] and cache.stats.local_compiles == 1
        assert result.artifacts[0].data[:4] == b"\x7fELF"


def test_include_sets_with_a_directory_work_for_local_compiles(home: Path) -> None:
    (home / "inc").mkdir()
    (home / "inc" / "val.h").write_text("#define VAL 3.0f\n")
    (home / "v.cu").write_text(
        '#include "val.h"\nextern "C" __global__ void v(float* x) { x[0] = VAL; }\n'
    )
    env = user_env(home)
    compiled = kcache(
        "compile", "v.cu", "--target", "sm_90", "--include-set", "vals=inc", env=env, cwd=home
    )
    assert json.loads(compiled.stdout)["status"] == "compiled", compiled.stderr
    unregistered = kcache(
        "compile", "v.cu", "--target", "sm_90", "--include-set", "vals", env=env, cwd=home
    )
    assert_user_error(unregistered, "--include-set NAME=DIR")


def test_db_upgrade_prints_the_revision_it_reached(home: Path) -> None:
    env = user_env(home)
    first = kcache("db", "upgrade", "0001", "--data-dir", str(home / "srv"), env=env)
    assert first.returncode == 0 and first.stdout.startswith("database at 0001"), first.stderr
    head = kcache("db", "upgrade", "--data-dir", str(home / "srv"), env=env)
    older = kcache("db", "upgrade", "0001", "--data-dir", str(home / "srv"), env=env)
    assert head.stdout.split()[2] == older.stdout.split()[2] != "0001"
    assert "never downgrades" in older.stdout


def test_get_slash_leads_to_the_dashboard(server: Server) -> None:
    request = urllib.request.Request(f"{server.url}/")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200 and response.url.endswith("/dashboard")


# ---------------------------------------------------------------------------- the errors
@pytest.mark.parametrize(
    ("args", "names"),
    [
        (
            ["compile", "add.cu", "--target", "sm_90", "--header", "a.h=nope.h"],
            ["--header", "nope.h"],
        ),
        (["compile", "missing.cu", "--target", "sm_90"], ["missing.cu"]),
        (["compile", "add.cu", "--target", "sm_9"], ["--target"]),
        (
            ["compile", "add.cu"],
            ["--target"],
        ),  # "auto" without a GPU: flag advice, not auto_target=
        (["get", "add.cu", "--target", "sm_90", "--no-compile"], ["--no-compile", "--server"]),
        (["compile", "add.cu", "--target", "sm_90", "-o", "/nonexistent/dir/x.cubin"], ["-o"]),
        (["compil", "add.cu"], ["'compile'"]),
        (["compile", "add.cu", "--targt", "sm_90"], ["--target"]),
        (
            ["db", "upgrade", "--db-url", "postgresql+psycopg://kcache@127.0.0.1:1/nowhere"],
            ["--db-url", "127.0.0.1:1"],
        ),
        (
            ["db", "upgrade", "--db-url", "postgres://kcache:secret@127.0.0.1/x"],
            ["--db-url", "postgresql+psycopg://"],
        ),
        (["gc", "--cache-dir", "nowhere"], ["--cache-dir"]),
        (["gc", "--grace", "5"], ["--grace", "--force"]),
        # Issue 31 item 3: each refusal says its own reason and the accepted spelling.
        (["compile", "add.cu", "--target", "sm_90", "--flag=-O4"], ["--flag", "-dopt=on|off"]),
        (
            ["compile", "add.cu", "--target", "sm_90", "--flag=--use-fast-math"],
            ["--flag", "did you mean '--use_fast_math'?"],
        ),
        (["compile", "add.cu", "--target", "sm_90", "--flag=-arch=sm_80"], ["--target"]),
        (["compile", "add.cu", "--target", "sm_90", "--flag=-Iinc"], ["--include-set"]),
        (
            ["key", "add.cu", "--target", "sm_90", "--spec", "foo=[4,4"],
            ["--spec", "not valid JSON"],
        ),
        (["compile", "add.cu", "--target", "sm_90", "--flag", "-lineinfo"], ["--flag=-lineinfo"]),
    ],
)
def test_a_mistake_is_one_or_two_lines_naming_what_to_fix(
    home: Path, args: list[str], names: list[str]
) -> None:
    if args == ["compile", "add.cu"]:
        from kcache_client import NoDeviceError, auto_target

        try:
            auto_target()
            pytest.skip("this machine has a GPU: target auto resolves")
        except NoDeviceError:
            pass
    result = kcache(*args, env=user_env(home), cwd=home)
    lines = assert_user_error(result, *names)
    assert "secret" not in result.stderr  # a database password is never echoed
    assert "url=" not in "\n".join(lines) and "auto_target=" not in "\n".join(lines)
    # No flag is refused for reading or writing files unless it does (-I, traces, PCH).
    assert "read or write files" not in result.stderr
    assert "expected one argument" not in result.stderr  # argparse's bare words


@pytest.mark.parametrize(
    ("variable", "value", "args"),
    [
        ("KCACHE_PORT", "eighty", ["serve"]),
        ("KCACHE_INCLUDE_SETS", "{not json", ["serve"]),
        ("KCACHE_DB_URL", "postgresql://u@h/db", ["token", "list"]),
        ("KCACHE_LOCAL_COMPILE", "perhaps", ["get", "add.cu", "--target", "sm_90"]),
        ("KCACHE_URL", "127.0.0.1:8470", ["get", "add.cu", "--target", "sm_90"]),
        ("KCACHE_DEBUG", "very", ["key", "add.cu", "--target", "sm_90"]),
    ],
)
def test_a_bad_environment_value_names_the_variable(
    home: Path, variable: str, value: str, args: list[str]
) -> None:
    result = kcache(*args, env=user_env(home, **{variable: value}), cwd=home)
    assert_user_error(result, variable)


def test_an_empty_source_is_refused(home: Path) -> None:
    (home / "empty.cu").write_text("\n  \n")
    result = kcache("compile", "empty.cu", "--target", "sm_90", env=user_env(home), cwd=home)
    assert_user_error(result, "empty.cu")
    assert result.stdout == ""


def test_a_missing_header_gets_a_hint_about_the_flags(home: Path) -> None:
    (home / "m.cu").write_text('#include "nothere.h"\n' + VECTOR_ADD)
    result = kcache("compile", "m.cu", "--target", "sm_90", env=user_env(home), cwd=home)
    assert_user_error(result, "nothere.h", "--header", "--include-set")


def test_read_only_commands_create_nothing(home: Path) -> None:
    env = user_env(home)
    for args in (["stats"], ["token", "list"], ["db", "current"]):
        result = kcache(*args, "--data-dir", str(home / "nothing-here"), env=env, cwd=home)
        assert_user_error(result, "nothing-here", "--data-dir")
    assert not (home / "nothing-here").exists()
    assert_user_error(kcache("stats", env=env, cwd=home), ".kcache")  # the default is not created
    assert not (home / ".kcache").exists()


def test_stats_into_a_closed_pipe_is_quiet(server: Server, home: Path) -> None:
    proc = subprocess.Popen(
        [KCACHE, "stats", "--server", server.url],
        env=user_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # `| head` that has already gone
    stderr = proc.stderr.read().decode()
    assert proc.wait(60) == 141 and stderr == ""


def test_debug_shows_the_traceback(home: Path) -> None:
    args = ["compile", "add.cu", "--target", "sm_90", "--header", "a.h=nope.h"]
    assert "Traceback" in kcache("--debug", *args, env=user_env(home), cwd=home).stderr
    debug_env = user_env(home, KCACHE_DEBUG="1")
    assert "Traceback" in kcache(*args, env=debug_env, cwd=home).stderr


# ---------------------------------------------------------------------------- help
def test_version_help_defaults_and_suggestions(home: Path) -> None:
    env = user_env(home)
    version = kcache("--version", env=env)
    assert version.returncode == 0 and version.stdout.startswith("kcache-core 0.")
    gc_help = kcache("gc", "--help", env=env).stdout
    assert "(default: 3600.0)" in gc_help
    top = kcache("--help", env=env).stdout
    assert "$KCACHE_URL" in top and "$KCACHE_CACHE_DIR" in top and "$KCACHE_DATA_DIR" in top
    wrong = kcache("token", "lst", env=env)
    assert_user_error(wrong, "did you mean 'list'?")


def test_help_and_key_import_no_server_or_http_stack() -> None:
    """`kcache --help` and `kcache key` stay instant: building the parser loads none of these."""
    probe = (
        "import sys; from kcache.cli import build_parser; build_parser(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('fastapi', 'sqlalchemy', 'uvicorn', 'cuda', 'httpx', 'torch', 'pydantic', 'alembic')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------- issue 31
TEMPLATE = "template <typename T> __global__ void scale(T* x) { x[threadIdx.x] *= T(2); }\n"


def test_a_template_kernel_without_a_name_expression_is_refused_naming_the_fix(home: Path) -> None:
    """Item 3: NVRTC compiles it into a cubin with no kernel; kcache says so and how to fix it."""
    (home / "scale.cu").write_text(TEMPLATE)
    env = user_env(home)
    refused = kcache("compile", "scale.cu", "--target", "sm_90", env=env, cwd=home)
    assert_user_error(refused, "no kernel", "--name-expression 'scale<float>'")
    named = kcache(
        "compile",
        "scale.cu",
        "--target",
        "sm_90",
        "--name-expression",
        "scale<float>",
        env=env,
        cwd=home,
    )
    assert json.loads(named.stdout)["status"] == "compiled", named.stderr


def test_https_against_the_http_port_says_to_use_http(server: Server, home: Path) -> None:
    """Item 3: a TLS handshake with a plain-HTTP server is not "start the server"."""
    https = server.url.replace("http://", "https://")
    env = user_env(home)
    for args in (["compile", "add.cu", "--target", "sm_90"], ["doctor"]):
        result = kcache(*args, "--server", https, env=env, cwd=home, timeout=60)
        text = result.stdout + result.stderr
        assert result.returncode != 0 and f"http://{server.url[len('http://') :]}" in text, text
        assert "TLS" in text or "plain HTTP" in text, text
        assert "start the server" not in text and "start it" not in text, text
    assert_user_error(
        kcache("compile", "add.cu", "--target", "sm_90", "--server", https, env=env, cwd=home),
        "does not speak TLS",
        f"use {server.url}",
    )


def test_a_long_local_compile_says_it_is_working_and_stops_at_ctrl_c(home: Path) -> None:
    """Item 5: a status line on stderr while NVRTC works, and Ctrl-C honoured at once.

    The kernel never finishes compiling: before, nothing was printed and SIGINT waited
    for NVRTC's one C call to return (forever here). The bounds are liveness bounds.
    """
    import queue
    import signal
    import threading

    from tests.support import NEVER_FINISHES

    (home / "slow.cu").write_text(NEVER_FINISHES)
    proc = subprocess.Popen(
        [KCACHE, "compile", "slow.cu", "--target", "sm_90"],
        env=user_env(home, KCACHE_PROGRESS_S="0.2"),
        cwd=home,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As a terminal's Ctrl-C finds it, whatever this test runner does with SIGINT.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stderr is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr or ()], daemon=True).start()
    try:
        first = lines.get(timeout=60)
        assert first.startswith(STILL) and "slow.cu for sm_90" in first, first
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
    finally:
        proc.kill()
        proc.wait()
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    assert any("interrupted" in line for line in rest), rest


def _entries(env: dict[str, str], home: Path) -> list[dict[str, Any]]:
    listed = kcache("cache", "ls", "--json", env=env, cwd=home)
    assert listed.returncode == 0, listed.stderr
    entries: list[dict[str, Any]] = json.loads(listed.stdout)["entries"]
    return entries


def test_cache_keys_as_ls_prints_them_and_rm_of_a_shared_artifact(home: Path) -> None:
    """Item 4: `cache ls`'s 16 digits work in `cache rm`; a recipe's rm leaves others' blob."""
    env = user_env(home)
    (home / "twin.cu").write_text(VECTOR_ADD + "// the same code: the same cubin\n")
    files = {
        json.loads(kcache("compile", name, "--target", "sm_90", env=env, cwd=home).stdout)[
            "recipe_key"
        ]: name
        for name in ("add.cu", "twin.cu")
    }
    [entry] = _entries(env, home)
    assert sorted(entry["recipe_keys"]) == sorted(files)
    printed = kcache("cache", "ls", env=env, cwd=home).stdout.splitlines()[2].split()[0]
    assert len(printed) == 16  # what ls prints: one of the two keys, shortened
    first = next(k for k in files if k.startswith(printed))
    second = next(k for k in files if k != first)
    removed = kcache("cache", "rm", printed, env=env, cwd=home)
    assert removed.returncode == 0, removed.stderr
    assert "removed 1 recipe entry" in removed.stdout and "kept artifact" in removed.stdout
    [kept] = _entries(env, home)
    assert kept["recipe_keys"] == [second] and kept["digest"] == entry["digest"]
    again = kcache("get", files[second], "--target", "sm_90", env=env, cwd=home)
    assert json.loads(again.stdout)["status"] == "local_hit", again.stderr
    last = kcache("cache", "rm", second[:8], env=env, cwd=home)
    assert "removed 1 artifacts" in last.stdout, last.stderr
    assert _entries(env, home) == []
    assert_user_error(kcache("cache", "rm", "0000", env=env, cwd=home), "0000", "kcache cache ls")
    assert_user_error(kcache("cache", "rm", "xyz", env=env, cwd=home), "xyz", "hex digits")


def test_an_ambiguous_key_prefix_lists_the_candidates(home: Path) -> None:
    from kcache_client._tier import NodeTier

    from kcache.artifact import ArtifactMeta

    tier = NodeTier(home / "cache")
    for n in (1, 2):
        data = f"cubin {n}".encode() * 64
        digest = hashlib.sha256(data).hexdigest()
        meta = ArtifactMeta(
            digest=digest, size=len(data), kind="cubin", target="sm_90", toolchain="t"
        )
        tier.publish(f"abcd{n}".ljust(64, "0"), "f" * 64, meta, data)
    tier.flush()
    env = user_env(home)
    result = kcache("cache", "rm", "abcd", env=env, cwd=home)
    assert_user_error(result, "ambiguous", "abcd100000000000", "abcd200000000000")
    assert len(_entries(env, home)) == 2  # nothing removed
    assert kcache("cache", "rm", "abcd1", env=env, cwd=home).returncode == 0
    assert len(_entries(env, home)) == 1


def test_cache_clear_asks_first(home: Path) -> None:
    """Item 4: `cache clear` asks on a terminal, and without one wants --yes."""
    import os
    import pty

    env = user_env(home)
    assert kcache("compile", "add.cu", "--target", "sm_90", env=env, cwd=home).returncode == 0
    assert_user_error(kcache("cache", "clear", env=env, cwd=home), "--yes", "not a terminal")
    for answer, code, left in (("n\n", 1, 1), ("y\n", 0, 0)):
        leader, follower = pty.openpty()
        try:
            proc = subprocess.Popen(
                [KCACHE, "cache", "clear"],
                env=env,
                stdin=follower,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            os.write(leader, answer.encode())
            out, err = proc.communicate(timeout=60)
        finally:
            os.close(leader)
            os.close(follower)
        assert proc.returncode == code and "remove every entry" in err, (out, err)
        assert len(_entries(env, home)) == left
    assert kcache("compile", "add.cu", "--target", "sm_90", env=env, cwd=home).returncode == 0
    assert kcache("cache", "clear", "--yes", env=env, cwd=home).returncode == 0
    assert _entries(env, home) == []


def test_pins_take_prefixes_and_an_unknown_job_is_an_error(server: Server, home: Path) -> None:
    """Item 4: `pin --job <typo>` pins nothing and fails; keys may be prefixes."""
    env = user_env(home, KCACHE_URL=server.url, KCACHE_JOB_ID="story-job")
    (home / "pinned.cu").write_text(VECTOR_ADD.replace("add(", "pinned_add("))
    compiled = kcache("compile", "pinned.cu", "--target", "sm_90", env=env, cwd=home)
    key = json.loads(compiled.stdout)["recipe_key"]
    typo = kcache("pin", "--job", "story-jbo", env=env, cwd=home)
    assert_user_error(typo, "story-jbo", "no lookups")
    assert kcache("pin", "--job", "story-job", env=env, cwd=home).returncode == 0
    by_prefix = kcache("pin", key[:10], "--group", "story", env=env, cwd=home)
    assert by_prefix.returncode == 0, by_prefix.stderr
    listed = json.loads(kcache("pin", "--list", "--json", env=env, cwd=home).stdout)["pins"]
    assert {"recipe_key": key, "group": "story"}.items() <= next(
        p for p in listed if p["group"] == "story"
    ).items()
    unpinned = kcache("unpin", key[:10], "--group", "story", "--json", env=env, cwd=home)
    assert json.loads(unpinned.stdout)["unpinned"] == 1, unpinned.stderr


def test_server_rm_of_a_shared_artifact_asks_for_its_digest(server: Server, home: Path) -> None:
    env = user_env(home, KCACHE_URL=server.url)
    source = VECTOR_ADD.replace("add(", "shared_add(")
    keys = []
    for n in (1, 2):
        (home / f"s{n}.cu").write_text(source + f"// twin {n}\n")
        done = kcache("compile", f"s{n}.cu", "--target", "sm_80", env=env, cwd=home)
        keys.append(json.loads(done.stdout)["recipe_key"])
    digest = json.loads(done.stdout)["digest"]
    refused = kcache("cache", "rm", keys[0][:12], "--server", server.url, env=env, cwd=home)
    assert_user_error(refused, "other recipe key", digest)
    removed = kcache("cache", "rm", digest[:12], "--server", server.url, env=env, cwd=home)
    assert removed.returncode == 0 and "removed 1 artifacts" in removed.stdout, removed.stderr


def test_doctor_checks_the_token_and_ends_in_a_verdict(
    server: Server, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Item 5: a wrong token fails the doctor (it asks an authenticated route), one line a check."""
    root = tmp_path_factory.mktemp("tokened")
    env = user_env(root)
    data = str(root / "server-data")
    assert kcache("db", "upgrade", "--data-dir", data, env=env).returncode == 0
    made = kcache("token", "create", "doctor", "--scope", "read", "--data-dir", data, env=env)
    token = made.stdout.strip()
    tokened = Server(root)
    try:
        wrong = kcache("doctor", "--server", tokened.url, "--token", "kc_wrong", env=env)
        lines = wrong.stdout.strip().splitlines()
        assert wrong.returncode == 1 and lines[-1].startswith("kcache doctor: 1 of "), wrong.stdout
        assert lines[-1].endswith("failed: token")
        assert any(line.startswith("FAIL  token") and "--token" in line for line in lines)
        assert any(line.startswith("ok    versions") and "kcache-client " in line for line in lines)
        right = kcache("doctor", "--server", tokened.url, env=user_env(root, KCACHE_TOKEN=token))
        assert right.returncode == 0 and "all " in right.stdout.splitlines()[-1], right.stdout
        report = json.loads(
            kcache("doctor", "--json", "--server", tokened.url, "--token", "x", env=env).stdout
        )
        assert report["ok"] is False
        assert {c["name"]: c["status"] for c in report["checks"]}["token"] == "fail"
    finally:
        tokened.stop()
    open_server = kcache("doctor", "--server", server.url, "--token", "anything", env=env)
    assert "warn  token" in open_server.stdout and "open" in open_server.stdout


def test_config_shows_each_setting_and_where_it_came_from(home: Path) -> None:
    """Item 5: `kcache config`, the `ccache --show-config` of the client."""
    env = user_env(home, KCACHE_RETRY_BUDGET_S="7", KCACHE_TOKEN="kc_secret_token")
    result = kcache("config", "--json", "--server", "http://127.0.0.1:1", env=env, cwd=home)
    assert result.returncode == 0, result.stderr
    rows = {r["setting"]: r for r in json.loads(result.stdout)}
    assert rows["url"]["source"] == "flag (--server)"
    assert (rows["retry.budget_s"]["value"], rows["retry.budget_s"]["source"]) == (
        "7 s",
        "environment (KCACHE_RETRY_BUDGET_S)",
    )
    assert rows["token"]["value"] == "(set)" and "kc_secret_token" not in result.stdout
    assert rows["cache_dir"]["source"] == "environment (KCACHE_CACHE_DIR)"
    assert rows["timeout.connect"]["source"].startswith("command default")
    assert rows["memory_entries"]["source"] == "default"
    text = kcache("config", env=env, cwd=home).stdout
    assert "retry.budget_s" in text and "environment (KCACHE_RETRY_BUDGET_S)" in text
    # Each row names the variable that sets it, a default one too (the table had none).
    lines = text.splitlines()
    assert lines[0].split() == ["SETTING", "VARIABLE", "VALUE", "SOURCE"]
    memory = next(line for line in lines if line.startswith("memory_entries "))
    assert memory.split()[:2] == ["memory_entries", "KCACHE_MEMORY_ENTRIES"], memory


def test_stats_of_a_cache_directory_needs_no_server(home: Path) -> None:
    """Item 5: `kcache stats --cache-dir`, the node tier's own numbers (`ccache -s`)."""
    env = user_env(home)
    assert kcache("compile", "add.cu", "--target", "sm_90", env=env, cwd=home).returncode == 0
    shown = kcache("stats", "--cache-dir", str(home / "cache"), env=env, cwd=home)
    assert shown.returncode == 0, shown.stderr
    assert "entries        1" in shown.stdout and "oldest use" in shown.stdout
    typo = kcache("stats", "--cache-dir", str(home / "cahce"), env=env, cwd=home)
    assert_user_error(typo, "cahce", "--cache-dir")
    assert not (home / "cahce").exists()  # a read-only command creates nothing
    as_json = kcache("stats", "--cache-dir", str(home / "cache"), "--json", env=env)
    assert json.loads(as_json.stdout)["entries"] == 1


def test_stats_name_lookups_without_a_job_and_serve_names_the_dashboard(
    server: Server, home: Path
) -> None:
    """Item 6: no `None` row; `kcache serve` says where its dashboard is."""
    (home / "jobbed.cu").write_text(VECTOR_ADD.replace("add(", "jobbed_add("))
    for extra in ({"KCACHE_JOB_ID": "stats-job"}, {}):
        env = user_env(home, KCACHE_URL=server.url, **extra)
        assert (
            kcache("compile", "jobbed.cu", "--target", "sm_80", env=env, cwd=home).returncode == 0
        )
    table = kcache("stats", "--server", server.url, "--group-by", "job", env=user_env(home)).stdout
    rows = [line.split()[0] for line in table.splitlines() if line.strip()]
    assert "stats-job" in rows and "(no" in rows and "None" not in rows, table
    assert f"{server.url}/dashboard" in server.log.read_text()
