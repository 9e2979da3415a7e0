"""The engine over the local backends: hit after compile, negative entries, locks, processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from kcache.artifact import CompileOutput
from kcache.compilers import InProcessCompiler
from kcache.errors import ArtifactNotFoundError, CompileError
from kcache.local_engine import open_local_engine
from kcache.recipe import Recipe
from tests.support import KCACHE, VECTOR_ADD


def test_compile_then_hit_with_the_same_artifact(tmp_path: Path) -> None:
    engine = open_local_engine(tmp_path)
    recipe = Recipe(source=VECTOR_ADD, target="sm_90")
    first = engine.resolve(recipe)
    second = open_local_engine(tmp_path).resolve(recipe)
    assert (first.status, second.status) == ("compiled", "hit")
    assert first.artifact.digest == second.artifact.digest
    assert engine.read(second.artifact)[:4] == b"\x7fELF"
    assert first.artifact.kernel == "add"


def test_miss_without_compile(tmp_path: Path) -> None:
    with pytest.raises(ArtifactNotFoundError):
        open_local_engine(tmp_path).resolve(
            Recipe(source=VECTOR_ADD, target="sm_90"), compile=False
        )


def test_broken_recipe_is_compiled_once(tmp_path: Path) -> None:
    engine = open_local_engine(tmp_path)
    broken = Recipe(source='extern "C" __global__ void k(float* o) { o[0] = ; }', target="sm_90")
    with pytest.raises(CompileError) as first:
        engine.resolve(broken)
    assert not first.value.cached
    with pytest.raises(CompileError) as second:
        open_local_engine(tmp_path).resolve(broken)
    assert second.value.cached and second.value.log == first.value.log
    assert second.value.recipe_key == broken.with_defaults(toolchain=engine.toolchain_id).key()


def test_missing_blob_is_recompiled(tmp_path: Path) -> None:
    engine = open_local_engine(tmp_path)
    recipe = Recipe(source=VECTOR_ADD, target="sm_90")
    digest = engine.resolve(recipe).artifact.digest
    engine.store.delete(digest)
    again = engine.resolve(recipe)
    assert again.status == "compiled" and again.artifact.digest == digest


def test_eight_processes_compile_once(tmp_path: Path) -> None:
    source = tmp_path / "k.cu"
    source.write_text(VECTOR_ADD.replace("x[i] + y[i]", "x[i] * y[i] + 8.0f"))
    data = tmp_path / "data"
    procs = [
        subprocess.Popen(
            [KCACHE, "compile", str(source), "--target", "sm_90", "--cache-dir", str(data)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out))
    statuses = sorted(r["status"] for r in results)
    assert statuses.count("compiled") == 1, statuses
    assert set(statuses) <= {"compiled", "waited", "local_hit"}  # a late one finds it cached
    assert len({r["digest"] for r in results}) == 1


_HOLDER = """
import sys, time
from kcache.locks import FileKeyLock
with FileKeyLock(sys.argv[1]).hold(sys.argv[2], timeout=5):
    print("held", flush=True)
    time.sleep(600)
"""


def test_sigkilled_lock_holder_does_not_block_the_next_compile(tmp_path: Path) -> None:
    engine = open_local_engine(tmp_path)
    recipe = Recipe(source=VECTOR_ADD, target="sm_90").with_defaults(toolchain=engine.toolchain_id)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path), recipe.key()],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    started = time.monotonic()
    result = engine.resolve(recipe)
    assert result.status == "compiled"
    assert time.monotonic() - started < 60  # the kernel released the flock; no lock-timeout wait


def test_correctness_does_not_depend_on_the_lock(tmp_path: Path) -> None:
    """Two engines whose locks never exclude each other (as on a filesystem that grants
    flock to everyone) both compile at the same time and agree on one valid artifact."""
    barrier = threading.Barrier(2, timeout=60)

    class NoLock:
        @contextmanager
        def hold(self, key: str, timeout: float) -> Iterator[bool]:
            yield False

    class RendezvousCompiler(InProcessCompiler):
        def compile(self, recipe: Recipe, link_inputs: Sequence[bytes] = ()) -> CompileOutput:
            barrier.wait()  # both engines are past their index check: both really compile
            return super().compile(recipe, link_inputs)

    engines = [open_local_engine(tmp_path) for _ in range(2)]
    for engine in engines:
        engine.lock = NoLock()
        engine.compiler = RendezvousCompiler(engine.compiler.toolchain)
    recipe = Recipe(source=VECTOR_ADD, target="sm_90")
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda e: e.resolve(recipe), engines))
    assert [r.status for r in results] == ["compiled", "compiled"]
    assert results[0].artifact.digest == results[1].artifact.digest
    assert engines[0].read(results[1].artifact) == engines[1].read(results[0].artifact)
    assert engines[0].resolve(recipe).status == "hit"


def test_cli_prints_compiler_log_on_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k(float* o) { o[0] = ; }')
    proc = subprocess.run(
        [KCACHE, "compile", str(bad), "--target", "sm_90", "--cache-dir", str(tmp_path / "d")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert "expected an expression" in proc.stderr and proc.stdout == ""
