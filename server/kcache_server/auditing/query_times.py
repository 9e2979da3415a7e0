"""The times a ``GET /v1/stats`` query may name, and their one reading.

Unix seconds, an RFC 3339 date or date-time, or a span back from now (``15m``,
``7d``), each bounded to the years 1970 to 9999. The patterns are published as the
query parameters' schema (``routes/stats.py``) and checked here with the same
expressions, so the schema and the server accept the same strings.
"""

from __future__ import annotations

import re
import time
from datetime import datetime, timedelta, timezone

from kcache_server.errors import InvalidRequestError

__all__ = ["SPAN_PATTERN", "UNIX_TIME_PATTERN", "YEAR_PATTERN", "parse_time", "parse_window"]

# Times a query may name: the unix epoch up to the last second of year 9999.
_MAX_UNIX_S = 253_402_300_799.0


def _digits_at_most(limit: int) -> str:
    """A pattern for decimal integers from 0 to ``limit`` (leading zeros allowed below its length)."""
    digits = str(limit)
    shorter = [f"[0-9]{{1,{len(digits) - 1}}}"] if len(digits) > 1 else []
    lower = [
        f"{digits[:i]}[0-{int(d) - 1}][0-9]{{{len(digits) - i - 1}}}"
        for i, d in enumerate(digits)
        if d != "0"
    ]
    return "|".join([*shorter, *lower])


# The grammar of a query time, published as the parameters' schema (GET /v1/stats)
# and checked here with the same patterns (fullmatch, ASCII digits: "15m\n" and
# Unicode digits are not times). Each form names only times from 1970 to 9999:
#: Unix seconds in decimal (``str(time.time())``), at most the last second of the year 9999.
UNIX_TIME_PATTERN = (
    f"^(?:(?:{_digits_at_most(int(_MAX_UNIX_S) - 1)})(?:\\.[0-9]+)?|{int(_MAX_UNIX_S)}(?:\\.0+)?)$"
)
#: A span back from now, bounded per unit so it never reaches back before 1970.
SPAN_PATTERN = (
    "^-?(?:"
    + "|".join(
        f"[0-9]{{1,{n}}}(?:\\.[0-9]{{1,6}})?{unit}"
        for unit, n in (("s", 9), ("m", 7), ("h", 5), ("d", 4), ("w", 3))
    )
    + ")$"
)
#: The years an RFC 3339 date or date-time may name (no offset can carry them past 1970 to 9999).
YEAR_PATTERN = "^(?:19[7-9][0-9]|[2-8][0-9]{3}|9[0-8][0-9]{2}|99[0-8][0-9]|999[0-8])-"
_UNIX = re.compile(UNIX_TIME_PATTERN[1:-1])
_RELATIVE = re.compile("-?([0-9.]+)([smhdw])")  # its digits, once SPAN_PATTERN matched
_SPAN = re.compile(SPAN_PATTERN[1:-1])
_YEARS = range(1970, 9999)  # what YEAR_PATTERN allows
# RFC 3339 (what JSON Schema's "date" and "date-time" formats are), as written.
_RFC3339 = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})"
    r"(?:[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]+))?(?:([Zz])|([+-])([0-9]{2}):([0-9]{2})))?"
)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_time(value: str | None, field: str, now: float | None = None) -> datetime | None:
    """A query's time: unix seconds, an RFC 3339 date or date-time, or a span back from now.

    The forms are :data:`UNIX_TIME_PATTERN`, :data:`SPAN_PATTERN` (``15m``, ``-2h``,
    ``7d``) and RFC 3339 with a year from :data:`YEAR_PATTERN` (``2024-05-01``,
    ``2024-05-01T10:00:00Z``); empty means no bound. Anything else is an
    :class:`~kcache_server.errors.InvalidRequestError` naming ``field`` (a 422).
    """
    if value is None or value == "":
        return None
    now = time.time() if now is None else now
    if len(value) > 64:
        raise InvalidRequestError(
            field, "is longer than 64 characters; send a time, not a document"
        )
    if _UNIX.fullmatch(value):
        return datetime.fromtimestamp(float(value), timezone.utc)
    if _SPAN.fullmatch(value):
        match = _RELATIVE.fullmatch(value)
        assert match is not None
        seconds = now - float(match[1]) * _UNIT_S[match[2]]
        if seconds < 0:  # only with a clock set before 2001
            raise InvalidRequestError(field, f"{value!r} reaches back before 1970")
        return datetime.fromtimestamp(seconds, timezone.utc)
    parsed = _rfc3339(value)
    if parsed is None:
        raise InvalidRequestError(
            field,
            f"{value!r} is not a time: send unix seconds (up to {_MAX_UNIX_S:.0f}), an RFC 3339 "
            "date or date-time from 1970 to 9998 (2024-05-01, 2024-05-01T10:00:00Z), "
            "or a span back from now (15m, 2h, 7d)",
        )
    return parsed


def parse_window(
    since: str | None, until: str | None, fields: tuple[str, str]
) -> tuple[datetime | None, datetime | None]:
    """A query's window, each end as :func:`parse_time` reads it (``fields`` name them); a
    window that ends before it starts is an InvalidRequestError naming the end (it held
    nothing, and its figures read as an empty window rather than as a mistake)."""
    now = time.time()
    start, end = parse_time(since, fields[0], now), parse_time(until, fields[1], now)
    if start is not None and end is not None and end < start:
        raise InvalidRequestError(
            fields[1],
            f"{until!r} ({end:%Y-%m-%d %H:%M:%S}Z) is before {fields[0]} {since!r} "
            f"({start:%Y-%m-%d %H:%M:%S}Z): a window ends after it starts (a span such as 2h "
            "counts back from now)",
        )
    return start, end


def _rfc3339(text: str) -> datetime | None:
    """``text`` as an RFC 3339 full-date (midnight UTC) or date-time, or None.

    A leap second (``23:59:60`` in UTC, which RFC 3339 allows) is read as the
    second before it: Python's datetime has no 60th second.
    """
    match = _RFC3339.fullmatch(text)
    if match is None:
        return None
    year, month, day, hour, minute, second, fraction, zulu, sign, off_h, off_m = match.groups()
    if int(year) not in _YEARS:
        return None
    try:
        if hour is None:
            return datetime(int(year), int(month), int(day), tzinfo=timezone.utc)
        if int(off_h or 0) > 23 or int(off_m or 0) > 59:
            return None
        offset = timedelta(hours=int(off_h or 0), minutes=int(off_m or 0))
        zone = timezone.utc if zulu else timezone(-offset if sign == "-" else offset)
        leap = second == "60"
        parsed = datetime(
            int(year),
            int(month),
            int(day),
            int(hour),
            int(minute),
            59 if leap else int(second),
            int((fraction or "0")[:6].ljust(6, "0")),
            tzinfo=zone,
        ).astimezone(timezone.utc)
    except ValueError:  # February 30, hour 24, ...
        return None
    if leap and (parsed.hour, parsed.minute) != (23, 59):
        return None
    return parsed
