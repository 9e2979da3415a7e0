"""The kernel-lookup figures of ``/v1/stats``: hit rate, hits by source, compiles avoided, reasons.

Read from ``audit_lookups`` (:mod:`~kcache_server.auditing.lookups`, one row per kernel
lookup, decided when it was written) over the window (by the time of the first lookup)
and the query's filters: one ``GROUP BY`` per section (the totals and miss reasons, the
groups, a job's ranks, the series, the most missed kernels, the savings per reporter),
each a range scan of ``(at)``, ``(job_id, at)`` or ``(kernel, at)``. Every figure is made
by :class:`Figures`, so a group, a rank, a bucket and the whole window add up the same way:
the foreign lookups by library (:func:`read_foreign_by_library`) too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from kcache_server.auditing.lookups import reason_text
from kcache_server.auditing.stats_models import GROUP_BY, StatsQuery
from kcache_server.auditing.window_source import epoch
from kcache_server.models import audit_lookups_table as _lookups

__all__ = [
    "Figures",
    "read_foreign_by_library",
    "read_lookup_groups",
    "read_lookup_ranks",
    "read_lookup_series",
    "read_lookup_totals",
    "read_missed_kernels",
    "read_reporter_savings",
]

_FILTERS = ("job_id", "client_id", "kernel", "target")


@dataclass
class Figures:
    """Kernel lookups added up: hits (observed, reported), misses, compiles avoided, reasons."""

    lookups: int = 0
    hits: int = 0
    observed: int = 0  # kernel lookups whose first lookup the server observed
    observed_hits: int = 0
    reported_hits: int = 0
    avoided: int = 0
    saved: float = 0.0
    reported_saved: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)

    def add(
        self, outcome: str, tier: str, hit: bool, reason: str | None, n: int, saved: float
    ) -> None:
        """Count ``n`` kernel lookups alike (one ``GROUP BY`` row)."""
        server = tier == "server"
        self.lookups += n
        self.observed += n if server else 0
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + n
        if hit:
            self.hits += n
            if server:
                self.observed_hits += n
            else:
                self.reported_hits += n
        else:
            code = reason or outcome
            self.reasons[code] = self.reasons.get(code, 0) + n
        if outcome in ("hit", "local_hit"):
            self.avoided += n
            self.saved += saved
            if not server:
                self.reported_saved += saved

    @property
    def misses(self) -> int:
        return self.lookups - self.hits

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None

    def fields(self) -> dict[str, Any]:
        """The kernel-lookup fields of an ``OutcomeCounts`` (a group, a rank, a bucket)."""
        return {
            "kernel_lookups": self.lookups,
            "kernel_hits": self.hits,
            "kernel_misses": self.misses,
            "hit_rate": self.hit_rate,
            "observed_hits": self.observed_hits,
            "reported_hits": self.reported_hits,
            "compiles_avoided": self.avoided,
            "compile_seconds_saved": self.saved,
        }

    def miss_reasons(self) -> list[dict[str, Any]]:
        """The misses by reason, most first: code, words and how many."""
        ranked = sorted(self.reasons.items(), key=lambda item: (-item[1], item[0]))
        return [
            {"reason": code, "text": reason_text(code) or code, "kernel_lookups": n}
            for code, n in ranked
        ]


def _where(query: StatsQuery) -> list[sa.ColumnElement[bool]]:
    c = _lookups.c
    conds: list[sa.ColumnElement[bool]] = []
    if query.since is not None:
        conds.append(c.at >= query.since)
    if query.until is not None:
        conds.append(c.at < query.until)
    for name in _FILTERS:
        value = getattr(query, name)
        if value is not None:
            conds.append(c[name] == value)
    return conds


_SUMS = (sa.func.sum(_lookups.c["count"]), sa.func.sum(_lookups.c.saved))
_KIND = (_lookups.c.outcome, _lookups.c.tier, _lookups.c.hit, _lookups.c.reason)


def _fill(figures: Figures, rows: Iterable[Any]) -> None:
    for outcome, tier, hit, reason, n, saved in rows:
        figures.add(outcome, tier, bool(hit), reason, int(n), float(saved or 0.0))


def read_lookup_totals(conn: sa.Connection, query: StatsQuery) -> Figures:
    """The window's kernel lookups, added up."""
    figures = Figures()
    _fill(
        figures,
        conn.execute(sa.select(*_KIND, *_SUMS).where(*_where(query)).group_by(*_KIND)),
    )
    return figures


def read_lookup_groups(conn: sa.Connection, query: StatsQuery) -> dict[Any, Figures]:
    """The kernel lookups of each value of ``query.group_by``."""
    if query.group_by is None:
        return {}
    col = _lookups.c[GROUP_BY[query.group_by]]
    rows = conn.execute(sa.select(col, *_KIND, *_SUMS).where(*_where(query)).group_by(col, *_KIND))
    groups: dict[Any, Figures] = defaultdict(Figures)
    for key, *rest in rows:
        _fill(groups[key], [rest])
    return dict(groups)


def read_lookup_ranks(
    conn: sa.Connection, query: StatsQuery, jobs: list[Any]
) -> dict[tuple[Any, Any], Figures]:
    """The kernel lookups of each (job, rank) of ``jobs``."""
    if not jobs:
        return {}
    c = _lookups.c
    rows = conn.execute(
        sa.select(c.job_id, c.rank, *_KIND, *_SUMS)
        .where(*_where(query), c.job_id.in_(jobs))
        .group_by(c.job_id, c.rank, *_KIND)
    )
    ranks: dict[tuple[Any, Any], Figures] = defaultdict(Figures)
    for job, rank, *rest in rows:
        _fill(ranks[(job, rank)], [rest])
    return dict(ranks)


