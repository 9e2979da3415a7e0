"""How a ``/v1/stats`` window is read exactly: as spans of count rows and raw pieces.

``audit_counts`` (:mod:`~kcache_server.auditing.counts`) holds every event in its
minute (dimension ``all``), hour and UTC day; roll-ups (``audit_rollups``) hold old
events at their hour's start. :func:`plan` splits a window into :class:`CountSpan` s
(count rows of one level, added or taken away) and :class:`RawPiece` s (raw events and
roll-ups of a span, likewise), which together hold exactly the window's events while
reading as few rows as it can: whole days and hours from counts, the partial hours at
the edges from minute rows or raw events (:func:`_edge`), a partly covered day as its
row less its hours outside the window (:func:`_days_less_hours`). Time arithmetic
only: :mod:`~kcache_server.auditing.window_source` turns a plan into SQL.
"""

from __future__ import annotations

import itertools
import time
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from kcache_server.auditing.stats_models import StatsQuery

__all__ = [
    "DAY",
    "HOUR",
    "LATEST",
    "MINUTE",
    "CountSpan",
    "RawPiece",
    "Span",
    "ceil_to",
    "epoch_of",
    "floor_to",
    "later",
    "plan",
]

Span = tuple[datetime | None, datetime | None]  # [start, end), None: unbounded
HOUR = 3600
DAY = 86400
MINUTE = 60
LATEST = datetime.max.replace(tzinfo=timezone.utc)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_SECOND = timedelta(seconds=1)


def later(at: datetime, seconds: int) -> datetime:
    """``at`` plus ``seconds``, or the latest time there is (a query may name 9999-12-31)."""
    if at > LATEST - timedelta(seconds=seconds):
        return LATEST
    return at + timedelta(seconds=seconds)


def ceil_to(at: datetime, level: int) -> datetime:
    floor = floor_to(at, level)
    return floor if floor == at else later(floor, level)


def floor_to(at: datetime, level: int) -> datetime:
    # Whole seconds by integer arithmetic: at.timestamp() is a float, which rounds
    # 9999-12-31 23:59:59.999999 (LATEST, a query may name it) up into year 10000.
    seconds = (at - _EPOCH) // _SECOND
    return _EPOCH + timedelta(seconds=seconds - seconds % level)


def _cover(
    lo: datetime | None, hi: datetime | None, levels: tuple[int, ...]
) -> tuple[list[tuple[int, Span]], list[Span]]:
    """``[lo, hi)`` as spans of count rows (coarsest level first), and what is left for raw."""
    if lo is not None and hi is not None and lo >= hi:
        return [], []
    if not levels:
        return [], [(lo, hi)]
    level, finer = levels[0], levels[1:]
    a = None if lo is None else ceil_to(lo, level)
    b = None if hi is None else floor_to(hi, level)
    if a is not None and b is not None and a >= b:
        return _cover(lo, hi, finer)
    spans: list[tuple[int, Span]] = [(level, (a, b))]
    raw: list[Span] = []
    for piece in ((lo, a), (b, hi)):
        if piece[0] is not None and piece[1] is not None and piece[0] != piece[1]:
            more, left = _cover(*piece, finer)
            spans += more
            raw += left
    return spans, raw


class CountSpan(NamedTuple):
    """Count rows of one ``level`` in ``[start, end)``, added (``sign`` 1) or taken away (-1).

    ``unless_rolled``: read only where no roll-up holds that hour (minute rows place a
    rolled-up event at its minute, a roll-up at its hour's start).
    """

    level: int
    span: Span
    sign: int = 1
    unless_rolled: datetime | None = None


class RawPiece(NamedTuple):
    """Raw events and roll-ups in ``[start, end)``, added (``sign`` 1) or taken away (-1).

    ``if_rolled``: read only where a roll-up holds that hour (the other side of a
    :class:`CountSpan`'s ``unless_rolled``).
    """

    span: Span
    sign: int = 1
    if_rolled: datetime | None = None


def _days_less_hours(lo: datetime, hi: datetime, now: float) -> list[CountSpan] | None:
    """Whole hours ``[lo, hi)`` inside one UTC day as that day's row less the day's other hours.

    Counts add up (every event is in its day's row and in its hour's row), so the day
    less the hours outside the window is exactly the hours inside it. Worth it when
    that reads fewer rows per key: 1 day row and the other hours that can hold rows
    (none after ``now``), against one row per hour inside. A window ending now
    covers today by 2 rows instead of up to 23. None where hours read fewer.
    """
    day = floor_to(lo, DAY)
    end = later(day, DAY)
    written_until = min(end, ceil_to(datetime.fromtimestamp(now, timezone.utc), HOUR))
    inside = (hi - lo).total_seconds() // HOUR
    outside = (lo - day).total_seconds() // HOUR + max(
        0.0, (written_until - hi).total_seconds() // HOUR
    )
    if 1 + outside >= inside:
        return None
    spans = [CountSpan(DAY, (day, end))]
    # Subtract up to the day's end, not just to now: exact whatever rows exist.
    spans += [CountSpan(HOUR, piece, -1) for piece in ((day, lo), (hi, end)) if piece[0] < piece[1]]
    return spans


