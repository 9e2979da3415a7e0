"""The node tier publishes without fsync, so after a power loss any of its files may be
empty, cut short or garbage: each must read as a miss and be refetched with the right bytes.

Against a real ``kcache serve`` (the session's): one kernel is compiled once, then each
case fills a fresh tier from the server, damages one file the way a crash could, and
opens the tier again from a new process-like ``KernelCache`` (no memory tier carried over).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from client_harness import KcacheServer, kernels
from kcache_client import KernelCache
from kcache_client._tier import NodeTier

from kcache import Recipe
from kcache.artifact import ArtifactMeta
from kcache.index.file import FileIndex
from kcache.store.local import LocalArtifactStore
from tests.support import QUIET


@pytest.fixture(scope="module")
def recipe(kserver: KcacheServer, tmp_path_factory: pytest.TempPathFactory) -> Recipe:
    """One kernel the server holds (compiled once for the module)."""
    (held,) = kernels(1, "crash", target="sm_80")
    with KernelCache(
        kserver.url, cache_dir=tmp_path_factory.mktemp("seed"), settings=QUIET
    ) as seed:
        assert seed.get(held).origin in ("compiled", "server")
    return held


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _zeros(path: Path) -> None:  # what a file whose blocks never reached the disk can hold
    path.write_bytes(b"\0" * max(1, path.stat().st_size))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _json(value: object) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.write_text(json.dumps(value))

    return write


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated": _truncate,
    "empty": _empty,
    "zeros": _zeros,
    "flipped": _flip,
}
# Well-formed JSON, wrong shape: cannot come from a crash, must not crash a reader either.
WRONG_SHAPES: dict[str, Callable[[Path], None]] = {
    "list": _json([]),
    "no_fields": _json({}),
    "digest_number": _json({"digest": 5}),
    "artifact_partial": _json({"digest": "ab" * 32, "artifact": {"digest": "ab" * 32}}),
}


def _files(cache: KernelCache, key: str, digest: str) -> dict[str, Path]:
    index = cache.tier.index
    return {
        "alias": index._path("recipes", key),
        "blob": cache.tier.store.path(digest),
    }


def _fill(server: KcacheServer, root: Path, recipe: Recipe) -> tuple[str, str, bytes]:
    with KernelCache(server.url, cache_dir=root, settings=QUIET) as cache:
        art = cache.get(recipe)
        assert art.origin == "server"
        assert hashlib.sha256(art.data).hexdigest() == art.digest
        return art.recipe_key, art.digest, art.data


def _refetched(server: KcacheServer, root: Path, recipe: Recipe, digest: str, data: bytes) -> None:
    """The damaged tier answers a miss; the server's bytes come back and heal it."""
    with KernelCache(server.url, cache_dir=root, settings=QUIET) as cache:
        art = cache.get(recipe)
        assert art.origin == "server"  # not the damaged copy
        assert art.digest == digest
        assert art.data == data
        assert hashlib.sha256(Path(art.path).read_bytes()).hexdigest() == digest
    with KernelCache(server.url, cache_dir=root, settings=QUIET) as cache:
        again = cache.get(recipe)
        assert again.origin == "node"  # the publish repaired the tier
        assert again.data == data


