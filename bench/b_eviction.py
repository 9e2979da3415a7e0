"""Bounded storage (issue 12): what one eviction pass costs, and what eviction costs B1 and B2.

1. ``B_evict.pass_s.{sqlite,postgres}``: a store of 100k artifacts (rows, aliases and
   blobs written by this script, not compiled; last uses spread over a day) with
   ``max_store_bytes`` equal to its size; one pass of the real evictor (``create_app``'s)
   evicts down to the low-water mark (20k artifacts: rows, then blobs). Goal: < 5 s.
2. ``B1``/``B2`` with eviction active, against the same server without a cap, in
   the same run: ``kcache serve`` with ``max_store_bytes`` set and the store at its
   high-water mark, while a filler adds artifacts as a busy server's compiles would
   (rows and 53 KB blobs, 10 a second, nothing compiled), so a pass evicts about
   every second while wrk measures; the inactive server gets the same filler
   without a cap. Three interleaved rounds of each (``BENCH_ROUNDS``); the ratio is
   the median active / the median inactive. Goal: within 10 % (ratio >= 0.9).

PostgreSQL is ``$KCACHE_BENCH_PG_URL`` (default the test database at 127.0.0.1); the
part is skipped when it is not reachable.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support
from _harness import KCACHE, emit, kcache_server, post_json_lua, wrk
from b2_resolve_hit import twenty_header_recipe

from tests.support import VECTOR_ADD

SECONDS = int(os.environ.get("BENCH_SECONDS", "5"))
HIGH = 0.9  # the default high-water mark
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
ROWS = int(os.environ.get("BENCH_EVICTION_ROWS", "100000"))
PG_URL = os.environ.get("KCACHE_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
BLOB = 256  # bytes per filler blob: the pass's cost is per artifact, not per byte


def _upgrade(env: dict[str, str]) -> None:
    import subprocess

    subprocess.run(
        [*KCACHE, "db", "upgrade"], env={**os.environ, **env}, check=True, capture_output=True
    )


def fill(
    db: sa.Engine,
    data_dir: Path,
    n: int,
    *,
    start: int = 0,
    age_s: float = 86400.0,
    blob: int = BLOB,
) -> int:
    """Write ``n`` artifacts (blob, row, alias) used at random times in the last ``age_s``; their bytes."""
    from kcache_server.models import Artifact, RecipeAlias

    from kcache.store.local import LocalArtifactStore

    store = LocalArtifactStore(data_dir)
    artifacts = Artifact.__table__
    aliases = RecipeAlias.__table__
    now = time.time()
    rows: list[dict[str, Any]] = []
    keys: list[dict[str, Any]] = []
    total = 0
    for i in range(start, start + n):
        data = (uuid.uuid4().bytes + i.to_bytes(8, "big")) * (blob // 24) + b"k" * (blob % 24)
        digest = hashlib.sha256(data).hexdigest()
        path = store.path(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        used = now - random.uniform(120.0, age_s)  # older than the blob grace
        os.utime(path, (used, used))
        stamp = datetime.fromtimestamp(used, timezone.utc)
        rows.append(
            {
                "digest": digest,
                "size": len(data),
                "kind": "cubin",
                "target": "sm_90",
                "toolchain": "bench",
                "kernel": f"k{i}",
                "lowered_names": {},
                "compile_seconds": 0.05,
                "log": "",
                "dependencies": [],
                "dependencies_exact": True,
                "created_at": stamp - timedelta(seconds=1),
                "last_used_at": stamp,
                "recovered": False,
            }
        )
        keys.append(
            {
                "recipe_key": hashlib.sha256(b"key" + digest.encode()).hexdigest(),
                "digest": digest,
                "created_at": stamp,
            }
        )
        total += len(data)
        if len(rows) >= 5000:
            with db.begin() as conn:
                conn.execute(sa.insert(artifacts), rows)
                conn.execute(sa.insert(aliases), keys)
            rows, keys = [], []
    if rows:
        with db.begin() as conn:
            conn.execute(sa.insert(artifacts), rows)
            conn.execute(sa.insert(aliases), keys)
    return total


@contextlib.contextmanager
def fresh_postgres() -> Iterator[str | None]:
    """A new PostgreSQL database (dropped afterwards), or None when none is reachable."""
    admin = sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    name = f"kcache_bench_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.OperationalError:
        yield None
        return
    try:
        yield sa.engine.make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def one_pass(backend: str, db_url: str | None) -> None:
    """Fill ROWS artifacts, cap the store at their size, time one pass of the real evictor."""
    from kcache_server import Settings, create_app
    from kcache_server.db import open_database

    with tempfile.TemporaryDirectory(prefix="kcache-bench-evict-") as tmp:
        data_dir = Path(tmp) / "data"
        env = {"KCACHE_DATA_DIR": str(data_dir), **({"KCACHE_DB_URL": db_url} if db_url else {})}
        _upgrade(env)
        settings_db = db_url or f"sqlite:///{data_dir / 'kcache.db'}"
        db = open_database(settings_db)
        started = time.perf_counter()
        total = fill(db, data_dir, ROWS)
        filled_s = time.perf_counter() - started
        db.dispose()
        app = create_app(
            Settings(data_dir=data_dir, db_url=db_url, max_store_bytes=total, compile_workers=1)
        )
        evictor = app.state.evictor
        report = evictor.run_pass()
        assert report is not None and report.evicted > 0, report
        left = evictor.index.usage()
        app.state.kcache.backends.db.dispose()
    emit(
        f"B_evict.pass_s.{backend}",
        report.seconds,
        None,
        "s",
        goal="< 5 s",
        met=report.seconds < 5.0,
        artifacts=ROWS,
        evicted=report.evicted,
        bytes_freed=report.bytes_freed,
        left_bytes=left.bytes,
        low_water_bytes=evictor.marks.low_bytes,
        fill_s=round(filled_s, 1),
    )


#: What the filler adds: a busy server's compiles (10 cubins a second of a typical size).
FILL_PER_S, FILL_BLOB = 10, 53_000


class Filler:
    """Adds artifacts as a busy server's compiles would (``FILL_PER_S`` a second), without compiling."""

    def __init__(self, data_dir: Path) -> None:
        from kcache_server.db import open_database

        self.data_dir = data_dir
        self.db = open_database(f"sqlite:///{data_dir / 'kcache.db'}")
        self.stop = threading.Event()
        self.written = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        per_tick = max(1, FILL_PER_S // 5)
        while not self.stop.wait(0.2):
            fill(
                self.db,
                self.data_dir,
                per_tick,
                start=1_000_000 + self.written,
                age_s=600.0,
                blob=FILL_BLOB,
            )
            self.written += per_tick

    def __enter__(self) -> Filler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self.db.dispose()


def evictions(data_dir: Path) -> int:
    """Rows in the server's eviction log."""
    engine = sa.create_engine(f"sqlite:///{data_dir / 'kcache.db'}", poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM evictions")).scalar_one())
    finally:
        engine.dispose()


def measure(active: bool, workers: int) -> dict[str, float]:
    """B1 and B2 req/s on a fresh server, with eviction active (cap, filler) or not."""
    cap = 4 << 20
    settings = {"KCACHE_EVICTION_INTERVAL_S": "1"}
    if active:
        settings["KCACHE_MAX_STORE_BYTES"] = str(cap)
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        with tempfile.TemporaryDirectory(prefix="kcache-bench-b12-") as tmp:
            data_dir = Path(tmp)
            with kcache_server(workers=workers, data_dir=data_dir) as url:
                fetch_body = {"recipe": {"source": VECTOR_ADD, "target": "sm_90"}, "compile": True}
                key = httpx.post(url + "/v1/resolve", json=fetch_body, timeout=120).json()[
                    "recipe_key"
                ]
                resolve_body = {"recipe": twenty_header_recipe(), "compile": True}
                httpx.post(url + "/v1/resolve", json=resolve_body, timeout=120).raise_for_status()
                if active:  # start just under the cap; the filler then keeps pushing it over
                    from kcache_server.db import open_database

                    db = open_database(f"sqlite:///{data_dir / 'kcache.db'}")
                    fill(
                        db,
                        data_dir,
                        int(cap * HIGH) // FILL_BLOB,
                        start=2_000_000,
                        age_s=600.0,
                        blob=FILL_BLOB,
                    )
                    db.dispose()
                before = evictions(data_dir)
                # The filler runs in both cases (its writes load the machine alike); only the cap differs.
                with Filler(data_dir):
                    b1 = wrk(f"{url}/v1/recipes/{key}/artifact", seconds=SECONDS)
                    b2 = wrk(
                        url + "/v1/resolve", seconds=SECONDS, script=post_json_lua(resolve_body)
                    )
                evicted = evictions(data_dir) - before
                hot = httpx.get(f"{url}/v1/recipes/{key}/artifact", timeout=10)
                assert hot.status_code == 200, "the hot artifact was evicted"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {
        "b1": b1["rps"],
        "b2": b2["rps"],
        "evicted": float(evicted),
        "non_2xx": b1["non_2xx"] + b2["non_2xx"],
    }


def main() -> None:
    one_pass("sqlite", None)
    with fresh_postgres() as pg:
        if pg is None:
            print('{"bench": "B_evict.pass_s.postgres", "skipped": "PostgreSQL not reachable"}')
        else:
            one_pass("postgres", pg)
    workers = int(os.environ.get("BENCH_WORKERS", str(os.cpu_count() or 1)))
    rounds = [measure(active, workers) for _ in range(ROUNDS) for active in (False, True)]
    off = [r for i, r in enumerate(rounds) if i % 2 == 0]
    on = [r for i, r in enumerate(rounds) if i % 2 == 1]
    for name, label in (("b1", "B1.fetch_by_key"), ("b2", "B2.resolve_hit")):
        ours = statistics.median(r[name] for r in on)
        anchor = statistics.median(r[name] for r in off)
        emit(
            f"B_evict.{label}.rps_with_eviction",
            ours,
            anchor,
            "req/s",
            goal=">= 0.9",
            met=ours >= 0.9 * anchor,
            evicted_during=sum(r["evicted"] for r in on),
            rounds=[round(r[name]) for r in rounds],
            non_2xx=sum(r["non_2xx"] for r in rounds),
            workers=workers,
        )


if __name__ == "__main__":
    main()
