"""One lookup per call, counted once with the outcome the caller saw, on every client path.

Against a real ``kcache serve`` started once for the module: around each call (a
``KernelCache`` method, or the ``kcache`` command) the server's two books are read,
``kcache_lookups_total`` on ``/metrics`` (counted as each lookup is audited) and
``/v1/stats`` (the audit rows; it writes what is queued before answering), and each
must have grown by exactly the lookups of the call, with their outcomes. Both are
final once the call returns: the server audits before it answers, and a cache's
audit events (its memory and node-tier hits) are delivered when it closes.

A first ``get`` used to count two lookups: the fetch's 404 as a ``miss``, then the
resolve's ``compiled``.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from client_harness import KcacheServer, kernels, start_server
from kcache_client import (
    ClientSettings,
    KernelCache,
    RemoteCompileError,
    RemoteNotFoundError,
)
from prometheus_client.parser import text_string_to_metric_families

from kcache import Recipe
from kcache.artifact_header import ON_MISS_HEADER, ON_MISS_RESOLVE
from tests.cli_harness import kcache, user_env
from tests.support import FAST

BROKEN = 'extern "C" __global__ void broken(float* x) { x[0] = undeclared; }\n'


class Books:
    """The module's server and its two counts of lookups by outcome."""

    def __init__(self, server: KcacheServer) -> None:
        self.server = server
        self.url = server.url

    def metrics(self) -> Counter[str]:
        """``kcache_lookups_total`` by outcome (every tier summed)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).raise_for_status().text
        counts: Counter[str] = Counter()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "kcache_lookups_total":
                    counts[sample.labels["outcome"]] += int(sample.value)
        return counts

    def stats(self) -> Counter[str]:
        """``/v1/stats``: what the server saw and what clients reported, by outcome."""
        body = httpx.get(f"{self.url}/v1/stats", timeout=30).raise_for_status().json()
        counts: Counter[str] = Counter()
        for side in ("totals", "reported"):
            counts.update({outcome: int(n) for outcome, n in body[side].items()})
        assert body["lookups"] == sum(counts.values())
        return counts

    @contextmanager
    def lookups(self, **expected: int) -> Iterator[None]:
        """The block's calls count exactly ``expected`` (outcome -> lookups) in both books."""
        metrics, stats = self.metrics(), self.stats()
        yield
        grown_metrics = _grown(metrics, self.metrics())
        grown_stats = _grown(stats, self.stats())
        assert (grown_metrics, grown_stats) == (expected, expected), (
            f"expected {expected}; /metrics grew by {grown_metrics}, /v1/stats by {grown_stats}"
        )


def _grown(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in sorted(after) if after[k] != before[k]}


@pytest.fixture(scope="module")
def books(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Books]:
    server = start_server(tmp_path_factory.mktemp("lookup-counts") / "data")
    yield Books(server)
    server.stop()  # fails on a traceback in the server's log


def _cache(books: Books, tier: Path) -> KernelCache:
    """A cache that reports its tier hits (the default), with the server's target fixed."""
    settings = ClientSettings.from_env(auto_target="sm_80", retry=FAST)
    return KernelCache(books.url, cache_dir=tier, settings=settings)


def _held(books: Books, tmp_path: Path, recipes: Sequence[Recipe]) -> None:
    """Have the server compile ``recipes`` (through a cache of its own, not counted)."""
    with _cache(books, tmp_path / "seed") as seed:
        for recipe in recipes:
            seed.get(recipe)


def _get(books: Books, tmp_path: Path) -> None:
    """``get``: a compile, a node-tier hit, a warm fetch, a memory hit."""
    (recipe,) = kernels(1, "get", target="sm_80")
    with books.lookups(compiled=1), _cache(books, tmp_path / "a") as cache:
        assert cache.get(recipe).outcome == "compiled"  # the fetch's 404 is not a lookup
    with books.lookups(local_hit=1), _cache(books, tmp_path / "a") as cache:
        assert cache.get(recipe).origin == "node"  # another process of the node
    with books.lookups(hit=1), _cache(books, tmp_path / "b") as cache:
        assert cache.get(recipe).origin == "server"  # one request: the warm fetch
    with books.lookups(hit=1, local_hit=1), _cache(books, tmp_path / "c") as cache:
        assert cache.get(recipe).origin == "server"
        assert cache.get(recipe).origin == "memory"  # reported when the cache closes


