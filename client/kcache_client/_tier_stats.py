"""A node tier's hit and miss counts, like ``ccache -s``: ``kcache cache stats [--zero]``.

What is counted is what every ``KernelCache`` counts anyway (:class:`CacheStats`, the
same increments, nothing more on a hit): a **hit** is a lookup the node tier (or one of
its read-only layers) answered; a **miss** one that needed the server (a fetch, or a
compile there) or a compile here. A repeat lookup that this process's memory answered is
shown apart (``memory hits``): it says nothing of the tier. Kernels a prefetch put into
the tier are shown apart too.

**Nothing is written on the hit path.** Each process keeps its counts in memory and writes
them once, when it ends (``atexit``; :func:`flush` too), as one small file of its own,
``stats/p.<host>.<pid>.<random>.json`` under the tier, holding the process's totals (so a
second write replaces the first). ``kcache cache stats`` sums the files. A process still
running is not in the sum yet, and one killed (``SIGKILL``, ``os._exit``) never is. A
forked child starts from zero under a name of its own.

**The mark** (``kcache cache stats --zero``): the files' totals at that moment are noted in
``stats/zero.<uid>.json`` with the time; later sums subtract them (the newest mark of any
user counts). The files of this user's processes that have ended are removed then. A
process running across the mark that had written nothing before it counts whole after it.

**Bounded.** A process that writes its file then folds the files of this user's ended
processes of this host into one, ``stats/total.<host>.<uid>.json`` (what they add since
the mark, and how many processes), and removes them, under a lock of that user's (a
process that finds it taken leaves the work): the directory holds a file per running
process, a total per user and host, and the marks, however many processes came and went.
A crash between writing the total and removing a folded file counts that file twice.

**Permissions.** The tier's own rules hold: in a shared tier (root mode ``1777``/``1775``)
``stats/`` gets the root's mode when this module makes it, so every user writes their
files there, and the sticky bit keeps each user's files theirs (files are ``0644``,
readable by all). Nothing is written into a tier that is not writable here (untrusted),
and the directory is never followed through a link (its files are made relative to a
descriptor of it opened with ``O_NOFOLLOW``). Counts are information, not trust: a user
who can write a shared tier can write a file that adds to its sums; files that do not
parse, or hold anything but small counts, are skipped.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kcache.fsutil import UnsafeFileError, read_file

if TYPE_CHECKING:
    from kcache_client._stats import CacheStats
    from kcache_client._tier import NodeTier

__all__ = ["COUNTS", "STATS_DIR", "TierCounts", "flush", "read", "track", "zero"]

#: The tier's directory for the counts (not one whose standing decides the tier's).
STATS_DIR = "stats"
#: The counters summed: CacheStats' names.
COUNTS = ("node_hits", "memory_hits", "server_fetches", "local_compiles", "bundle_entries")
#: Beside the counters in a file: how many processes it stands for (1; a total, many).
_PROCESSES = "processes"
_TOTAL_PREFIX = "total."
_PROCESS_PREFIX = "p."
_VERSION = 1
_MAX_FILE = 64 * 1024  # a process's file is a few hundred bytes; a mark a few KB per process
_MAX_COUNT = 1 << 62
_MARK_PREFIX = "zero."
_OPEN_DIR = (
    os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW


@dataclass
class _Tracked:
    """The counters of one tier's caches in this process, and what they held at a fork."""

    stats: list[CacheStats] = field(default_factory=list)
    baseline: dict[str, int] = field(default_factory=dict)
    since: float = field(default_factory=time.time)


_lock = threading.Lock()
_tracked: dict[str, _Tracked] = {}
_name = ""
_registered = False


def _process_name() -> str:
    """This process's file name: host, pid and a random part (pids are reused)."""
    global _name
    if not _name:
        host = _safe(socket.gethostname())
        _name = f"{_PROCESS_PREFIX}{host}.{os.getpid()}.{secrets.token_hex(4)}.json"
    return _name


def track(tier: NodeTier, stats: CacheStats) -> None:
    """Count ``stats`` (a cache's counters) into ``tier``'s file when this process ends.

    Costs a dictionary entry; nothing is read or written until :func:`flush`.
    """
    global _registered
    if tier.read_only or not tier.standing.writable:
        return  # nothing is written into a tier others could have rearranged
    with _lock:
        _tracked.setdefault(str(tier.root), _Tracked()).stats.append(stats)
        if not _registered:
            _registered = True
            atexit.register(flush)


