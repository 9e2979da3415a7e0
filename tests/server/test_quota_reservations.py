"""Quota reservations (issue 29, item 1): :class:`QuotaCompiler` over a real database, compiles faked.

Each compile reserves room before it runs and settles to its real size after, in one
locked transaction each, so concurrent compiles (threads here; two compilers on two
engines stand for two replicas) never charge a caller past its quota. The compiler
inside is a stand-in that sleeps and returns bytes of a chosen size, so the rule is
checked exactly; ``test_quotas_under_load.py`` checks the same on real servers.
One database per backend for the module; every test has callers of its own.
"""

from __future__ import annotations

import contextvars
import hashlib
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, cast

import pytest
import sqlalchemy as sa

from kcache.artifact import CompileOutput
from kcache.errors import CompileError
from kcache.include_sets import IncludeSets
from kcache.recipe import Recipe
from tests.support import pg_database, unique, upgrade


class FakeCompiler:
    """Sleeps ``delay`` seconds, then returns ``size`` distinct bytes (or fails); counts overlap."""

    def __init__(self, size: int, delay: float = 0.02, fail: bool = False) -> None:
        self.toolchain: Any = None
        self.include_sets = IncludeSets()
        self.size = size
        self.delay = delay
        self.fail = fail
        self._lock = threading.Lock()
        self._n = 0
        self.running = 0
        self.peak = 0
        # Not id(self): a later test's compiler may get a freed one's id, and then its
        # bytes (and digest) would be an earlier test's, already charged in the database.
        self._seed = uuid.uuid4().hex

    def data_for(self, n: int) -> bytes:
        """The bytes the ``n``-th compile (from 1) returns."""
        seed = hashlib.sha256(f"{self._seed}-{n}".encode()).digest()
        return (seed * (self.size // len(seed) + 1))[: self.size]

    def compile(self, recipe: Recipe, link_inputs: Sequence[bytes] = ()) -> CompileOutput:
        """A stand-in compile."""
        with self._lock:
            self._n += 1
            n = self._n
            self.running += 1
            self.peak = max(self.peak, self.running)
        try:
            time.sleep(self.delay)
            if self.fail:
                raise CompileError(None, "error: a stand-in compile error")
        finally:
            with self._lock:
                self.running -= 1
        return CompileOutput(
            data=self.data_for(n),
            kind="cubin",
            target="sm_80",
            toolchain="fake",
            log="",
            lowered_names={},
            dependencies=(),
            dependencies_exact=True,
            compile_seconds=self.delay,
        )


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """One migrated database per backend for the whole module."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('quota-db') / 'kcache.db'}"
        upgrade(url)
        yield url
    else:
        with pg_database() as url:
            upgrade(url)
            yield url


@pytest.fixture
def engines(db_url: str) -> Iterator[list[sa.Engine]]:
    """Two engines on the module's database: two replicas' connection pools."""
    from kcache_server.db import open_database

    made = [open_database(db_url), open_database(db_url)]
    yield made
    for engine in made:
        engine.dispose()


def _quota(inner: FakeCompiler, db: sa.Engine, quota: int, **kwargs: Any) -> Any:
    from kcache_server.quotas import QuotaCompiler

    kwargs.setdefault("max_artifact_bytes", 32 << 20)
    return QuotaCompiler(cast(Any, inner), db, quota_bytes=quota, **kwargs)


def _compile_as(caller: str, compiler: Any) -> CompileOutput:
    """``compiler.compile`` in a context whose current caller is ``caller``."""
    from kcache_server.fairness import current_caller

    def run() -> CompileOutput:
        current_caller.set(caller)
        return cast(CompileOutput, compiler.compile(cast(Recipe, None)))

    return contextvars.copy_context().run(run)


def _attempt(caller: str, compiler: Any) -> str:
    """``compiled`` or the refusal's error code (``quota_exceeded``)."""
    from kcache_server.errors import QuotaExceededError

    try:
        _compile_as(caller, compiler)
    except QuotaExceededError:
        return "quota_exceeded"
    return "compiled"


def _charged(db: sa.Engine, caller: str) -> int:
    with db.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT COALESCE(SUM(size), 0) FROM compile_charges WHERE caller = :c"),
                {"c": caller},
            ).scalar_one()
        )


def _reservations(db: sa.Engine, caller: str) -> int:
    with db.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT COUNT(*) FROM quota_reservations WHERE caller = :c"), {"c": caller}
            ).scalar_one()
        )


def _reserve_by_hand(db: sa.Engine, caller: str, size: int, expires_in_s: float) -> None:
    """A reservation another process holds (or held, and died: ``expires_in_s`` < 0)."""
    from kcache_server.models import QuotaReservation, utcnow

    now = utcnow()
    with db.begin() as conn:
        conn.execute(
            sa.insert(QuotaReservation.__table__).values(
                caller=caller,
                size=size,
                created_at=now,
                expires_at=now + timedelta(seconds=expires_in_s),
            )
        )


def test_concurrent_compiles_on_two_replicas_never_charge_past_the_quota(
    engines: list[sa.Engine],
) -> None:
    """30 compiles of 1,000 bytes at once under a 10,500-byte quota: exactly 10 are charged."""
    caller = unique("token:many")
    inners = [FakeCompiler(1000), FakeCompiler(1000)]
    compilers = [_quota(inner, db, 10_500) for inner, db in zip(inners, engines, strict=True)]
    with ThreadPoolExecutor(max_workers=30) as pool:
        outcomes = Counter(pool.map(lambda i: _attempt(caller, compilers[i % 2]), range(30)))
    assert _charged(engines[0], caller) == 10_000, outcomes
    assert outcomes == {"compiled": 10, "quota_exceeded": 20}
    assert _reservations(engines[0], caller) == 0  # every one settled or released


