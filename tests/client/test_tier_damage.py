"""A node tier damaged where a file goes never fails a ``get``.

A directory standing where a blob or an alias goes (a stray ``mkdir``, a restore gone
wrong) was read as absent, the kernel fetched again, and then its publish raised
``IsADirectoryError`` out of ``get()``: every process, every run. Now this user's own tier
has the directory removed and the entry published in its place; where the tier cannot be
written (a file where its index's directory goes: read as absent, not as an error), the
kernel is used from memory with one warning.
Real server (the session's), real tier, real files.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from client_harness import KcacheServer, kernels
from kcache_client import ClientSettings, KernelCache

from kcache.errors import KCacheError

SETTINGS = ClientSettings.from_env(send_events=False)


def _fresh(kserver: KcacheServer, tier: Path) -> KernelCache:
    return KernelCache(kserver.url, cache_dir=tier, settings=SETTINGS)


@pytest.mark.parametrize("where", ["blob", "alias"])
def test_a_directory_where_a_file_goes_is_cleared_in_a_private_tier(
    kserver: KcacheServer, tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    (recipe,) = kernels(1, f"damage-{where}", target="sm_80")
    tier = tmp_path / "tier"
    with _fresh(kserver, tier) as cache:
        art = cache.get(recipe)
        path = Path(
            cache.tier.store.path(art.digest)
            if where == "blob"
            else cache.tier.index.alias_path(art.recipe_key)
        )
    path.unlink()
    (path / "inside").mkdir(parents=True)  # a directory, not empty, in the file's place
    caplog.set_level(logging.WARNING)
    with _fresh(kserver, tier) as cache:
        again = cache.get(recipe)  # fetched again, published in its place
        assert again.digest == art.digest and again.origin == "server"
    assert path.is_file()
    assert any("removed the directory" in r.getMessage() for r in caplog.records)
    with _fresh(kserver, tier) as cache:
        assert cache.get(recipe).origin == "node"  # the tier holds it again


def test_a_tier_that_cannot_take_an_entry_still_answers_from_memory(
    kserver: KcacheServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (recipe,) = kernels(1, "damage-index", target="sm_80")
    tier = tmp_path / "tier"
    with _fresh(kserver, tier) as cache:
        cache.get(kernels(1, "damage-first", target="sm_80")[0])  # the tier's layout made
    shutil.rmtree(tier / "index" / "recipes")
    (tier / "index" / "recipes").write_text("not a directory\n")  # no alias can be written
    caplog.set_level(logging.WARNING)
    with _fresh(kserver, tier) as cache:
        art = cache.get(recipe)  # raised NotADirectoryError before
        assert art.data[:4] == b"\x7fELF"
        assert cache.get(recipe).digest == art.digest  # from memory
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "index/recipes is not a directory" in said, said  # one warning, naming it


def test_a_file_where_the_index_goes_is_named_with_the_way_out(
    kserver: KcacheServer, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    _fresh(kserver, tier).close()
    shutil.rmtree(tier / "index")
    (tier / "index").write_text("not a directory\n")
    with pytest.raises(KCacheError) as raised:  # NotADirectoryError from deep inside before
        _fresh(kserver, tier)
    said = str(raised.value)
    assert f"{tier / 'index'} is a file where the cache keeps a directory" in said, said
    assert "remove that file" in said and "--cache-dir" in said


def test_a_file_where_the_locks_go_costs_no_get(
    kserver: KcacheServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = tmp_path / "tier"
    _fresh(kserver, tier).close()
    shutil.rmtree(tier / "locks")
    (tier / "locks").write_text("not a directory\n")
    (recipe,) = kernels(1, "damage-locks", target="sm_80")
    with _fresh(kserver, tier) as cache:  # untrusted, said once: nothing written into it
        assert cache.get(recipe).data[:4] == b"\x7fELF"  # no lock to be had: goes ahead
    assert "locks is not a directory" in " ".join(r.getMessage() for r in caplog.records)
