"""The ``Index`` contract, run against FileIndex and SqlIndex on SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kcache.artifact import ArtifactMeta, CompileFailure
from kcache.deps import Dependency
from kcache.index.base import MANIFEST_LIMIT, Index
from kcache.index.file import FileIndex
from tests.support import upgrade


def h(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def meta(name: str, deps: tuple[Dependency, ...] = ()) -> ArtifactMeta:
    return ArtifactMeta(
        digest=h(name),
        size=10,
        kind="cubin",
        target="sm_80",
        toolchain="tc",
        lowered_names={"f<1>": "_Z1fILi1EEvv"},
        compile_seconds=0.25,
        log="ok",
        dependencies=deps,
        dependencies_exact=True,
        kernel="f",
        created_at=1_700_000_000.5,
    )


@pytest.fixture(params=["file", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def index(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Index]:
    if request.param == "file":
        yield FileIndex(tmp_path)
        return
    from kcache_server.db import open_database
    from kcache_server.index import SqlIndex

    url = (
        f"sqlite:///{tmp_path / 'i.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("pg_url")
    )
    upgrade(url)
    engine = open_database(url)
    yield SqlIndex(engine)
    engine.dispose()


def test_artifacts_aliases_and_failures(index: Index) -> None:
    assert isinstance(index, Index)
    key, other, base = h("k1"), h("k2"), h("b")
    assert index.lookup(key) is None
    m = meta("a", (Dependency("x.h", h("x")),))
    index.record_artifact(key, base, m)
    assert index.lookup(key) == m
    assert index.artifact(m.digest) == m
    index.record_failure(CompileFailure(other, "error: nope", 1_700_000_001.0))
    failure = index.lookup(other)
    assert isinstance(failure, CompileFailure) and failure.log == "error: nope"
    index.record_alias(other, m.digest)  # a manifest match replaces the negative entry
    assert index.lookup(other) == m
    index.forget(other)
    assert index.lookup(other) is None and index.lookup(key) == m


def test_manifests_are_newest_first_and_bounded(index: Index) -> None:
    base = h("base")
    for i in range(MANIFEST_LIMIT + 3):
        index.record_artifact(h(f"key{i}"), base, meta(f"a{i}", (Dependency("x.h", h(f"x{i}")),)))
    entries = index.manifest(base)
    assert len(entries) == MANIFEST_LIMIT
    assert entries[0].digest == h(f"a{MANIFEST_LIMIT + 2}")  # the newest first
    assert entries[-1].digest == h("a3")  # the three oldest fell off
    assert entries[0].dependencies == (Dependency("x.h", h(f"x{MANIFEST_LIMIT + 2}")),)
    # Recording the same dependency list again moves it to the front, without a duplicate.
    index.record_artifact(h("again"), base, meta("a5", (Dependency("x.h", h("x5")),)))
    entries = index.manifest(base)
    assert entries[0].digest == h("a5") and len(entries) == MANIFEST_LIMIT
    assert [e.digest for e in entries].count(h("a5")) == 1
    assert index.manifest(h("nothing")) == []


def test_a_new_artifact_reads_back_as_made(index: Index) -> None:
    """Metadata made now (default ``created_at``) equals the row read back: a server that
    answers from what it just compiled and a replica reading the index say the same."""
    fresh = [
        ArtifactMeta(digest=h(f"now{i}"), size=1, kind="cubin", target="sm_90", toolchain="tc")
        for i in range(50)
    ]
    for i, m in enumerate(fresh):
        index.record_artifact(h(f"key{i}"), h("base"), m)
    assert [index.lookup(h(f"key{i}")) for i in range(50)] == fresh


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_the_lru_choice_is_the_policys_over_every_unpinned_row(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The query only fetches candidates (in order, streamed); kcache.eviction chooses."""
    import dataclasses
    from datetime import datetime, timedelta, timezone

    import sqlalchemy as sa
    from kcache_server.db import open_database
    from kcache_server.index import SqlIndex
    from kcache_server.pins import PinStore

    from kcache.eviction import LruCandidate, least_recently_used

    url = (
        f"sqlite:///{tmp_path / 'i.db'}"
        if backend == "sqlite"
        else request.getfixturevalue("pg_url")
    )
    upgrade(url)
    engine = open_database(url)
    index = SqlIndex(engine)
    base = datetime(2026, 1, 1, tzinfo=timezone.utc)
    candidates: list[LruCandidate] = []
    for i in range(40):
        made = dataclasses.replace(meta(f"lru {i}"), size=1000 + i)
        index.record_artifact(h(f"recipe {i}"), h(f"base {i}"), made)
        used = base + timedelta(minutes=(i * 7) % 40)  # recency unrelated to insertion order
        # A third were never served: their creation is their last use.
        column = "created_at" if i % 3 == 0 else "last_used_at"
        with engine.begin() as conn:
            conn.execute(
                sa.text(f"UPDATE artifacts SET {column} = :t WHERE digest = :d"),
                {"t": used, "d": made.digest},
            )
        if i != 5:
            candidates.append(LruCandidate(made.digest, made.size, used.timestamp()))
    PinStore(engine).add([h("recipe 5")], "g", "test")  # never chosen, whatever its age
    for to_free in (0, 1, 5_000, 20_000, 10**9):
        expected = [c.name for c in least_recently_used(candidates, to_free)]
        assert index.least_recently_used(to_free) == expected, to_free
    engine.dispose()