def _after_fork() -> None:
    """A forked child counts from here, into a file of its own."""
    global _name, _lock
    _lock = threading.Lock()  # the parent's may have been held by another thread
    _name = ""
    for tracked in _tracked.values():
        tracked.baseline = _summed(tracked.stats)
        tracked.since = time.time()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _summed(stats: list[CacheStats]) -> dict[str, int]:
    return {name: sum(int(getattr(s, name)) for s in stats) for name in COUNTS}


def flush() -> None:
    """Write this process's totals of every tier it counted into (at exit; idempotent)."""
    with _lock:
        work = [
            (root, {k: v - t.baseline.get(k, 0) for k, v in _summed(t.stats).items()}, t.since)
            for root, t in _tracked.items()
        ]
    for root, counts, since in work:
        if not any(counts.values()):
            continue
        body = {
            "version": _VERSION,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "uid": os.geteuid(),
            "since": since,
            "written": time.time(),
            "counts": {**counts, _PROCESSES: 1},
        }
        # A full disk or a directory taken away: the counts are lost, the process is not.
        with contextlib.suppress(OSError):
            _write(Path(root), _process_name(), body)
            _fold(Path(root))


def _stats_dir(root: Path) -> int:
    """A descriptor of ``root/stats`` (made if absent, with the root's mode in a shared
    tier: see :func:`kcache_client._tier_standing.share_dirs`), never through a link."""
    path = root / STATS_DIR
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o755)
        with contextlib.suppress(OSError):
            mode = os.lstat(root).st_mode & 0o7777
            if mode & 0o1000 and mode & 0o022:  # shared: every user writes their files here
                os.chmod(path, mode, follow_symlinks=False)
    return os.open(path, _OPEN_DIR)


def _write(root: Path, name: str, body: dict[str, Any]) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    directory = _stats_dir(root)
    try:
        staging = f".tmp-{name}-{secrets.token_hex(4)}"
        fd = os.open(staging, _CREATE, 0o644, dir_fd=directory)
        try:
            os.fchmod(fd, 0o644)  # readable by every user of the tier, whatever the umask
            os.write(fd, data)
        finally:
            os.close(fd)
        try:
            os.replace(staging, name, src_dir_fd=directory, dst_dir_fd=directory)
        except OSError:
            os.unlink(staging, dir_fd=directory)
            raise
    finally:
        os.close(directory)


@dataclass(frozen=True)
class TierCounts:
    """The sums :func:`read` found: counts since the mark, who wrote them, the mark."""

    root: Path
    counts: dict[str, int]
    processes: int
    mark: float | None  # when the counts were last zeroed (None: never)
    first: float | None  # the earliest process start counted

    @property
    def hits(self) -> int:
        return self.counts["node_hits"]

    @property
    def misses(self) -> int:
        return self.counts["server_fetches"] + self.counts["local_compiles"]

    @property
    def hit_rate(self) -> float | None:
        asked = self.hits + self.misses
        return self.hits / asked if asked else None


def _files(root: Path) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """(process file name -> its body, the marks' bodies) of ``root/stats``; the unreadable
    and malformed are skipped."""
    folder = root / STATS_DIR
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return {}, []
        names = [e.name for e in os.scandir(folder) if e.is_file(follow_symlinks=False)]
    except OSError:
        return {}, []
    found: dict[str, dict[str, Any]] = {}
    marks: list[dict[str, Any]] = []
    for name in names:
        if name.startswith(".") or not name.endswith(".json"):
            continue
        try:
            body = json.loads(read_file(str(folder / name), _MAX_FILE))
        except (OSError, UnsafeFileError, ValueError):
            continue
        if not isinstance(body, dict):
            continue
        if name.startswith(_MARK_PREFIX):
            if _number(body.get("at")) is not None and isinstance(body.get("seen"), dict):
                marks.append(body)
        elif _counts(body.get("counts")) is not None and _number(body.get("written")) is not None:
            found[name] = body
    return found, marks


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _counts(value: object) -> dict[str, int] | None:
    """A file's counts (every one of :data:`COUNTS`, and how many processes they are of: a
    small non-negative int each), or None."""
    if not isinstance(value, dict):
        return None
    out = {}
    for name in (*COUNTS, _PROCESSES):
        count = value.get(name, 1 if name == _PROCESSES else 0)
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count < _MAX_COUNT:
            return None
        out[name] = count
    return out