def _live_s(span: tuple[datetime, datetime], now: float) -> float:
    """Seconds of ``span`` up to ``now``: how many events it can hold, as far as time tells."""
    end = min(span[1].timestamp(), now)
    return max(0.0, end - span[0].timestamp())


def _edge(
    piece: tuple[datetime, datetime], levels: tuple[int, ...], now: float
) -> tuple[list[CountSpan], list[RawPiece], bool]:
    """A piece of a window inside one hour, read from as few raw events as exactness allows.

    Returns count spans, raw pieces, and whether the piece's whole hour is to be
    counted too (its hour row, less the raw pieces returned). With minute rows
    (dimension ``all``): the whole minutes from them, unless a roll-up holds the hour
    (then raw, as a roll-up is counted at its hour's start), and the seconds at either
    end raw. With hour rows: the hour's row less the raw events of the hour outside
    the piece, where those are under half the piece's own by time up to ``now`` (a
    piece ending now leaves the hour's rest, which holds nothing yet). Exact with
    roll-ups too: the hour's row holds its roll-ups and raw events, and the raw outside
    the piece takes away the roll-ups with the events (a roll-up lies at the hour's
    start, outside a piece starting later, inside one starting there). Otherwise the
    piece is read raw.
    """
    start, end = piece
    hour = floor_to(start, HOUR)
    first, last = ceil_to(start, MINUTE), floor_to(end, MINUTE)
    if MINUTE in levels and first < last:
        seconds = [RawPiece(p) for p in ((start, first), (last, end)) if p[0] < p[1]]
        return (
            [CountSpan(MINUTE, (first, last), unless_rolled=hour)],
            [RawPiece((first, last), if_rolled=hour), *seconds],
            False,
        )
    outside = [p for p in ((hour, start), (end, later(hour, HOUR))) if p[0] < p[1]]
    if HOUR in levels and 2 * sum(_live_s(p, now) for p in outside) < _live_s(piece, now):
        return [], [RawPiece(p, -1) for p in outside], True
    return [], [RawPiece(piece)], False


def plan(
    query: StatsQuery, levels: tuple[int, ...], subtract: bool = True
) -> tuple[list[CountSpan], list[RawPiece]]:
    """Count spans and raw pieces that together make the query's window exactly.

    Partial hours at the edges are read as :func:`_edge` decides: raw events where
    counts cannot say what they held (a roll-up counts an event by its hour's start),
    or an hour's row less the rest of the hour, which then joins the whole hours. With
    ``subtract`` (and day and hour levels), the whole hours of a partly covered day
    may be that day's row less its other hours (:func:`_days_less_hours`); the series
    passes False, since its buckets must each hold only their own rows (an hour less
    part of itself stays in its own bucket, as the series' levels divide its step).
    """
    now = time.time()
    since, until = query.since, query.until
    lo = None if since is None else ceil_to(since, HOUR)
    hi = None if until is None else floor_to(until, HOUR)
    coarse = tuple(sorted((lv for lv in levels if lv >= 60), reverse=True))
    spans: list[CountSpan] = []
    raw: list[RawPiece] = []
    if since is not None and until is not None and lo is not None and hi is not None and hi <= lo:
        # No whole hour: the window inside one hour, or across one hour's end.
        cut = [since, *([lo] if since < lo < until else []), until]
        for piece in itertools.pairwise(cut):
            more, left, whole_hour = _edge(piece, coarse, now)
            hour = floor_to(piece[0], HOUR)
            spans += more + ([CountSpan(HOUR, (hour, later(hour, HOUR)))] if whole_hour else [])
            raw += left
        return spans, raw
    if since is not None and lo is not None and since != lo:
        more, left, whole_hour = _edge((since, lo), coarse, now)
        spans, raw = spans + more, raw + left
        lo = floor_to(since, HOUR) if whole_hour else lo
    if until is not None and hi is not None and hi != until:
        more, left, whole_hour = _edge((hi, until), coarse, now)
        spans, raw = spans + more, raw + left
        hi = later(hi, HOUR) if whole_hour else hi
    if not (subtract and DAY in coarse and HOUR in coarse):
        plain, rest = _cover(lo, hi, coarse)
        return spans + [CountSpan(lv, span) for lv, span in plain], raw + [
            RawPiece(p) for p in rest
        ]
    # The partial days at either end, and the whole days between them.
    a = None if lo is None else ceil_to(lo, DAY)
    b = None if hi is None else floor_to(hi, DAY)
    if a is not None and b is not None and a > b:  # [lo, hi) inside one day
        partial, whole = [(lo, hi)], None
    else:
        partial = [p for p in ((lo, a), (b, hi)) if p[0] is not None and p[0] != p[1]]
        whole = (a, b) if a != b or a is None else None
    if whole is not None:
        spans.append(CountSpan(DAY, whole))
    for p_lo, p_hi in partial:
        assert p_lo is not None and p_hi is not None  # a partial day has both ends
        less = _days_less_hours(p_lo, p_hi, now)
        if less is not None:
            spans += less
            continue
        hours, rest = _cover(p_lo, p_hi, coarse[1:])
        spans += [CountSpan(lv, span) for lv, span in hours]
        raw += [RawPiece(p) for p in rest]
    return spans, raw


def epoch_of(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None
