"""``kcache db gc``: blobs no artifact row names are collected; named ones never are."""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any

from tests.support import KCACHE, unique, vector_add


def test_db_gc_keeps_indexed_blobs_and_removes_old_orphans(make_settings: Any, serve: Any) -> None:
    settings = make_settings()
    server = serve(settings)
    with server.client() as client:
        digest = client.post("/v1/resolve", json={"recipe": vector_add(unique())}).json()[
            "artifact"
        ]["digest"]
    store = server.state.backends.store
    orphan = store.put(b"published, but its compile never recorded it")
    young = store.put(b"published a moment ago; its row may be on the way")
    past = time.time() - 7200
    for kept_or_old in (digest, orphan):
        os.utime(store.path(kept_or_old), (past, past))
    result = subprocess.run(
        [KCACHE, "db", "gc", "--data-dir", str(settings.data_dir)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["blobs"] == 1
    assert store.has(digest) and store.has(young) and not store.has(orphan)
    with server.client() as client:
        assert client.get(f"/v1/blobs/{digest}").status_code == 200
