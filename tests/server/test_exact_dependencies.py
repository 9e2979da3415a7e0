"""Exact dependencies through the server: a worker that answered a failed compile never records again.

NVRTC's traces are short in a process that saw a failed compile; a compile worker is
such a process once it answers one typo. These tests drive real workers over HTTP
with random sequences of failing and good compiles (tests/deps_workload.py) and
check each good compile's recorded dependencies against the model's truth, and that
every edit of a header it read is a miss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from kcache.deps import PROBE
from tests.deps_workload import OTHER_SAMPLE_SEEDS, SET_NAME, run_sequence, sequence_seeds
from tests.support import ServerThread

#: Random sequences in a --slow run (tests.deps_workload.SAMPLE_SEEDS otherwise).
SEQUENCES = 6

ADD = "__device__ float add(float a, float b) { return a + b; }\n"
MUL = "__device__ float mul(float a, float b) { return a * b; }\n"
TWO_HEADERS = (
    "#include <add.cuh>\n#include <mul.cuh>\n"
    'extern "C" __global__ void k(float* o) { o[0] = mul(add(o[0], 1.0f), 2.0f); }\n'
)


def _start(root: Path, name: str, workers: int) -> ServerThread:
    from kcache_server import Settings

    (root / "set").mkdir(parents=True, exist_ok=True)
    return ServerThread(
        Settings(
            data_dir=root / name,
            compile_workers=workers,
            audit={"flush_s": 0.05},
            auth_cache_s=0.0,
            include_sets={SET_NAME: root / "set"},
        )
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("exact-deps")


@pytest.fixture(scope="module")
def one_worker(root: Path) -> Iterator[ServerThread]:
    server = _start(root, "one", 1)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def two_workers(root: Path) -> Iterator[ServerThread]:
    server = _start(root, "two", 2)
    yield server
    server.stop()


def _resolver(server: ServerThread) -> Callable[[dict[str, Any]], tuple[str, list[str]]]:
    client = httpx.Client(base_url=server.url, timeout=120)

    def resolve(recipe: dict[str, Any]) -> tuple[str, list[str]]:
        answer = client.post("/v1/resolve", json={"recipe": recipe})
        if answer.status_code == 422:
            return "error", []
        assert answer.status_code == 200, answer.text
        body = answer.json()
        return body["status"], [
            d["name"] for d in body["artifact"]["dependencies"] if PROBE not in d["name"]
        ]

    return resolve


def test_the_issue_case_a_typo_then_a_header_edit_is_a_miss(one_worker: ServerThread) -> None:
    resolve = _resolver(one_worker)
    assert (
        resolve(
            {
                "source": "#include <bad.cuh>\n",
                "headers": {"bad.cuh": "#error x\n"},
                "target": "sm_90",
            }
        )[0]
        == "error"
    )
    headers = {"add.cuh": ADD, "mul.cuh": MUL}
    recipe = {"source": TWO_HEADERS, "headers": headers, "target": "sm_90"}
    assert resolve(recipe) == ("compiled", ["add.cuh", "mul.cuh"])
    edited = {**recipe, "headers": {**headers, "add.cuh": ADD.replace("a + b", "a - b")}}
    assert resolve(edited)[0] == "compiled"
    assert one_worker.state.backends.compiler.restarts >= 1  # the worker that failed retired


def test_random_sequences_in_one_worker_record_exactly_what_was_read(
    one_worker: ServerThread, root: Path
) -> None:
    seeds = sequence_seeds(SEQUENCES)
    print(f"exact-dependency sequences (one worker): seeds {seeds}")
    resolve = _resolver(one_worker)
    mismatches = [m for seed in seeds for m in run_sequence(seed, root / "set", resolve)]
    assert not mismatches, mismatches


def test_two_workers_interleaving_failures_and_good_compiles(
    two_workers: ServerThread, root: Path
) -> None:
    seeds = sequence_seeds(4, OTHER_SAMPLE_SEEDS)  # not the other test's: the set is shared
    print(f"exact-dependency sequences (two workers): seeds {seeds}")
    resolve = _resolver(two_workers)
    with ThreadPoolExecutor(2) as pool:
        found = pool.map(lambda seed: list(run_sequence(seed, root / "set", resolve)), seeds)
        mismatches = [m for batch in found for m in batch]
    assert not mismatches, mismatches


def test_a_name_expression_typo_answers_nvrtcs_message(one_worker: ServerThread) -> None:
    recipe = {
        "source": "template <typename T> __global__ void scale(T* x) { x[0] *= T(2); }\n",
        "name_expressions": ["scale<flaot>"],
        "target": "sm_90",
    }
    with httpx.Client(base_url=one_worker.url, timeout=120) as client:
        answer = client.post("/v1/resolve", json={"recipe": recipe})
    assert answer.status_code == 422, answer.text
    assert "unlisted_include" not in answer.text
    assert answer.json()["error"] == "compile_error", answer.text
    assert 'identifier \\"flaot\\" is undefined' in answer.text, answer.text


def test_sql_lists_recorded_before_the_proof_never_serve_a_manifest_match(
    one_worker: ServerThread,
) -> None:
    """Rows as an earlier release left them (0008 gives them dependency_check 0), with the short
    list a spoiled worker recorded: the edit compiles, and the artifact row is replaced."""
    import sqlalchemy as sa
    from kcache_server.models import Artifact, ManifestRow

    from kcache.deps import DEPENDENCY_CHECK

    resolve = _resolver(one_worker)
    headers = {"add.cuh": ADD, "mul.cuh": MUL}
    source = TWO_HEADERS + "// sql legacy\n"
    with httpx.Client(base_url=one_worker.url, timeout=120) as client:
        first = client.post(
            "/v1/resolve",
            json={"recipe": {"source": source, "headers": headers, "target": "sm_90"}},
        ).json()
    digest, base = first["artifact"]["digest"], first["base_key"]
    short = [d for d in first["artifact"]["dependencies"] if d["name"] == "mul.cuh"]
    engine = one_worker.state.backends.index.engine
    with engine.begin() as conn:
        conn.execute(
            sa.update(Artifact)
            .where(Artifact.digest == digest)
            .values(dependency_check=0, dependencies=short)
        )
        conn.execute(
            sa.update(ManifestRow)
            .where(ManifestRow.base_key == base)
            .values(dependency_check=0, dependencies=short)
        )
    edit = {**headers, "add.cuh": ADD + "// unseen by the old list\n"}
    status, deps = resolve({"source": source, "headers": edit, "target": "sm_90"})
    assert status == "compiled"
    assert deps == ["add.cuh", "mul.cuh"]
    with engine.connect() as conn:
        row = conn.execute(sa.select(Artifact).where(Artifact.digest == digest)).one()
    assert row.dependency_check == DEPENDENCY_CHECK
    assert [d["name"] for d in row.dependencies] == ["add.cuh", "mul.cuh"]


def test_the_upgrade_marks_every_existing_row_unproven(tmp_path: Path) -> None:
    import sqlalchemy as sa
    from alembic import command
    from kcache_server.migrate import alembic_config

    url = f"sqlite:///{tmp_path / 'old.db'}"
    command.upgrade(alembic_config(url), "0007")
    engine = sa.create_engine(url)
    now = "2026-11-30 00:00:00.000000"
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO artifacts (digest, size, kind, target, toolchain, kernel, lowered_names, "
                "compile_seconds, log, dependencies, dependencies_exact, created_at, recovered) "
                f"VALUES ('{'a' * 64}', 1, 'cubin', 'sm_90', 't', 'k', '{{}}', 0, '', '[]', 1, '{now}', 0)"
            )
        )
    command.upgrade(alembic_config(url), "head")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT dependency_check FROM artifacts")).scalar_one() == 0
    engine.dispose()