def read_lookup_series(conn: sa.Connection, query: StatsQuery, step: int) -> dict[int, Figures]:
    """The kernel lookups of each series bucket (``step`` seconds, by the first lookup's time)."""
    if step <= 0:
        return {}
    dialect = conn.dialect.name
    seconds = epoch(dialect, _lookups.c.at)
    bucket = (
        (sa.cast(seconds, sa.BigInteger) // step).label("b")
        if dialect == "sqlite"
        else sa.func.floor(seconds / step).label("b")
    )
    rows = conn.execute(
        sa.select(bucket, *_KIND, *_SUMS).where(*_where(query)).group_by(bucket, *_KIND)
    )
    series: dict[int, Figures] = defaultdict(Figures)
    for b, *rest in rows:
        _fill(series[int(b)], [rest])
    return dict(series)


@dataclass
class MissedKernelFigures:
    """A kernel's missed kernel lookups: how many, by first outcome and by reason."""

    kernel: str | None
    misses: int
    outcomes: dict[str, int]
    reasons: dict[str, int]


def read_missed_kernels(conn: sa.Connection, query: StatsQuery) -> list[MissedKernelFigures]:
    """The ``query.top`` kernels with the most missed kernel lookups, most first."""
    c = _lookups.c
    totals = (
        sa.select(c.kernel, sa.func.sum(c["count"]).label("misses"))
        .where(*_where(query), c.hit.is_(False))
        .group_by(c.kernel)
        .order_by(sa.func.sum(c["count"]).desc(), c.kernel)
        .limit(query.top)
        .subquery("top")
    )
    rows = conn.execute(
        sa.select(totals.c.kernel, totals.c.misses, c.outcome, c.reason, sa.func.sum(c["count"]))
        .join_from(
            totals,
            _lookups,
            sa.or_(
                totals.c.kernel == c.kernel, sa.and_(totals.c.kernel.is_(None), c.kernel.is_(None))
            ),
        )
        .where(*_where(query), c.hit.is_(False))
        .group_by(totals.c.kernel, totals.c.misses, c.outcome, c.reason)
    ).all()
    found: dict[Any, MissedKernelFigures] = {}
    for kernel, misses, outcome, reason, n in rows:
        item = found.setdefault(kernel, MissedKernelFigures(kernel, int(misses), {}, {}))
        item.outcomes[outcome] = item.outcomes.get(outcome, 0) + int(n)
        code = reason or outcome
        item.reasons[code] = item.reasons.get(code, 0) + int(n)
    return sorted(found.values(), key=lambda m: (-m.misses, m.kernel or ""))


def read_reporter_savings(conn: sa.Connection, query: StatsQuery) -> dict[str | None, float]:
    """The compile time each reporter's kernel lookups avoided (reported ones only)."""
    c = _lookups.c
    rows = conn.execute(
        sa.select(c.reporter, sa.func.sum(c.saved))
        .where(*_where(query), c.tier != "server", c.outcome.in_(("hit", "local_hit")))
        .group_by(c.reporter)
    )
    return {reporter: float(saved or 0.0) for reporter, saved in rows}


#: How ``GET /v1/foreign/{library}/{key}`` names its lookup's kernel: ``foreign:<library>:<key>``.
_FOREIGN_PREFIX = "foreign:"


def _foreign_library(dialect: str, kernel: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """SQL reading the library out of a foreign lookup's kernel ``foreign:<library>:<key>``.

    A library's name holds no ``:`` (:data:`kcache.foreign.LIBRARY_PATTERN`), so it is the
    text between the first two. PostgreSQL has ``split_part``; SQLite takes what follows
    the prefix up to its first ``:`` (one appended, so a kernel without a key still reads).
    """
    if dialect == "postgresql":
        return sa.func.split_part(kernel, ":", 2)
    rest = sa.func.substr(kernel, len(_FOREIGN_PREFIX) + 1, type_=sa.String)
    return sa.func.substr(rest, 1, sa.func.instr(rest + ":", ":") - 1, type_=sa.String)


def read_foreign_by_library(conn: sa.Connection, query: StatsQuery) -> dict[str, Figures]:
    """The window's foreign lookups (``GET /v1/foreign/...``) by library, most looked up first.

    One ``GROUP BY`` over ``audit_lookups``, under the window and filters of the hit rate
    (they are kernel lookups like the others: each names no process, so each is one of
    its own, and they are part of the headline). No column holds the library alone:
    :func:`~kcache_server.routes.foreign.lookup` writes the kernel as
    ``foreign:<library>:<key>`` (the toolchain as ``<library>-<version>/<toolchain>``,
    in ``audit_events`` only), so the library is parsed from the kernel in SQL
    (:func:`_foreign_library`). A row is a foreign lookup when its kernel has the prefix
    and it is the server's own lookup of no recipe and no digest, as that route writes
    it: a fetch or a client's report of a kernel so named is not one. Read here rather
    than from ``audit_events`` (whose ``route`` says ``foreign``): the window's raw events
    are what ``/v1/stats`` never scans, and these rows cover the retention window, as
    the hit rate does.
    """
    c = _lookups.c
    prefix = _FOREIGN_PREFIX
    library = _foreign_library(conn.dialect.name, c.kernel).label("library")
    rows = conn.execute(
        sa.select(library, *_KIND, *_SUMS)
        .where(
            *_where(query),
            sa.func.substr(c.kernel, 1, len(prefix)) == prefix,
            c.tier == "server",
            c.recipe_key.is_(None),
            c.base_key.is_(None),
            c.digest.is_(None),
        )
        .group_by(library, *_KIND)
    )
    found: dict[str, Figures] = defaultdict(Figures)
    for name, *rest in rows:
        _fill(found[str(name)], [rest])
    return dict(sorted(found.items(), key=lambda item: (-item[1].lookups, item[0])))
