"""B9: the index at 1k, 100k and 1M artifacts: fetch-by-key and resolve-hit p50, SQLite and PostgreSQL.

A script fills ``artifacts`` and ``recipe_aliases`` (no compiles): ``n`` rows, of which a
sample of real recipes (a vector add, one per variant, keyed by the core's own
``Recipe.key()`` with the machine's toolchain) have their blob in the store; the other
rows name blobs nobody asks for, as in a big index where most kernels are cold. A real
``kcache serve`` then answers a sequential httpx loop:

- ``fetch.cold``: ``GET /v1/recipes/{key}/artifact`` once per sampled key, random order
  (each one a database lookup and a blob read: the index at work);
- ``fetch.warm``: the same keys again (the memory caches);
- ``resolve.cold`` / ``resolve.warm``: ``POST /v1/resolve`` (``compile: false``) of the
  other half of the sample, first and second time.

Each figure is the p50 against the same figure at 1k rows in the same run. Goal:
<= 1.5 x at 1M.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support
from _harness import emit
from b10_stats_scale import database, settle

from tests.support import VECTOR_ADD, ServerProcess

ARTIFACT_COLUMNS = (
    *("digest", "size", "kind", "target", "toolchain", "kernel", "lowered_names"),
    *("compile_seconds", "log", "dependencies", "dependencies_exact", "created_at"),
    *("last_used_at", "recovered"),
)
ALIAS_COLUMNS = ("recipe_key", "digest", "created_at")
CHUNK = 20_000
TARGET = "sm_90"


def sample_recipes(count: int, toolchain: str) -> list[tuple[dict[str, Any], str, bytes]]:
    """``count`` distinct real recipes: (recipe JSON, its key, the bytes its blob holds)."""
    from kcache import Recipe

    out = []
    for i in range(count):
        body = {"source": f"// variant {i}\n{VECTOR_ADD}", "target": TARGET, "toolchain": toolchain}
        key = Recipe.from_dict(body).key()
        out.append((body, key, b"\x7fELF bench blob %d\n" % i + bytes(4000)))
    return out


def _rows(
    n: int, sample: list[tuple[dict[str, Any], str, bytes]], toolchain: str
) -> Iterator[tuple[tuple[Any, ...], tuple[Any, ...]]]:
    """(artifact row, alias row) pairs: the sample first, then filler with random keys."""
    rng = random.Random(9)
    now = datetime.now(timezone.utc)
    for i in range(n):
        if i < len(sample):
            _, key, data = sample[i]
            digest, size = hashlib.sha256(data).hexdigest(), len(data)
        else:
            key, digest, size = f"{rng.getrandbits(256):064x}", f"{rng.getrandbits(256):064x}", 4016
        artifact = (
            digest, size, "cubin", TARGET, toolchain, "add", "{}", 0.5, "", "[]", True, now, None,
            False,
        )  # fmt: skip
        yield artifact, (key, digest, now)


def fill(
    url: str, n: int, sample: list[tuple[dict[str, Any], str, bytes]], toolchain: str
) -> float:
    """Insert ``n`` artifacts and their aliases; seconds taken."""
    from kcache_server.models import artifacts_table as artifacts
    from kcache_server.models import recipe_aliases_table as aliases

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    started = time.perf_counter()
    try:
        if engine.dialect.name == "postgresql":
            with engine.connect() as conn:
                raw: Any = conn.connection.dbapi_connection
                pairs = list(_rows(n, sample, toolchain))
                with raw.cursor() as cur:
                    with cur.copy(
                        f"COPY artifacts ({', '.join(ARTIFACT_COLUMNS)}) FROM STDIN"
                    ) as c:
                        for artifact, _ in pairs:
                            c.write_row(artifact)
                    with cur.copy(
                        f"COPY recipe_aliases ({', '.join(ALIAS_COLUMNS)}) FROM STDIN"
                    ) as c:
                        for _, alias in pairs:
                            c.write_row(alias)
                raw.commit()
            settle(engine)
        else:
            a_rows: list[dict[str, Any]] = []
            r_rows: list[dict[str, Any]] = []
            with engine.begin() as conn:
                for artifact, alias in _rows(n, sample, toolchain):
                    row = dict(zip(ARTIFACT_COLUMNS, artifact, strict=True))
                    row["lowered_names"], row["dependencies"] = {}, []
                    a_rows.append(row)
                    r_rows.append(dict(zip(ALIAS_COLUMNS, alias, strict=True)))
                    if len(a_rows) == CHUNK:
                        conn.execute(sa.insert(artifacts), a_rows)
                        conn.execute(sa.insert(aliases), r_rows)
                        a_rows.clear()
                        r_rows.clear()
                if a_rows:
                    conn.execute(sa.insert(artifacts), a_rows)
                    conn.execute(sa.insert(aliases), r_rows)
            with engine.connect() as conn:
                conn.exec_driver_sql("ANALYZE")
    finally:
        engine.dispose()
    return time.perf_counter() - started


def p50_ms(call: Any, items: list[Any]) -> float:
    """Median milliseconds of ``call(item)`` over ``items``, one after another."""
    times = []
    for item in items:
        started = time.perf_counter()
        call(item)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def measure(kind: str, n: int, sample_size: int, toolchain: str) -> dict[str, float]:
    """Fill a fresh database of ``kind`` with ``n`` artifacts, serve it, time the four figures."""
    from kcache.store.local import LocalArtifactStore

    sample = sample_recipes(min(sample_size, n), toolchain)
    with tempfile.TemporaryDirectory(prefix="kcache-b9-") as tmp, database(kind, Path(tmp)) as url:
        data_dir = Path(tmp) / "data"
        store = LocalArtifactStore(data_dir)
        for _, _, data in sample:
            store.put(data)
        fill_s = fill(url, n, sample, toolchain)
        rng = random.Random(n)
        rng.shuffle(sample)
        half = len(sample) // 2
        fetched, resolved = sample[:half], sample[half:]
        with (
            ServerProcess(data_dir, db_url=url, workers=1) as server,
            httpx.Client(base_url=server.url, timeout=60) as http,
        ):

            def fetch(item: tuple[dict[str, Any], str, bytes]) -> None:
                r = http.get(f"/v1/recipes/{item[1]}/artifact")
                assert r.status_code == 200 and r.content == item[2], r.status_code

            def resolve(item: tuple[dict[str, Any], str, bytes]) -> None:
                r = http.post("/v1/resolve", json={"recipe": item[0], "compile": False})
                assert r.status_code == 200 and r.json()["status"] == "hit", r.text

            figures = {
                "fetch.cold": p50_ms(fetch, fetched),
                "fetch.warm": p50_ms(fetch, fetched),
                "resolve.cold": p50_ms(resolve, resolved),
                "resolve.warm": p50_ms(resolve, resolved),
            }
    figures["fill_s"] = fill_s
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="1000,100000", help="comma-separated row counts (add 1000000 for 1M)"
    )
    parser.add_argument("--sample", type=int, default=2000, help="keys requested per figure x 2")
    parser.add_argument("--db", choices=("sqlite", "postgresql", "both"), default="both")
    args = parser.parse_args()
    from kcache.toolchain import load_toolchain

    toolchain = load_toolchain().id
    sizes = [int(s) for s in args.sizes.split(",")]
    for kind in ("sqlite", "postgresql") if args.db == "both" else (args.db,):
        base: dict[str, float] | None = None
        for n in sizes:
            figures = measure(kind, n, args.sample, toolchain)
            base = base or figures
            for name in ("fetch.cold", "fetch.warm", "resolve.cold", "resolve.warm"):
                emit(
                    f"B9.{kind}.{name}.p50_ms",
                    figures[name],
                    base[name],
                    "ms",
                    rows=n,
                    anchor_rows=sizes[0],
                    fill_s=round(figures["fill_s"], 1),
                    goal="<= 1.5 at 1M",
                )


if __name__ == "__main__":
    os.environ.setdefault("KCACHE_AUDIT_FLUSH_S", "0.5")
    main()
