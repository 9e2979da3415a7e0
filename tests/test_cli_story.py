"""The ``kcache`` command as a user meets it: one story, honest messages, no tracebacks.

Every command runs as a real process with a clean environment; one real server serves
the module. Each mistake a user can make ends in one or two lines on stderr that name
the flag, file or variable to fix, a non-zero exit, and no traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli_harness import PROGRESS, Served, assert_user_error, kcache, user_env
from tests.support import KCACHE, VECTOR_ADD, free_port


class Server:
    """``kcache serve`` on an ephemeral port, with its data directory."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.data_dir = root / "server-data"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = user_env(root, KCACHE_DATA_DIR=str(self.data_dir))
        self.served = Served(
            [KCACHE, "serve", "--port", str(self.port)], env=env, cwd=root, log=root / "serve.log"
        )
        self.served.wait_ready(f"{self.url}/readyz")

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(f"{self.url}/v1/stats?since=1h", timeout=10) as response:
            totals: dict[str, int] = json.load(response)["totals"]
            return totals


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("story"))
    yield running
    running.served.stop()


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
    gone.served.stop()
    for command in ("compile", "get"):
        answered = kcache(command, "add.cu", "--target", "sm_90", env=env, cwd=home, timeout=30)
        assert answered.returncode == 0, answered.stderr
        assert json.loads(answered.stdout)["status"] == "local_hit"  # the same tier, the same word
        if command == "compile":  # it asked the server first: a status line, then what happened
            assert PROGRESS in answered.stderr
            assert f"server unreachable at {gone.url}; answered from the cache" in answered.stderr
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
    assert version.returncode == 0 and version.stdout.startswith("kcache 0.")
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
