"""A node's audit events, sent by one process for all of the node's processes.

Each process's :class:`~kcache_client._events.EventSink` used to post its own batches to
``POST /v1/events``: an 8-rank job on a warm node made 8 posts (and more, one per rank every
couple of seconds while they hit), none of them for a kernel. With a spool, a process
*appends* its batches to a file of the node tier (one ``write`` of JSON lines, ``O_APPEND``)
instead, and one process of the node at a time, the one that holds the spool's lock,
*sends* what the spool holds: it takes the file whole (a ``rename``), posts its lines in
batches, and deletes it. So a node sends one post per interval while its processes hit,
whatever their number, and about one as they end.

Who sends: the first process whose sink has something to send takes the lock (without
waiting) and keeps it while it lives; the others only append. When a process ends
(:meth:`NodeEventSpool.finish`) it appends what it has left and then waits for the lock
(bounded by the sink's close timeout) to send whatever is still spooled: the last process
of a job to end sends the job's last events, and one that ended while the sender was busy
finds them sent or sends them itself. A sender killed mid-send leaves its taken file
(``<name>.sending-<pid>-<random>``); whoever holds the lock next sends it too (while the
lock is held nobody else is sending, so any taken file is a dead sender's). A forked child
does not lead whatever its parent did: it takes the lock of its own accord (a new lock
object: the parent's cannot be used in a child).

Where: only in a node tier that is this user's alone (``private`` standing): every line is
this user's processes', sent with their token (the spool's name is a hash of the server's
URL and the token, so a process sends only what a process with its own server and token
wrote). A shared tier's processes post their own events, as before. Events are
best-effort, as before: a spool past :data:`MAX_SPOOL_BYTES` takes no more (they are
dropped and counted), a line that does not parse is skipped, and a server that cannot be
reached leaves the lines in the spool for the next send.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import filelock

from kcache.fsutil import make_dirs, read_file
from kcache_client._forked import reset_in_child

if TYPE_CHECKING:
    from kcache_client._tier import NodeTier

__all__ = ["MAX_SPOOL_BYTES", "SPOOL_DIR", "NodeEventSpool"]

_log = logging.getLogger(__name__)

#: The node tier's directory for spooled events.
SPOOL_DIR = "events"
#: A spool this large takes no more lines until it is sent (a server out of reach for long).
MAX_SPOOL_BYTES = 16 << 20
_TAKEN = ".sending-"
_APPEND_TRIES = 4
_OPEN_APPEND = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)

#: ``send(batch)``: post one batch; True when it was delivered or refused for good (dropped),
#: False when the server could not be reached (the lines stay spooled).
Send = Callable[[list[dict[str, Any]]], bool]


class NodeEventSpool:
    """The spool of one server and token in one private node tier (the module docstring)."""

    def __init__(self, tier_root: str | os.PathLike[str], url: str, token: str | None) -> None:
        tag = hashlib.sha256(f"{url}\0{token or ''}".encode()).hexdigest()[:16]
        self.directory = os.path.join(os.fspath(tier_root), SPOOL_DIR)
        self.path = os.path.join(self.directory, f"{tag}.jsonl")
        self._lock_path = os.path.join(self.directory, f"{tag}.lock")
        self._lock = self._new_lock()
        self.leading = False
        reset_in_child(self)
        #: Events this process could not spool (the spool full, or not writable).
        self.dropped = 0

    def _new_lock(self) -> filelock.BaseFileLock:
        # Not thread-local: the sink's thread takes it, and close() lets it go.
        return filelock.FileLock(self._lock_path, mode=0o600, thread_local=False)

    def _after_fork_in_child(self) -> None:
        self._lock = self._new_lock()
        self.leading = False

    @classmethod
    def for_tier(cls, tier: NodeTier, url: str, token: str | None) -> NodeEventSpool | None:
        """The spool of ``tier`` for this server and token; None where the tier is not this
        user's alone (its processes then post their own events)."""
        if tier.read_only or tier.standing.kind != "private":
            return None
        return cls(tier.root, url, token)

    def append(self, batch: list[dict[str, Any]]) -> bool:
        """Spool ``batch`` (one write); False when it could not be (not writable).

        The write holds a shared ``flock`` of the file and checks, holding it, that the file
        is still the spool (not taken meanwhile by a sender, which takes it and then waits
        for an exclusive ``flock`` before reading): a batch is in the file a sender reads,
        or in the next one, never in one it has already read.
        """
        if not batch:
            return True
        data = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in batch).encode()
        try:
            make_dirs(self.directory)
            for _ in range(_APPEND_TRIES):
                fd = os.open(self.path, _OPEN_APPEND, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH)
                    st = os.fstat(fd)
                    if not _same_file(st, self.path):
                        continue  # taken by a sender between the open and the lock: again
                    if st.st_size + len(data) > MAX_SPOOL_BYTES:
                        self.dropped += sum(e.get("count", 1) for e in batch)
                        return True  # dropped and counted: the spool is bounded
                    os.write(fd, data)
                    return True
                finally:
                    os.close(fd)  # the flock goes with it
        except OSError as exc:
            _log.debug("kcache: cannot spool audit events in %s: %s", self.directory, exc)
        return False

    def lead(self, wait_s: float = 0.0) -> bool:
        """Whether this process is the node's sender now: the lock is taken (waiting up to
        ``wait_s``) or already held."""
        if self.leading:
            return True
        try:
            make_dirs(self.directory)
            self._lock.acquire(timeout=wait_s)
        except (filelock.Timeout, OSError):
            return False
        self.leading = True
        return True

    def release(self) -> None:
        """Let another process be the sender."""
        if self.leading:
            self.leading = False
            with contextlib.suppress(OSError):
                self._lock.release()

    def holds_lines(self) -> bool:
        """Whether anything is spooled (a ``stat``)."""
        try:
            return os.stat(self.path).st_size > 0
        except OSError:
            return False

    def drain(self, send: Send, batch_size: int) -> int:
        """Send what the spool holds (the sender only: :meth:`lead` first); events sent."""
        if not self.leading:
            return 0
        sent = 0
        for taken in self._taken():
            events = _events_in(taken)
            delivered = 0
            for start in range(0, len(events), batch_size):
                batch = events[start : start + batch_size]
                if not send(batch):
                    break
                delivered = start + len(batch)
                sent += sum(e.get("count", 1) for e in batch)
            if delivered < len(events):  # the server out of reach: keep the rest for later
                self.append(events[delivered:])
            with contextlib.suppress(OSError):
                os.unlink(taken)
            if delivered < len(events):
                break
        return sent

    def _taken(self) -> Iterator[str]:
        """Files to send: a dead sender's taken ones, then the spool, taken now."""
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(self.directory)):
                if name.startswith(os.path.basename(self.path) + _TAKEN):
                    yield os.path.join(self.directory, name)
        taken = f"{self.path}{_TAKEN}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.rename(self.path, taken)
        except OSError:
            return  # nothing spooled
        # Appends that opened the spool before the rename finish first (they hold a shared
        # flock; one that locks after this sees the file is no longer the spool).
        with contextlib.suppress(OSError):
            fd = os.open(taken, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            finally:
                os.close(fd)
        yield taken


def _same_file(st: os.stat_result, path: str) -> bool:
    try:
        now = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def _events_in(path: str) -> list[dict[str, Any]]:
    """The events of a spool file; lines that are not JSON objects are skipped."""
    try:
        data = read_file(path, MAX_SPOOL_BYTES * 2)
    except (OSError, ValueError):
        return []
    events = []
    for line in data.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict):
                events.append(event)
    return events