@pytest.mark.parametrize("which", ["alias", "blob"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_alias_or_blob_is_a_miss_and_is_refetched(
    kserver: KcacheServer, recipe: Recipe, tmp_path: Path, which: str, damage: str
) -> None:
    key, digest, data = _fill(kserver, tmp_path, recipe)
    with KernelCache(kserver.url, cache_dir=tmp_path, settings=QUIET) as cache:
        DAMAGE[damage](_files(cache, key, digest)[which])
    _refetched(kserver, tmp_path, recipe, digest, data)


@pytest.mark.parametrize("shape", sorted(WRONG_SHAPES))
def test_a_wrong_shaped_alias_is_a_miss_and_is_refetched(
    kserver: KcacheServer, recipe: Recipe, tmp_path: Path, shape: str
) -> None:
    key, digest, data = _fill(kserver, tmp_path, recipe)
    WRONG_SHAPES[shape](Path(NodeTier(tmp_path).index.alias_path(key)))
    _refetched(kserver, tmp_path, recipe, digest, data)


@pytest.mark.parametrize("damage", sorted({**DAMAGE, **WRONG_SHAPES}))
def test_a_damaged_artifact_record_or_manifest_reads_as_absent(tmp_path: Path, damage: str) -> None:
    """The records a hit does not read: absent to every reader, rewritten by the next publish."""
    index = FileIndex(tmp_path, durable=False)
    meta = ArtifactMeta(digest="cd" * 32, size=3, kind="cubin", target="sm_80", toolchain="t")
    index.record_artifact("ef" * 32, "12" * 32, meta)
    assert index.artifact(meta.digest) == meta
    assert [e.digest for e in index.manifest("12" * 32)] == [meta.digest]

    {**DAMAGE, **WRONG_SHAPES}[damage](index._path("artifacts", meta.digest))
    {**DAMAGE, **WRONG_SHAPES}[damage](index._path("manifests", "12" * 32))
    assert index.artifact(meta.digest) is None
    assert index.manifest("12" * 32) == []

    index.record_artifact("ef" * 32, "12" * 32, meta)  # the next publish heals both
    assert index.artifact(meta.digest) == meta
    assert [e.digest for e in index.manifest("12" * 32)] == [meta.digest]


def test_the_node_tier_publishes_without_fsync_and_the_server_store_with(
    kserver: KcacheServer, tmp_path: Path
) -> None:
    """The parameter, not a global: the tier opts out, the core's defaults stay durable."""
    with KernelCache(kserver.url, cache_dir=tmp_path, settings=QUIET) as cache:
        assert cache.tier.store.durable is False
        assert cache.tier.index.durable is False
    assert LocalArtifactStore(tmp_path / "s").durable is True
    assert FileIndex(tmp_path / "s").durable is True


def test_another_files_old_blocks_read_as_absent(tmp_path: Path) -> None:
    """A file showing another entry's old contents (valid JSON, wrong owner) is no answer."""
    index = FileIndex(tmp_path, durable=False)
    one = ArtifactMeta(digest="aa" * 32, size=3, kind="cubin", target="sm_80", toolchain="t")
    two = ArtifactMeta(digest="bb" * 32, size=4, kind="cubin", target="sm_80", toolchain="t")
    index.record_artifact("01" * 32, "10" * 32, one)
    index.record_artifact("02" * 32, "20" * 32, two)
    assert index.lookup("02" * 32) == two

    alias_one = index._path("recipes", "01" * 32).read_bytes()
    index._path("recipes", "02" * 32).write_bytes(alias_one)
    assert index.lookup("02" * 32) is None  # would answer kernel one for recipe two
    assert index.lookup("01" * 32) == one

    index._path("artifacts", two.digest).write_bytes(
        index._path("artifacts", one.digest).read_bytes()
    )
    assert index.artifact(two.digest) is None
    index.record_alias("02" * 32, two.digest)  # an alias to a record that is not there
    assert index.lookup("02" * 32) is None
    index.record_artifact("02" * 32, "20" * 32, two)  # the next publish heals both
    assert index.artifact(two.digest) == two
    assert index.lookup("02" * 32) == two


def test_a_tier_alias_without_its_key_is_absent_a_durable_one_is_kept(tmp_path: Path) -> None:
    """Nothing vouches for a non-durable alias that does not name its key (written before
    aliases did, or old blocks); a durable index (fsynced) keeps reading such files."""
    meta = ArtifactMeta(digest="cc" * 32, size=3, kind="cubin", target="sm_80", toolchain="t")
    for durable, expected in ((False, None), (True, meta)):
        index = FileIndex(tmp_path / str(durable), durable=durable)
        index.record_artifact("03" * 32, "30" * 32, meta)
        path = index._path("recipes", "03" * 32)
        path.write_text(json.dumps({"digest": meta.digest, "artifact": meta.to_dict()}))
        assert index.lookup("03" * 32) == expected