def test_far_from_the_quota_compiles_run_at_once_and_near_it_one_at_a_time(
    engines: list[sa.Engine],
) -> None:
    """A compile reserves ``min(room, max_artifact_bytes)``: only room for one means one at a time."""
    far, near = unique("token:far"), unique("token:near")
    wide = FakeCompiler(1000, delay=0.2)
    roomy = _quota(wide, engines[0], 1 << 20, max_artifact_bytes=10_000)
    with ThreadPoolExecutor(max_workers=8) as pool:
        assert set(pool.map(lambda _: _attempt(far, roomy), range(8))) == {"compiled"}
    assert wide.peak >= 4  # 8 x 10,000 reserved of 1 MiB: nobody waited
    narrow = FakeCompiler(1000, delay=0.05)
    tight = _quota(narrow, engines[0], 3000, max_artifact_bytes=10_000)
    with ThreadPoolExecutor(max_workers=5) as pool:
        outcomes = Counter(pool.map(lambda _: _attempt(near, tight), range(5)))
    assert narrow.peak == 1  # each reserved all the room left; the others waited for it
    assert outcomes == {"compiled": 3, "quota_exceeded": 2}
    assert _charged(engines[0], near) == 3000


def test_a_compile_waiting_for_room_gets_what_the_one_before_it_gave_back(
    engines: list[sa.Engine],
) -> None:
    """The first holds the whole quota; the second waits, then fits in what the first did not use."""
    caller = unique("token:wait")
    inner = FakeCompiler(700, delay=0.4)
    compiler = _quota(inner, engines[0], 1500)
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(_attempt, caller, compiler)
        time.sleep(0.1)
        second = pool.submit(_attempt, caller, compiler)
        assert (first.result(), second.result()) == ("compiled", "compiled")
    assert _charged(engines[0], caller) == 1400 and inner.peak == 1


def test_a_failed_compile_releases_its_reservation(engines: list[sa.Engine]) -> None:
    caller = unique("token:fail")
    with pytest.raises(CompileError):
        _compile_as(caller, _quota(FakeCompiler(1000, fail=True), engines[0], 1000))
    assert _reservations(engines[0], caller) == 0 and _charged(engines[0], caller) == 0
    # The whole quota is still there: a compile of exactly the quota fits.
    _compile_as(caller, _quota(FakeCompiler(1000), engines[0], 1000))
    assert _charged(engines[0], caller) == 1000


def test_output_over_max_artifact_bytes_is_released_and_never_charged(
    engines: list[sa.Engine],
) -> None:
    caller = unique("token:large")
    output = _compile_as(
        caller, _quota(FakeCompiler(5000), engines[0], 100_000, max_artifact_bytes=4096)
    )
    assert len(output.data) == 5000  # for the engine to refuse (422 artifact_too_large)
    assert _reservations(engines[0], caller) == 0 and _charged(engines[0], caller) == 0


def test_a_dead_process_reservation_stops_counting_when_it_expires(
    engines: list[sa.Engine],
) -> None:
    from kcache_server.errors import QuotaExceededError

    caller = unique("token:dead")
    _reserve_by_hand(engines[1], caller, 1000, expires_in_s=-1)  # its process died long ago
    _compile_as(caller, _quota(FakeCompiler(1000), engines[0], 1000))
    assert _charged(engines[0], caller) == 1000
    assert _reservations(engines[0], caller) == 0  # the expired one was deleted

    other = unique("token:alive")
    _reserve_by_hand(engines[1], other, 1000, expires_in_s=600)  # another replica compiling
    started = time.monotonic()
    with pytest.raises(QuotaExceededError, match="compiles in progress hold"):
        _compile_as(other, _quota(FakeCompiler(1000), engines[0], 1000, wait_s=0.3, poll_s=0.05))
    assert time.monotonic() - started >= 0.3  # it waited for the other to settle, then gave up
    assert _charged(engines[0], other) == 0


def test_output_larger_than_its_reservation_is_charged_only_if_it_still_fits(
    engines: list[sa.Engine],
) -> None:
    """Reserved 500 (all the room left), produced 1,000: refused, nothing charged past the quota."""
    from kcache_server.errors import QuotaExceededError

    caller = unique("token:settle")
    compiler = _quota(FakeCompiler(1000), engines[0], 2500, max_artifact_bytes=None)
    _compile_as(caller, compiler)
    _reserve_by_hand(engines[1], caller, 1000, expires_in_s=600)  # another compile in progress
    with pytest.raises(QuotaExceededError, match="would take it past its quota"):
        _compile_as(caller, compiler)
    assert _charged(engines[0], caller) == 1000
    with engines[0].begin() as conn:  # that compile failed on its replica: released
        conn.execute(sa.text("DELETE FROM quota_reservations WHERE caller = :c"), {"c": caller})
    _compile_as(caller, compiler)
    assert _charged(engines[0], caller) == 2000


def test_a_charge_whose_publish_failed_long_ago_is_taken_over(engines: list[sa.Engine]) -> None:
    """Another caller's charge for these bytes, never followed by their row: this caller pays now."""
    from kcache_server.models import CompileCharge, utcnow

    caller, other = unique("token:takes"), unique("token:failed")
    inner = FakeCompiler(1000)
    digest = hashlib.sha256(inner.data_for(1)).hexdigest()
    with engines[0].begin() as conn:
        conn.execute(
            sa.insert(CompileCharge.__table__).values(
                digest=digest, caller=other, size=1000, created_at=utcnow() - timedelta(days=1)
            )
        )
    _compile_as(caller, _quota(inner, engines[0], 5000))
    assert (_charged(engines[0], caller), _charged(engines[0], other)) == (1000, 0)