def _get_misses_and_errors(books: Books, tmp_path: Path) -> None:
    """``get(compile=False)`` of an absent recipe, and a recipe that does not compile."""
    (absent,) = kernels(1, "absent", target="sm_80")
    with (
        books.lookups(miss=1),
        _cache(books, tmp_path) as cache,
        pytest.raises(RemoteNotFoundError),
    ):
        cache.get(absent, compile=False)
    with books.lookups(error=2), _cache(books, tmp_path) as cache:
        for _ in range(2):  # compiled and failed; then the fetch answers the recorded failure
            with pytest.raises(RemoteCompileError):
                cache.get(Recipe(source=BROKEN, target="sm_80"))


def _compile(books: Books, tmp_path: Path) -> None:
    """``get(refresh=True)`` (what ``kcache compile`` runs): one resolve."""
    (recipe,) = kernels(1, "refresh", target="sm_80")
    with books.lookups(compiled=1), _cache(books, tmp_path) as cache:
        assert cache.get(recipe, refresh=True).outcome == "compiled"
    with books.lookups(hit=1), _cache(books, tmp_path) as cache:
        assert cache.get(recipe, refresh=True).outcome == "hit"  # asked although the tier has it


def _get_many_and_warmup(books: Books, tmp_path: Path) -> None:
    """A batch (a recipe twice in it is one lookup) and a warmup of one process."""
    fresh, held, local = kernels(3, "many", target="sm_80")
    _held(books, tmp_path, [held])
    with _cache(books, tmp_path / "tier") as cache:
        cache.get(local)  # (counted, but not in the block below)
    with books.lookups(compiled=1, hit=1, local_hit=1), _cache(books, tmp_path / "tier") as cache:
        results = cache.get_many([fresh, held, local, fresh])
        outcomes = [getattr(r, "outcome", r) for r in results]
        assert outcomes == ["compiled", "hit", "local_hit", "compiled"]

    other_fresh, other_held = kernels(2, "warm", target="sm_80")
    _held(books, tmp_path, [other_held])
    with books.lookups(compiled=1, hit=1), _cache(books, tmp_path / "warm") as cache:
        result = cache.warmup([other_fresh, other_held], progress=False)
        assert result.statuses == ["compiled", "hit"]


def _plain_fetches(books: Books) -> None:
    """A fetch by anyone else is its own lookup: its 404 is a miss, unless a resolve follows."""
    url = f"{books.url}/v1/recipes/{'0' * 64}/artifact"
    with books.lookups(miss=1):
        assert httpx.get(url, timeout=10).status_code == 404  # curl's fetch: nothing follows
    with books.lookups():  # the caller's resolve will be the lookup
        said = {ON_MISS_HEADER: ON_MISS_RESOLVE}
        assert httpx.get(url, headers=said, timeout=10).status_code == 404


def test_every_kernel_cache_call_counts_one_lookup_per_recipe(books: Books, tmp_path: Path) -> None:
    _get(books, tmp_path / "get")
    _get_misses_and_errors(books, tmp_path / "misses")
    _compile(books, tmp_path / "compile")
    _get_many_and_warmup(books, tmp_path / "many")
    _plain_fetches(books)


def _command(books: Books, home: Path, verb: str, source: Path, *flags: str) -> str:
    result: subprocess.CompletedProcess[str] = kcache(
        verb, str(source), "--target", "sm_80", "--server", books.url, *flags, env=user_env(home)
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_command_counts_one_lookup_per_call(books: Books, tmp_path: Path) -> None:
    (recipe,) = kernels(1, "cli", target="sm_80")
    source = tmp_path / "kernel.cu"
    source.write_text(recipe.source)
    with books.lookups(compiled=1):
        assert '"compiled"' in _command(books, tmp_path / "u1", "get", source)
    with books.lookups(local_hit=1):  # the user's cache directory answers, and says so
        assert '"local_hit"' in _command(books, tmp_path / "u1", "get", source)
    with books.lookups(hit=1):
        assert '"hit"' in _command(books, tmp_path / "u2", "get", source)
    with books.lookups(hit=1):  # compile asks the server whatever the directory holds
        assert '"hit"' in _command(books, tmp_path / "u1", "compile", source)

    (other,) = kernels(1, "cli-compile", target="sm_80")
    source.write_text(other.source)
    with books.lookups(compiled=1):
        assert '"compiled"' in _command(books, tmp_path / "u3", "compile", source)
    (absent,) = kernels(1, "cli-absent", target="sm_80")
    source.write_text(absent.source)
    with books.lookups(miss=1):
        result = kcache(
            "get",
            str(source),
            "--target",
            "sm_80",
            "--server",
            books.url,
            "--no-compile",
            env=user_env(tmp_path / "u4"),
        )
        assert result.returncode != 0 and "--no-compile" in result.stderr