def _newest_mark(marks: list[dict[str, Any]]) -> tuple[float | None, dict[str, Any]]:
    """The newest mark's time and the counts it noted, by file (None, {}: never zeroed)."""
    mark = max(marks, key=lambda m: float(m["at"]), default=None)
    return (float(mark["at"]), mark["seen"]) if mark is not None else (None, {})


def _since_mark(
    name: str, body: dict[str, Any], at: float | None, seen: dict[str, Any]
) -> dict[str, int]:
    """What the file ``name`` adds after the mark (``at``, ``seen``): its counts less those
    noted then; nothing for a file written before it and not noted (a race with it)."""
    counts = _counts(body["counts"])
    assert counts is not None  # checked by _files
    if at is None:
        return counts
    before = _counts(seen.get(name)) if name in seen else None
    if before is None:
        return counts if float(body["written"]) >= at else dict.fromkeys(counts, 0)
    return {k: max(0, v - before[k]) for k, v in counts.items()}


def read(root: str | os.PathLike[str]) -> TierCounts:
    """The counts every ended process wrote into ``root``, less those noted at the newest mark."""
    root = Path(root)
    files, marks = _files(root)
    at, seen = _newest_mark(marks)
    total = dict.fromkeys(COUNTS, 0)
    processes = 0
    first: float | None = None
    for name, body in files.items():
        counts = _since_mark(name, body, at, seen)
        if not any(counts[k] for k in COUNTS):
            continue
        processes += max(1, counts[_PROCESSES])
        since = _number(body.get("since"))
        if since is not None:
            first = since if first is None else min(first, since)
        for k in COUNTS:
            total[k] += counts[k]
    if at is not None and first is not None:
        first = max(first, at)
    return TierCounts(root, total, processes, at, first)


def zero(root: str | os.PathLike[str]) -> float:
    """Set the mark: later sums count from now. Removes the files of this user's processes
    of this host that have ended (their counts are in the past now); returns the mark's time."""
    root = Path(root)
    flush()  # this process's own counts so far belong before the mark
    now = time.time()
    files, _ = _files(root)
    host, uid = socket.gethostname(), os.geteuid()
    seen: dict[str, dict[str, int]] = {}
    for name, body in files.items():
        if body.get("uid") == uid and body.get("host") == host and not _alive(body.get("pid")):
            with contextlib.suppress(OSError):
                os.unlink(root / STATS_DIR / name)
                continue
        counts = _counts(body["counts"])
        if counts is not None:
            seen[name] = counts
    _write(root, f"{_MARK_PREFIX}{uid}.json", {"version": _VERSION, "at": now, "seen": seen})
    return now


def _fold(root: Path) -> None:
    """Fold the files of this user's ended processes of this host into its total (module
    docstring), unless another process of this user is at it."""
    import fcntl

    host, uid = socket.gethostname(), os.geteuid()
    directory = os.open(root / STATS_DIR, _OPEN_DIR)
    try:
        lock = os.open(
            f".fold.{uid}.lock", os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600, dir_fd=directory
        )
    finally:
        os.close(directory)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # another process of this user folds now
        files, marks = _files(root)
        at, seen = _newest_mark(marks)
        name = f"{_TOTAL_PREFIX}{_safe(host)}.{uid}.json"
        ended = [
            (n, b)
            for n, b in files.items()
            if n.startswith(_PROCESS_PREFIX)
            and b.get("uid") == uid
            and b.get("host") == host
            and not _alive(b.get("pid"))
        ]
        if not ended:
            return
        kept = files.get(name)
        total = _counts(kept["counts"]) if kept is not None else dict.fromkeys(COUNTS, 0)
        assert total is not None
        if kept is None:
            total[_PROCESSES] = 0
        since = [_number(b.get("since")) for _, b in ended] + [
            _number(kept.get("since")) if kept is not None else None
        ]
        for n, body in ended:
            added = _since_mark(n, body, at, seen)
            if any(added[k] for k in COUNTS):  # a process noted at the mark, which went on
                added[_PROCESSES] = max(1, added[_PROCESSES])
            for k in total:
                total[k] += added[k]
        _write(
            root,
            name,
            {
                "version": _VERSION,
                "host": host,
                "uid": uid,
                "pid": None,
                "since": min((s for s in since if s is not None), default=None),
                "written": time.time(),
                "counts": total,
            },
        )
        for n, _ in ended:
            with contextlib.suppress(OSError):
                os.unlink(root / STATS_DIR / n)
    finally:
        os.close(lock)


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)[:64] or "host"


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive
    return True
