"""``kcache cache rm --dry-run`` and ``cache clear --dry-run`` (issue 45): what would go, and nothing goes.

Each prints the count, the bytes and the keys and kernels it would remove, decided as the
real removal decides (a recipe key whose artifact another recipe names keeps the
artifact), removes nothing, and asks nothing (``clear --dry-run`` needs no ``--yes``). The
real removal that follows frees what the dry run said. On a node tier (the commands as real
processes) and on a real server's store (``--server``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from client_harness import KcacheServer

from tests.cli_harness import kcache, user_env
from tests.support import VECTOR_ADD, unique


def _run(*args: str, env: dict[str, str], cwd: Path) -> Any:
    result = kcache(*args, env=env, cwd=cwd)
    assert result.returncode == 0, (args, result.stderr)
    return json.loads(result.stdout) if "--json" in args else result.stdout


def _listing(env: dict[str, str], cwd: Path, *server: str) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = _run("cache", "ls", "--json", *server, env=env, cwd=cwd)[
        "entries"
    ]
    return sorted(entries, key=lambda e: e["digest"])


def test_a_node_tier_dry_run_lists_and_removes_nothing(tmp_path: Path) -> None:
    env = user_env(tmp_path)
    tag = unique("dry").replace("-", "_")
    (tmp_path / "a.cu").write_text(VECTOR_ADD.replace("add(", f"a_{tag}("))
    (tmp_path / "twin.cu").write_text(VECTOR_ADD.replace("add(", f"a_{tag}(") + "// twin\n")
    (tmp_path / "b.cu").write_text(VECTOR_ADD.replace("add(", f"b_{tag}("))
    keys = {
        name: json.loads(_run("compile", name, "--target", "sm_90", env=env, cwd=tmp_path))[
            "recipe_key"
        ]
        for name in ("a.cu", "twin.cu", "b.cu")
    }
    before = _listing(env, tmp_path)
    assert len(before) == 2  # a.cu and twin.cu compile to the same cubin: one artifact
    b_entry = next(e for e in before if keys["b.cu"] in e["recipe_keys"])

    # A recipe whose artifact it alone names: the artifact would go, listed by key and kernel.
    text = _run("cache", "rm", keys["b.cu"][:12], "--dry-run", env=env, cwd=tmp_path)
    assert "would remove 1 recipe entry" in text
    assert "would remove 1 artifacts" in text and "dry run: nothing was removed" in text
    assert keys["b.cu"][:16] in text and f"b_{tag}" in text
    said = _run("cache", "rm", keys["b.cu"][:12], "--dry-run", "--json", env=env, cwd=tmp_path)
    assert said["dry_run"] is True and said["evicted"] == 1
    assert said["bytes_freed"] == b_entry["size"]
    assert [a["digest"] for a in said["artifacts"]] == [b_entry["digest"]]

    # A recipe whose artifact its twin names too: the entry would go, the artifact stay.
    shared = _run("cache", "rm", keys["a.cu"], "--dry-run", "--json", env=env, cwd=tmp_path)
    assert shared["recipes_removed"] == 1 and shared["evicted"] == 0 and shared["artifacts"] == []
    assert list(shared["kept"].values()) == [[keys["twin.cu"]]]

    # clear: no --yes needed, no terminal asked; the whole tier listed.
    cleared = _run("cache", "clear", "--dry-run", "--json", env=env, cwd=tmp_path)
    assert cleared["evicted"] == 2
    assert cleared["bytes_freed"] == sum(e["size"] for e in before)
    assert sorted(a["digest"] for a in cleared["artifacts"]) == [e["digest"] for e in before]
    text = _run("cache", "clear", "--dry-run", env=env, cwd=tmp_path)
    assert "would remove 2 artifacts" in text and f"a_{tag}" in text and f"b_{tag}" in text

    assert _listing(env, tmp_path) == before  # nothing was removed, nothing forgotten
    for name in keys:
        got = json.loads(_run("get", name, "--target", "sm_90", env=env, cwd=tmp_path))
        assert got["status"] == "local_hit"

    # The real removal frees what the dry run said.
    done = _run("cache", "rm", keys["b.cu"][:12], "--json", env=env, cwd=tmp_path)
    assert (done["evicted"], done["bytes_freed"]) == (said["evicted"], said["bytes_freed"])
    done = _run("cache", "clear", "--yes", "--json", env=env, cwd=tmp_path)
    assert done["evicted"] == cleared["evicted"] - 1


def test_a_server_dry_run_lists_and_removes_nothing(kserver: KcacheServer, tmp_path: Path) -> None:
    trust = {k: os.environ[k] for k in ("KCACHE_TRUSTED_KEYS", "KCACHE_KNOWN_SERVERS")}
    env = user_env(tmp_path, KCACHE_URL=kserver.url, **trust)
    server = ("--server", kserver.url)
    tag = unique("sdry").replace("-", "_")
    keys = []
    for n in (1, 2):
        (tmp_path / f"k{n}.cu").write_text(VECTOR_ADD.replace("add(", f"k{n}_{tag}("))
        compiled = _run("compile", f"k{n}.cu", "--target", "sm_90", env=env, cwd=tmp_path)
        keys.append(json.loads(compiled)["recipe_key"])
    before = _listing(env, tmp_path, *server)
    mine = {e["digest"]: e for e in before if set(e["recipe_keys"]) & set(keys)}
    assert len(mine) == 2

    said = _run("cache", "rm", keys[0][:12], "--dry-run", "--json", *server, env=env, cwd=tmp_path)
    (only,) = said["artifacts"]
    assert said["dry_run"] is True and said["evicted"] == 1
    assert keys[0] in only["recipe_keys"] and only["kernel"] == f"k1_{tag}"
    assert said["bytes_freed"] == only["size"] == mine[only["digest"]]["size"]
    text = _run("cache", "rm", keys[0][:12], "--dry-run", *server, env=env, cwd=tmp_path)
    assert "would remove 1 artifacts" in text and f"k1_{tag}" in text and "nothing was" in text

    cleared = _run("cache", "clear", "--dry-run", "--json", *server, env=env, cwd=tmp_path)
    listed = {a["digest"] for a in cleared["artifacts"]}
    assert set(mine) <= listed and cleared["evicted"] >= 2
    text = _run("cache", "clear", "--dry-run", *server, env=env, cwd=tmp_path)
    assert f"k1_{tag}" in text and f"k2_{tag}" in text

    after = {e["digest"] for e in _listing(env, tmp_path, *server)}
    assert set(mine) <= after  # nothing was removed from the server's store
    done = _run("cache", "rm", keys[0][:12], "--json", *server, env=env, cwd=tmp_path)
    assert (done["evicted"], done["bytes_freed"]) == (1, said["bytes_freed"])
