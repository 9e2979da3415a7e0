"""A KernelCache used wrongly says so in its own words: after close(), with something that is no
recipe, or over a cache directory it cannot use.

Each was a bare Python error from deep inside: ``RuntimeError: the lean HTTP client has been
closed`` (while a cache without a server went on serving), ``AttributeError: 'NoneType' object
has no attribute 'target'``, ``FileExistsError``, ``NotADirectoryError``, ``OSError: [Errno 30]``.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
from kcache_client import CacheClosedError, ClientSettings, KernelCache

from kcache import Recipe
from kcache.artifact import ArtifactMeta
from kcache.dirs import LAYOUT_FILE
from kcache.errors import KCacheError
from kcache.job_manifest import JobManifest
from tests.support import FAST, free_port


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KCACHE_URL", "KCACHE_CACHE_DIR", "KCACHE_LOCAL_COMPILE", "KCACHE_OFFLINE"):
        monkeypatch.delenv(name, raising=False)


def _recipe(tag: str) -> Recipe:
    src = f'extern "C" __global__ void k_{tag}(float* x) {{ x[threadIdx.x] += 1.0f; }}\n'
    return Recipe(source=src, target="sm_80", toolchain="t" * 8)


def _caches(tmp_path: Path) -> list[KernelCache]:
    """One cache with a (dead) server, one without."""
    dead = f"http://127.0.0.1:{free_port()}"
    server = ClientSettings.from_env(retry=FAST, local_compile=False, send_events=False)
    return [
        KernelCache(dead, cache_dir=tmp_path / "with", settings=server),
        KernelCache(url="", cache_dir=tmp_path / "without"),
    ]


# ------------------------------------------------------------------ after close()
_USES: dict[str, Any] = {
    "get": lambda c, r: c.get(r),
    "get_many": lambda c, r: c.get_many([r]),
    "key": lambda c, r: c.key(r),
    "warmup": lambda c, r: c.warmup([r]),
    "prefetch": lambda c, r: c.prefetch(JobManifest.of([], "job")),
    "job_manifest": lambda c, r: c.job_manifest("job"),
    "toolchains": lambda c, r: c.toolchains(),
    "check_withdrawals": lambda c, r: c.check_withdrawals(),
}


@pytest.mark.parametrize("use", sorted(_USES))
def test_a_closed_cache_says_so_with_a_server_and_without(tmp_path: Path, use: str) -> None:
    for cache in _caches(tmp_path):
        recipe = _recipe("closed")
        cache.close()
        with pytest.raises(CacheClosedError, match=r"KernelCache was closed.*make a new"):
            _USES[use](cache, recipe)
        cache.close()  # still idempotent


def test_a_closed_cache_refuses_what_its_memory_holds_too(tmp_path: Path) -> None:
    """One behaviour whatever the cache holds (close()'s docstring says so)."""
    cache = KernelCache(url="", cache_dir=tmp_path)
    recipe = _recipe("mem")
    meta = ArtifactMeta(digest="b" * 64, size=4, kind="cubin", target="sm_80", toolchain="t" * 8)
    lookup = cache._lookup  # a kernel in memory, as a hit leaves it
    art = lookup._remember(lookup._artifact(recipe.key(), recipe, meta, b"\x7fELF", "node", None))
    assert cache.get(recipe).origin == "memory"
    assert cache._lookup.memory.get(art.recipe_key) is not None
    with cache:
        pass
    with pytest.raises(CacheClosedError):
        cache.get(_recipe("mem"))
    assert art.data == b"\x7fELF"  # what it returned before stays usable


# ------------------------------------------------------------------ no recipe
@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda c: c.get(None), ["get(recipe)", "not NoneType None"]),
        (lambda c: c.get({"source": "x"}), ["get(recipe)", "dict", "Recipe.from_dict"]),
        (lambda c: c.get("extern ..."), ["get(recipe)", "str", "Recipe(source="]),
        (lambda c: c.get_many([None]), ["get_many recipes[0]", "NoneType"]),
        (lambda c: c.get_many(_recipe("one")), ["get_many(recipes)", "Recipe"]),
        (lambda c: c.warmup([None]), ["warmup recipes[0]", "NoneType"]),
        (lambda c: c.warmup(None), ["warmup(recipes=...)", "NoneType"]),
        (lambda c: c.key(None), ["recipe must be a kcache Recipe"]),
        (lambda c: c.prefetch(None), ["prefetch(manifest)", "JobManifest", "NoneType"]),
        (lambda c: c.warmup([], manifest={}), ["warmup(manifest=...)", "dict"]),
    ],
)
def test_something_that_is_no_recipe_is_a_type_error_saying_what_is_wanted(
    tmp_path: Path, call: Any, words: list[str]
) -> None:
    with KernelCache(url="", cache_dir=tmp_path) as cache, pytest.raises(TypeError) as raised:
        call(cache)
    assert all(w in str(raised.value) for w in words), str(raised.value)


# ------------------------------------------------------------------ an unusable cache directory
def _refused(cache_dir: object, *words: str) -> str:
    with pytest.raises(KCacheError) as raised:
        KernelCache(url="", cache_dir=cache_dir)  # type: ignore[arg-type]
    text = str(raised.value)
    assert all(w in text for w in (*words, "cache_dir=", "KCACHE_CACHE_DIR", "--cache-dir")), text
    return text


def test_a_file_is_no_cache_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    _refused(tmp_path / "file", f"cache directory {tmp_path / 'file'}", "is a file")
    _refused(tmp_path / "file" / "under", str(tmp_path / "file"), "is a file, not a directory")


def test_a_read_only_cache_directory_points_to_layers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def read_only(*args: object, **kw: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(Path, "write_text", read_only)
    _refused(tmp_path / "ro", str(tmp_path / "ro"), "read-only filesystem", "KCACHE_CACHE_LAYERS")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_directory_this_user_cannot_write_is_refused(tmp_path: Path) -> None:
    (tmp_path / "locked").mkdir(mode=0o555)
    _refused(tmp_path / "locked" / "tier", "may not write")


def test_a_path_that_is_no_path_is_refused_by_name(tmp_path: Path) -> None:
    _refused(f"{tmp_path}/a\0b", "NUL")
    _refused(18800, "int")


@pytest.mark.parametrize("text", ["", "\x00\x00\x00", "fl at", "{garbage"])
def test_a_damaged_layout_file_says_how_to_repair(tmp_path: Path, text: str) -> None:
    (tmp_path / "blobs").mkdir()
    (tmp_path / LAYOUT_FILE).write_text(text)
    with pytest.raises(KCacheError, match="is damaged") as raised:
        KernelCache(url="", cache_dir=tmp_path)
    assert "upgrade" not in str(raised.value) and "remove it" in str(raised.value)


def test_a_newer_layout_still_says_upgrade(tmp_path: Path) -> None:
    (tmp_path / LAYOUT_FILE).write_text("sharded-v3\n")
    with pytest.raises(KCacheError, match="upgrade kcache"):
        KernelCache(url="", cache_dir=tmp_path)


def test_asking_for_a_server_with_none_configured_says_none_is(tmp_path: Path) -> None:
    """It said "kcache server (none) is unreachable", as if one were down."""
    from kcache_client.errors import ServerUnavailableError

    with (
        KernelCache(url="", cache_dir=tmp_path / "tier") as cache,
        pytest.raises(ServerUnavailableError) as raised,
    ):
        cache.toolchains()
    said = str(raised.value)
    assert said.startswith("no kcache server is configured") and "KCACHE_URL" in said, said
    assert "unreachable" not in said
