"""The fetches nginx answered from its cache, read from its edge log into the audit.

Behind the deploy's nginx (``deploy/nginx/kcache.conf.template``) a warm fetch by key is
answered from nginx's cache for a couple of seconds without reaching this server; nginx
writes one ``kcache_edge`` line per such answer to a file (``edge_log``)::

    1 <unix time, ms> <status> <seconds> /v1/recipes/<recipe key>/artifact <digest>

:class:`EdgeLogTailer` follows that file in one process of the server (a file lock
beside it picks which, so several workers do not count a line twice) and hands each
well-formed line to ``on_hits`` in batches; the server records each as the fetch the
route would have recorded (:meth:`~kcache_server.resolving.Resolver.record_fetch`), so
the hit counts, ``/v1/stats`` and the dashboard count them: only a line whose recipe key
the index knows, bound to that very digest (``on_hits`` says how many it recorded; the
rest are counted in ``unknown``). Lines in the format are easy to write for whoever can
write the file, and a forged one must not move the server's own hit rate.

nginx writes the file, but every line is checked as if anyone could have: a line that
does not parse (wrong field count or version, a key or digest that is not 64 lower-case
hex, a time or status that is not a number, longer than :data:`MAX_LINE`) is counted in
``bad`` and skipped; one that parses but is no fetch (a status other than 200 or 304) is
counted in ``ignored``. A last line without its newline yet waits for it. The file may be
rotated (renamed, then ``nginx -s reopen``: the old one is read to its end, then the new
one from its start) or truncated (read again from the start). Where the tailer got to is
kept in ``<state_dir>/edge-log.offset`` (inode and offset), so a restart or another
worker taking over goes on from there, saved once per read of what was new (each poll); a
crash between recording a read's batches and saving the offset counts them again (at least
once, never lost).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kcache.keys import is_hex_key
from kcache.locks import try_file_lock

__all__ = ["MAX_LINE", "EdgeHit", "EdgeLogTailer", "parse_line"]

log = logging.getLogger(__name__)

#: The format's version, the first field (``log_format kcache_edge`` in the template).
VERSION = b"1"
#: A longer line is not one nginx wrote in this format (a key, a digest and a few numbers).
MAX_LINE = 512
_PREFIX = b"/v1/recipes/"
_SUFFIX = b"/artifact"
#: Statuses of a fetch answered from the cache: the bytes, or If-None-Match's 304.
_FETCHED = (200, 304)
#: Bytes read at a time.
_CHUNK = 1 << 20
#: Seconds between two log lines about bad lines.
_BAD_LOG_S = 60.0


@dataclass(frozen=True)
class EdgeHit:
    """Fetches nginx answered from its cache: ``count`` alike, the last ``at``, their mean latency."""

    at: float
    recipe_key: str
    digest: str
    status: int
    latency_ms: float
    count: int = 1


#: A well-formed line, whole (the fast path over a block of lines; :func:`parse_line` is
#: the same check, line by line, saying what is wrong).
_LINE = re.compile(
    rb"^1 (\d{1,12}(?:\.\d{1,6})?) (\d{3}) (\d{1,9}(?:\.\d{1,6})?) "
    rb"/v1/recipes/([0-9a-f]{64})/artifact ([0-9a-f]{64})$",
    re.MULTILINE,
)


#: The columns of a block, for :func:`_tally_whole` (the parts of :data:`_LINE`).
_PATH = re.compile(rb"/v1/recipes/([0-9a-f]{64})/artifact")
#: A line's digest, its newline and the next line's version.
_DIGEST_AND_NEXT = re.compile(rb"[0-9a-f]{64}\n1")
_HEX = re.compile(rb"[0-9a-f]{64}")
_STATUS = re.compile(rb"\d{3}")
_TIME = re.compile(rb"\d{1,12}(?:\.\d{1,6})?")
_SECONDS = re.compile(rb"\d{1,9}(?:\.\d{1,6})?")
_FETCHED_TEXT = tuple(str(status).encode() for status in _FETCHED)

#: Lines by (recipe key, digest, status), each ``[last time, sum of seconds, count]``.
_Groups = dict[tuple[bytes, bytes, bytes], list[float]]


def _group(rows: Iterable[tuple[bytes, bytes, bytes, float, float]]) -> _Groups:
    """Rows of (recipe key, digest, status, time, seconds) grouped as :data:`_Groups` says."""
    groups: _Groups = {}
    for key, digest, status, at, seconds in rows:
        group = groups.get((key, digest, status))
        if group is None:
            groups[(key, digest, status)] = [at, seconds, 1.0]
        else:
            group[0] = max(group[0], at)
            group[1] += seconds
            group[2] += 1.0
    return groups


def _tally_lines(block: bytes) -> _Groups:
    """The well-formed lines of ``block`` grouped, one :data:`_LINE` match each (any line)."""
    return _group((m[4], m[5], m[2], float(m[1]), float(m[3])) for m in _LINE.finditer(block))


def _values(column: list[bytes], form: re.Pattern[bytes]) -> dict[bytes, float] | None:
    """Each distinct text of ``column`` as its number; None if one is not of ``form``."""
    distinct = set(column)
    if not all(form.fullmatch(text) for text in distinct):
        return None
    return {text: float(text) for text in distinct}


def _tally_whole(block: bytes, lines: int) -> _Groups | None:
    """:func:`_tally_lines` of a ``block`` of ``lines`` lines all in the format; None if one is not.

    What nginx writes: every line well-formed, of few keys, many lines a millisecond.
    Matching :data:`_LINE` line by line spent most of its time checking the same 128 hex
    digits again. Here the block is split at its spaces once, into columns of the
    format's fields, and each distinct value of a column is checked (and made a number)
    once. A line's digest, its newline and the next line's version come as one field
    (``<digest>\n1``); a line of too few or too many fields puts a newline into another
    column or the count off, and the block goes line by line.
    """
    fields = block.split(b" ")
    if len(fields) != 5 * lines + 1 or fields[0] != VERSION:
        return None
    times, statuses, seconds, paths = fields[1::5], fields[2::5], fields[3::5], fields[4::5]
    joined = set(fields[5:-1:5])  # <digest>\n1
    if not all(_DIGEST_AND_NEXT.fullmatch(field) for field in joined):
        return None
    keys: dict[bytes, bytes] = {}
    for path in set(paths):
        m = _PATH.fullmatch(path)
        if m is None:
            return None
        keys[path] = m[1]
    distinct_statuses, last_digest = set(statuses), fields[-1]
    at_of, took_of = _values(times, _TIME), _values(seconds, _SECONDS)
    if (
        at_of is None
        or took_of is None
        or _HEX.fullmatch(last_digest) is None
        or not all(_STATUS.fullmatch(status) for status in distinct_statuses)
    ):
        return None
    if len(keys) == len(distinct_statuses) == 1 and joined <= {last_digest + b"\n1"}:
        # Every line alike (one key, digest and status): nothing line by line at all.
        kind = (next(iter(keys.values())), last_digest, statuses[0])
        spent = sum(map(took_of.__getitem__, seconds))
        return {kind: [max(at_of.values()), spent, float(lines)]}
    digests = [field[:-2] for field in fields[5:-1:5]]
    digests.append(last_digest)
    return _group(
        (keys[path], digest, status, at_of[at], took_of[took])
        for path, digest, status, at, took in zip(
            paths, digests, statuses, times, seconds, strict=True
        )
    )


class _Bad(ValueError):
    """A line that is not in the format."""


def _number(field: bytes, what: str) -> float:
    if not field or len(field) > 24 or not all(c in b"0123456789." for c in field):
        raise _Bad(f"{what} is not a number")
    value = float(field)
    if not math.isfinite(value):
        raise _Bad(f"{what} is not finite")
    return value


def parse_line(line: bytes) -> EdgeHit | None:
    """The hit a ``kcache_edge`` line (without its newline) stands for; None when it is no fetch.

    Raises ``ValueError`` for a line that is not in the format.
    """
    if len(line) > MAX_LINE:
        raise _Bad("too long")
    fields = line.split(b" ")
    if len(fields) != 6 or fields[0] != VERSION:
        raise _Bad("not six fields of version 1")
    _, at, status, seconds, path, digest = fields
    when = _number(at, "the time")
    if not (status.isdigit() and len(status) == 3):
        raise _Bad("the status is not three digits")
    latency = _number(seconds, "the seconds")
    if not (path.startswith(_PREFIX) and path.endswith(_SUFFIX)):
        raise _Bad("not a fetch by key")
    key = path[len(_PREFIX) : -len(_SUFFIX)].decode("ascii", "replace")
    code = int(status)
    if code not in _FETCHED:
        return None
    text = digest.decode("ascii", "replace")
    if not (is_hex_key(key) and is_hex_key(text)):
        raise _Bad("the key or digest is not 64 lower-case hex")
    return EdgeHit(when, key, text, code, latency * 1000.0)


class EdgeLogTailer:
    """Follows the edge log in one process; see the module docstring.

    ``on_hits`` gets each batch of hits, in the tailer's thread; it must be quick (the
    audit writer queues), and returns how many lines of them it recorded (None: all); the
    others are counted as ``unknown``. ``poll`` reads what is new once (the thread calls it every
    ``interval_s`` while it holds the lock; tests may call it directly).
    """

    def __init__(
        self,
        path: Path,
        state_dir: Path,
        on_hits: Callable[[list[EdgeHit]], int | None],
        *,
        interval_s: float = 0.5,
        rotate_grace_s: float = 3.0,
    ) -> None:
        self.path = path
        self.state_dir = state_dir
        self.on_hits = on_hits
        self.interval_s = interval_s
        #: After the path names a new file, the old one is read until it has been quiet
        #: this long (nginx writes it until its reopen, and its buffer once more).
        self.rotate_grace_s = rotate_grace_s
        self.lock_path = state_dir / "edge-log.lock"
        self.state_path = state_dir / "edge-log.offset"
        #: Lines read, by what became of them: hit, ignored (no fetch), unknown (a key or
        #: digest the index does not know: not recorded), bad (skipped).
        self.counts: dict[str, int] = {"hit": 0, "ignored": 0, "unknown": 0, "bad": 0}
        #: Times a rotation or truncation was followed.
        self.reopened = 0
        #: Called with (what, n) as lines are counted (e.g. Prometheus counters); quick, never raising.
        self.listeners: list[Callable[[str, int], None]] = []
        #: Whether this process holds the lock (is the one tailing).
        self.holding = False
        self._file: IO[bytes] | None = None
        self._inode: int | None = None
        self._offset = 0  # of the first byte not yet consumed (a partial line's start)
        self._partial = b""
        self._skipping = False  # inside an over-long line: drop up to its newline
        self._rotated_at: float | None = None
        self._bad_logged = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # The thread ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread: it takes the lock when it can, then tails until :meth:`close`."""
        self._thread = threading.Thread(target=self._loop, name="kcache-edge-log", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread, after a last read."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._close_file()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                with try_file_lock(self.lock_path, 0) as held:
                    if held:
                        self.holding = True
                        try:
                            self._tail()
                        finally:
                            self.holding = False
                            self._close_file()
            except Exception:  # a bug or an unreadable state dir must not kill the thread
                log.exception("edge log: tailing %s failed; trying again", self.path)
            self._stop.wait(max(self.interval_s, 1.0))

    def _tail(self) -> None:
        self._load_state()
        while True:
            try:
                self.poll()
            except Exception:
                log.exception("edge log: reading %s failed", self.path)
            if self._stop.wait(self.interval_s):
                with contextlib.suppress(Exception):
                    self.poll()  # what nginx flushed just before the stop
                return

    # Reading ------------------------------------------------------------------------

    def poll(self) -> int:
        """Read what is new, hand its hits to ``on_hits``; returns how many lines were read."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None
        if self._file is None:
            if st is None:
                return 0
            self._open(st.st_ino, self._offset if st.st_ino == self._inode else 0)
        assert self._file is not None
        lines = self._read_lines()
        if self._file is not None and st is not None and st.st_ino != self._inode:
            # Renamed away and a new file made: the old one is read until it is quiet.
            now = time.monotonic()
            if lines or self._rotated_at is None:
                self._rotated_at = now
            elif now - self._rotated_at >= self.rotate_grace_s:
                if self._partial:
                    self._count_bad(b"", "the file ended inside a line")
                self._close_file()
                self._open(st.st_ino, 0)
                self.reopened += 1
                lines += self._read_lines()
        else:
            self._rotated_at = None
        return lines

    def _open(self, inode: int, offset: int) -> None:
        try:
            handle = open(self.path, "rb")  # noqa: SIM115 - kept open across polls
        except FileNotFoundError:
            return
        actual = os.fstat(handle.fileno())
        if actual.st_ino != inode or actual.st_size < offset:
            offset = 0
        handle.seek(offset)
        self._file, self._inode, self._offset = handle, actual.st_ino, offset
        self._partial, self._skipping = b"", False

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = None

    def _read_lines(self) -> int:
        handle = self._file
        assert handle is not None
        if os.fstat(handle.fileno()).st_size < self._offset + len(self._partial):
            # Truncated under us (copytruncate): what is there now is new, from the start.
            handle.seek(0)
            self._offset, self._partial, self._skipping = 0, b"", False
            self.reopened += 1
        total, start = 0, self._offset
        while True:
            chunk = handle.read(_CHUNK)
            if not chunk:
                break
            total += self._consume(chunk)
        if self._offset != start:  # once per read of what is new, not per chunk (a rename each)
            self._save_state()
        return total

    def _consume(self, chunk: bytes) -> int:
        data = self._partial + chunk
        end = data.rfind(b"\n")
        if end < 0:
            self._partial = data
            if len(data) > MAX_LINE:  # no newline within a line's length: not this format
                if not self._skipping:
                    self._count_bad(data[:80], "a line longer than MAX_LINE")
                self._skipping = True
                self._offset += len(data)
                self._partial = b""
            return 0
        complete, self._partial = data[:end], data[end + 1 :]
        if self._skipping:  # the rest of an over-long line, already counted
            cut = complete.find(b"\n")
            complete = b"" if cut < 0 else complete[cut + 1 :]
            self._skipping = False
            if not complete:
                self._offset += end + 1
                return 0
        lines = complete.count(b"\n") + 1
        groups = _tally_whole(complete, lines)
        if groups is None:  # a line that is not in the format: line by line
            groups = _tally_lines(complete)
        matched = ignored = 0
        hits: list[EdgeHit] = []
        for (key, digest, status), (at, seconds, n) in groups.items():
            matched += int(n)
            if status not in _FETCHED_TEXT:
                ignored += int(n)
                continue
            hits.append(
                EdgeHit(at, key.decode(), digest.decode(), int(status), seconds * 1000 / n, int(n))
            )
        bad = lines - matched
        if bad:
            self._log_first_bad(complete)
        fetches = recorded = matched - ignored
        if hits:
            try:
                taken = self.on_hits(hits)
            except Exception:  # the audit's problem, not a reason to read the lines again
                log.exception("edge log: recording %d fetches failed", fetches)
            else:
                recorded = fetches if taken is None else min(max(taken, 0), fetches)
        self._count("hit", recorded)
        self._count("unknown", fetches - recorded)
        self._count("ignored", ignored)
        self._count("bad", bad)
        self._offset += end + 1  # data starts at the old offset (the partial line's start)
        return lines

    def _log_first_bad(self, block: bytes) -> None:
        for line in block.split(b"\n"):
            try:
                parse_line(line)
            except ValueError as exc:
                self._log_bad(line, str(exc))
                return

    # Counting and state -------------------------------------------------------------

    def _count(self, what: str, n: int) -> None:
        if not n:
            return
        self.counts[what] += n
        for listener in self.listeners:
            listener(what, n)

    def _count_bad(self, line: bytes, reason: str) -> None:
        self._count("bad", 1)
        self._log_bad(line, reason)

    def _log_bad(self, line: bytes, reason: str) -> None:
        now = time.monotonic()
        if now - self._bad_logged >= _BAD_LOG_S:
            self._bad_logged = now
            log.warning(
                "edge log %s: skipped a line that is not nginx's kcache_edge format (%s): %r "
                "(%d skipped so far; this is logged once a minute)",
                self.path,
                reason,
                line[:120],
                self.counts["bad"] + 1,
            )

    def _load_state(self) -> None:
        try:
            state = json.loads(self.state_path.read_text())
            inode, offset = int(state["inode"]), int(state["offset"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        if inode >= 0 and offset >= 0:
            self._inode, self._offset = inode, offset

    def _save_state(self) -> None:
        state = json.dumps({"inode": self._inode, "offset": self._offset})
        temp = self.state_path.with_name(self.state_path.name + ".tmp")
        try:
            temp.write_text(state)
            os.replace(temp, self.state_path)
        except OSError as exc:
            log.warning("edge log: could not save where it got to (%s): %s", self.state_path, exc)
