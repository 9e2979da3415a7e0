"""A node tier never answers an include-set recipe whose set changed (issue 43).

The client pins each set a recipe names to its contents before keying: the server's sets
by ``include_set_digests`` of ``GET /v1/toolchains`` (asked again at a job start: a new
process, a warmup; and on ``409 include_set_changed``), its own sets by walking them. A
real server with a registered set, real NVRTC, a real node tier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kcache_client import ClientSettings, KernelCache
from kcache_server.settings import Settings

from kcache.recipe import Recipe
from tests.support import FAST, ServerThread, wait_until

SOURCE = '#include <tile.h>\nextern "C" __global__ void k(int* o) { o[0] = TILE; }\n'


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Path]]:
    home = tmp_path_factory.mktemp("pins")
    proj = home / "proj"
    proj.mkdir()
    (proj / "tile.h").write_text("#define TILE 8\n")
    server = ServerThread(
        Settings(data_dir=home / "data", compile_workers=1, include_sets={"proj": proj})
    )
    try:
        yield server, proj
    finally:
        server.stop()


def _edit(server: ServerThread, proj: Path, text: str) -> None:
    """Edit the set's tile.h and wait until the server publishes its new digest (it walks a
    set at most ten times a second: CURRENT_AGE_S)."""
    before = server.client().get("/v1/toolchains").json()["include_set_digests"]["proj"]
    (proj / "tile.h").write_text(text)
    wait_until(
        lambda: (
            server.client().get("/v1/toolchains").json()["include_set_digests"]["proj"] != before
        ),
        "the server to notice the edit",
    )


def _cache(url: str | None, tier: Path, **kw: Any) -> KernelCache:
    settings = dataclasses.replace(
        ClientSettings.from_env(auto_target="sm_80", retry=FAST, send_events=False),
        known_servers=tier.parent / f"{tier.name}-known.json",
        **kw,
    )
    return KernelCache(url, cache_dir=tier, settings=settings)


def test_a_server_sets_edit_misses_on_the_node_tier_at_the_next_job_start(
    served: tuple[ServerThread, Path], tmp_path: Path
) -> None:
    server, proj = served
    tier = tmp_path / "tier"
    recipe = Recipe(source=SOURCE, target="sm_80", include_sets=["proj"])
    with _cache(server.url, tier) as cache:
        first = cache.get(recipe)
        assert first.origin == "compiled"
        assert cache.get(recipe).origin == "memory"
    with _cache(server.url, tier) as cache:  # a new process: the tier answers, no compile
        assert cache.get(recipe).origin == "node"
    _edit(server, proj, "#define TILE 9\n")
    with _cache(server.url, tier) as cache:  # the next run, after the edit
        edited = cache.get(recipe)
        assert edited.origin == "compiled", edited.origin
        assert edited.digest != first.digest
        assert edited.recipe_key != first.recipe_key
    # A process that pinned before the edit learns it at its next warmup (a job start)
    # or from the server's 409 on a miss; it never answers the old kernel past those.
    with _cache(server.url, tier) as cache:
        stale_key = cache.key(recipe)
        _edit(server, proj, "#define TILE 10\n")
        assert cache.key(recipe) == stale_key  # pinned for the process until a job start
        cache.include_pins.refresh()  # what warmup() does first
        assert cache.key(recipe) != stale_key
        third = cache.get(recipe)
        assert third.digest not in (first.digest, edited.digest)


def test_a_recipe_pinned_to_old_contents_makes_the_client_pin_again_once(
    served: tuple[ServerThread, Path], tmp_path: Path
) -> None:
    server, proj = served
    recipe = Recipe(
        source=SOURCE.replace("TILE;", "TILE + 1;"), target="sm_80", include_sets=["proj"]
    )
    with _cache(server.url, tmp_path / "tier") as cache:
        before = cache.key(recipe)  # pinned now, in this process
        _edit(server, proj, "#define TILE 11\n")
        art = cache.get(recipe)  # the server answers 409; the client pins again and asks once more
        assert art.origin == "compiled"
        assert art.recipe_key != before
        assert art.recipe_key == cache.key(recipe)


def test_a_clients_own_set_is_pinned_by_walking_it(tmp_path: Path) -> None:
    """A set registered on the client (KCACHE_CLIENT_INCLUDE_SETS, a CuPy -I): pinned
    here, so an edit between two runs gives another key on the node tier too."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tile.h").write_text("#define TILE 1\n")
    recipe = Recipe(source=SOURCE, target="sm_80", toolchain="t", include_sets=["mine"])
    with _cache(None, tmp_path / "tier", include_sets={"mine": mine}) as cache:
        first = cache.key(recipe)
    (mine / "tile.h").write_text("#define TILE 2\n")
    with _cache(None, tmp_path / "tier", include_sets={"mine": mine}) as cache:
        assert cache.key(recipe) != first
    with _cache(None, tmp_path / "tier") as cache, pytest.raises(ValueError, match="registered"):
        cache.key(Recipe(source=SOURCE, target="sm_80", toolchain="t", include_sets=["nope"]))
