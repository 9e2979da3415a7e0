"""Foreign artifacts on the client: what library cache hooks look up and publish (docs/design.md section 10).

:class:`ForeignCache` is what kcache's CuPy backend, cuda.core resource and Triton cache
manager stand on. A group of files is named by a :class:`ForeignName` (library, version,
target, toolchain, the library's key) and looked up

0. in this process's memory (what it published or found, bounded: :data:`MEMORY_BYTES`);
1. in the node tier (the user's private tier: a shared tier's entries need kcache's own
   signatures, which a foreign binding does not have, so a shared tier is skipped), where
   a group is one blob (:func:`pack_group`), so a reader finds all of it or none;
2. on the server: ``GET /v1/foreign/...`` (the group, signed "published by <writer>",
   checked with the keys trusted for the server) and each file by digest, each checked;
   a file that is gone makes the whole group a miss. A server hit is kept in the tier.

A group an admin removed from the server is not answered from memory or the tier once
the server's withdrawals say so: they are read when due, as before a kernel's answer
(:mod:`kcache_client._withdrawals`, "Foreign groups").

A lookup never raises: a server that cannot be reached, refuses, or answers something
that does not check is a miss (the library then compiles), and a server that could not
be reached is not asked again for :data:`DOWN_S` seconds, so a dead server costs one
short connect per half minute, not one per compile. ``KCACHE_OFFLINE=1`` sends nothing.

:meth:`ForeignCache.put` is called after the library's compile: it keeps the group in
memory and in the node tier at once (a later lookup of this node finds it, a cache that
must read its own writes does), and queues it (at most :data:`QUEUE` groups; past that
the publish is dropped and counted) for one background thread per process, which
publishes it (each file's bytes, then the group, in one transaction on the server); a
process waits at exit at most :data:`EXIT_FLUSH_S` seconds for the queue. Publishing needs a token with the
``publish`` scope; a 403 stops this process's publishing with one warning.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from kcache.artifact_header import CONTEXT_HEADER, encode_context
from kcache.foreign import ForeignBinding, ForeignName, ForeignNameError, check_files
from kcache.signing import Signature, SignatureError
from kcache_client._foreign_groups import (
    keep_group,
    pack_group,
    read_group,
    reinstate_group,
    takes_foreign,
    unpack_group,
    withdrawn_group,
)
from kcache_client._lean_request import json_body
from kcache_client.errors import UntrustedArtifactError

if TYPE_CHECKING:
    from kcache_client._cache import KernelCache
    from kcache_client._lean_answer import LeanResponse
    from kcache_client._lean_http import LeanClient

__all__ = [
    "DOWN_S",
    "EXIT_FLUSH_S",
    "QUEUE",
    "ForeignCache",
    "pack_group",
    "unpack_group",
]

log = logging.getLogger("kcache_client.foreign")

#: Seconds a server that could not be reached is not asked again.
DOWN_S = 30.0
#: Groups waiting to be published, at most; past it a write is dropped (counted).
QUEUE = 256
#: Seconds a process waits at exit for its queued writes.
EXIT_FLUSH_S = 5.0
#: One wait to connect, and for the next bytes, of a lookup (a miss costs at most these).
CONNECT_S, READ_S = 2.0, 30.0
#: Bytes of groups kept in a process's memory.
MEMORY_BYTES = 256 << 20


class ForeignCache:
    """Foreign groups through the node tier and the server of ``cache``; see the module docstring."""

    def __init__(self, cache: KernelCache | None = None) -> None:
        if cache is None:
            from kcache_client._adapters import default_cache

            cache = default_cache()
        self.cache = cache
        settings = cache.settings
        self.url = settings.url.rstrip("/") if settings.url else None
        self._token = settings.token
        self._offline = bool(getattr(settings, "offline", False))
        self._http: LeanClient | None = None
        self._http_lock = threading.Lock()
        self._down_until = 0.0
        self._publish_refused = False
        self._queue: queue.Queue[tuple[ForeignName, dict[str, bytes]] | None] = queue.Queue(QUEUE)
        self._writer: threading.Thread | None = None
        self._writer_pid = 0
        self._exit_hook = False
        self._writer_lock = threading.Lock()
        self._warned: set[str] = set()
        self._memory: OrderedDict[ForeignName, dict[str, bytes]] = OrderedDict()
        self._memory_bytes = 0
        self._memory_lock = threading.Lock()
        #: What this process's lookups and writes did: node_hits, server_hits, misses,
        #: refused (answers that did not check), unreachable, published, kept, dropped, failed.
        self.counts: Counter[str] = Counter()
        #: What this process's hooks used, for its manifest (kcache_client._foreign_ledger).
        self._ledger = cache.foreign_ledger

    # ------------------------------------------------------------------ lookups
    def get(self, name: ForeignName) -> dict[str, bytes] | None:
        """The group under ``name`` (file name -> bytes), or None: never raises."""
        with self._memory_lock:
            found = self._memory.get(name)
            if found is not None:
                self._memory.move_to_end(name)
        try:
            if found is not None:
                if self._holds(name, found, tier=False):
                    self.counts["memory_hits"] += 1
                    self._ledger.note(name, found, name.binding_key)
                    return found
                self._drop(name)
            found = self._from_tier(name)
            if found is not None:
                self.counts["node_hits"] += 1
                self._remember(name, found)
                self._ledger.note(name, found, name.binding_key)
                return found
            found = self._from_server(name)
        except Exception as exc:  # a hook's lookup is a miss whatever went wrong
            self._warn("lookup", f"a foreign lookup failed ({type(exc).__name__}: {exc}); a miss")
            found = None
        if found is None:
            self.counts["misses"] += 1
            return None
        self.counts["server_hits"] += 1
        self._remember(name, found)
        self._ledger.note(name, found, name.binding_key)
        self._keep(name, found)
        return found

    def copy_holds(self, name: ForeignName, read: Callable[[], Mapping[str, bytes] | None]) -> bool:
        """Whether a copy of ``name`` that a library keeps on disk itself (Triton's own cache
        directory, which kcache's manager fills) may still be used: as a node tier's entry,
        the server's withdrawals read first when due; ``read`` gives the copy's files, asked
        only when a withdrawal names the binding. Never raises."""
        try:
            return self._holds(name, read, tier=True)
        except Exception as exc:  # a lookup never raises: the copy is used as before
            self._warn("lookup", f"checking a local copy failed ({type(exc).__name__}: {exc})")
            return True

    def _holds(
        self,
        name: ForeignName,
        files: Mapping[str, bytes] | Callable[[], Mapping[str, bytes] | None],
        *,
        tier: bool,
    ) -> bool:
        """Whether a group held in memory (``tier``: read from the node tier or a local copy)
        may be answered: the server's withdrawals read first when due, as for a kernel, then
        not withdrawn (an admin's removal: docs/design.md section 3, "What a binding rests on")."""
        watch = self.cache.withdrawal_watch
        if watch is not None:
            (watch.before_tier_answer if tier else watch.before_memory_answer)()
        known = self.cache.tier.withdrawals
        if not known.names(name.binding_key):
            return True
        held = files() if callable(files) else files
        if held is None or not withdrawn_group(known, name.binding_key, held):
            return True
        self.counts["withdrawn"] += 1
        log.info(
            "kcache: foreign %s entry %s not used: the server withdrew it (removed by an admin)",
            name.library,
            name.key,
        )
        return False

    def _remember(self, name: ForeignName, files: dict[str, bytes]) -> None:
        size = sum(len(v) for v in files.values())
        if size > MEMORY_BYTES:
            return
        with self._memory_lock:
            old = self._memory.pop(name, None)
            if old is not None:
                self._memory_bytes -= sum(len(v) for v in old.values())
            self._memory[name] = files
            self._memory_bytes += size
            while self._memory_bytes > MEMORY_BYTES:
                _, dropped = self._memory.popitem(last=False)
                self._memory_bytes -= sum(len(v) for v in dropped.values())

    def _drop(self, name: ForeignName) -> bool:
        with self._memory_lock:
            old = self._memory.pop(name, None)
            if old is not None:
                self._memory_bytes -= sum(len(v) for v in old.values())
        return old is not None

    def clear_memory(self) -> None:
        """Forget every group this process holds in memory."""
        with self._memory_lock:
            self._memory.clear()
            self._memory_bytes = 0

    def forget(self, name: ForeignName) -> bool:
        """Remove ``name`` from this process's memory and the node tier (never from the server:
        that is an admin's ``DELETE``); True when either held it."""
        held = self._drop(name)
        if read_group(self.cache.tier, name.binding_key) is not None:
            self.cache.tier.remove([name.binding_key])
            held = True
        return held

    def local_names(self, library: str) -> list[str]:
        """Binding keys of ``library`` in memory and the node tier (what a hook's ``len`` counts)."""
        with self._memory_lock:
            names = {n.binding_key for n in self._memory if n.library == library}
        if self._tier_usable():
            prefix = f"foreign:{library}:"
            names.update(
                k
                for entry in self.cache.tier.entries()
                if entry.kernel.startswith(prefix)
                for k in entry.recipe_keys
            )
        return sorted(names)

    def _tier_usable(self) -> bool:
        return takes_foreign(self.cache.tier)

    def _from_tier(self, name: ForeignName) -> dict[str, bytes] | None:
        group = read_group(self.cache.tier, name.binding_key)
        if group is None or self._holds(name, group, tier=True):
            return group
        self.cache.tier.remove([name.binding_key])
        return None

    def _client(self) -> LeanClient:
        with self._http_lock:
            if self._http is None:
                from kcache_client._lean_http import LeanClient
                from kcache_client._waits import Waits

                # kcache's one HTTP client: a plain-http server needs no TLS context (its
                # certificate store costs 20 ms to load); redirects are never followed.
                self._http = LeanClient(self.url or "", Waits(CONNECT_S, READ_S, READ_S))
            return self._http

    def _reachable(self) -> bool:
        return bool(self.url) and not self._offline and time.monotonic() >= self._down_until

    def _request(
        self, method: str, path: str, body: bytes | None = None, content_type: str = ""
    ) -> LeanResponse | None:
        """One try; None (and the server taken for down a while) when it cannot be reached."""
        from kcache_client._lean_errors import HTTPError  # every failure the lean client raises

        # Who asks, as a fetch says it: the lookup's audit row names the job (its manifest).
        headers = {CONTEXT_HEADER: encode_context(self.cache.context())}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        if content_type:
            headers["Content-Type"] = content_type
        try:
            return self._client().request(method, path, headers, body)
        except HTTPError as exc:
            self._down_until = time.monotonic() + DOWN_S
            self.counts["unreachable"] += 1
            self._warn(
                "down",
                f"{self.url} cannot be reached ({exc}); foreign lookups miss for {DOWN_S:.0f} s",
            )
            return None

    def _from_server(self, name: ForeignName) -> dict[str, bytes] | None:
        if not self._reachable():
            return None
        reply = self._request("GET", f"{name.path()}?{urlencode(name.query())}")
        if reply is None or reply.status_code == 404:
            return None
        if reply.status_code != 200:
            self._warn(
                f"status{reply.status_code}",
                f"{self.url} answered a foreign lookup with HTTP {reply.status_code}; a miss",
            )
            return None
        binding = self._checked(name, reply)
        if binding is None:
            return None
        files: dict[str, bytes] = {}
        for ref in binding.files:
            got = self._request("GET", f"/v1/blobs/{ref.digest}")
            if got is None or got.status_code != 200:
                return None  # a file gone (evicted, set aside): the whole group is a miss
            data = got.content
            if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.digest:
                self.counts["refused"] += 1
                self._warn(
                    "digest", f"a foreign file from {self.url} did not match its digest; a miss"
                )
                return None
            files[ref.name] = data
        # The server's word now, whatever the feed said of the same bytes before.
        self.cache.tier.withdrawals.reinstate((binding.binding_key, binding.group_digest))
        return files

    def _checked(self, name: ForeignName, reply: LeanResponse) -> ForeignBinding | None:
        """The answer's binding if it is well formed, names ``name`` and is signed by a key
        trusted for the server; else None, counted and warned once."""
        where = f"{self.url}{name.path()}"
        try:
            body = reply.json()
            binding = ForeignBinding(
                ForeignName.checked(body), check_files(body["files"]), str(body["writer"])
            )
            if binding.name != name:
                raise ValueError("the answer names another binding")
            signature = Signature.from_dict(body["signature"])
            self.cache.trust.check_foreign(
                self.url or "", binding, signature, self._server_keys, where
            )
        except (
            ValueError,
            KeyError,
            TypeError,
            ForeignNameError,
            SignatureError,
            UntrustedArtifactError,
        ) as exc:
            self.counts["refused"] += 1
            self._warn("refused", f"{where}: the answer does not check ({exc}); a miss")
            return None
        return binding

    def _server_keys(self) -> Any:
        reply = self._request("GET", "/v1/keys")
        if reply is None or reply.status_code != 200:
            raise ValueError("GET /v1/keys did not answer")
        return reply.json()

    # ------------------------------------------------------------------ writes
    def put(self, name: ForeignName, files: Mapping[str, bytes]) -> bool:
        """Queue ``files`` under ``name`` for the tier and the server; False when dropped (queue full)."""
        try:
            name.check()
        except ForeignNameError as exc:
            self._warn("name", f"a foreign name was refused ({exc}); not kept")
            return False
        group = {k: bytes(v) for k, v in files.items()}
        # This node's own compile is its word, as a server answer is (a removed group's bytes
        # made again here are used here: one compile per process, not one per lookup).
        reinstate_group(self.cache.tier.withdrawals, name.binding_key, group)
        self._remember(name, group)
        self._ledger.note(name, group)  # handed over: these files, whatever was noted before
        try:
            self._keep(name, group)
        except Exception as exc:  # the node tier is best effort here too
            self._warn("keep", f"a foreign group was not kept in the node tier ({exc})")
        if not self._reachable() or self._publish_refused:
            return True
        self._start_writer()
        try:
            self._queue.put_nowait((name, group))
        except queue.Full:
            self.counts["dropped"] += 1
            self._warn("full", f"{QUEUE} foreign writes are waiting; further ones are dropped")
            return False
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is done (True), or ``timeout`` seconds (False)."""
        if self._writer is not None and self._writer_pid != os.getpid():
            return True  # a forked child's inherited queue: the parent sends it
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def _start_writer(self) -> None:
        with self._writer_lock:
            if self._writer is not None and self._writer_pid != os.getpid():
                # A forked child has the parent's queue but not its thread: a queue and a
                # thread of its own (what the parent had queued is the parent's to send).
                self._queue = queue.Queue(QUEUE)
                self._writer = None
            if self._writer is None:
                self._writer_pid = os.getpid()
                self._writer = threading.Thread(
                    target=self._write_loop,
                    args=(self._queue,),
                    name="kcache-foreign-writer",
                    daemon=True,
                )
                self._writer.start()
                if not self._exit_hook:
                    self._exit_hook = True
                    atexit.register(self.flush, EXIT_FLUSH_S)

    def _write_loop(self, work: queue.Queue[tuple[ForeignName, dict[str, bytes]] | None]) -> None:
        while True:
            item = work.get()
            try:
                if item is not None:
                    self._publish(*item)
            except Exception as exc:  # a write is best effort: the library has its result
                self.counts["failed"] += 1
                self._warn("write", f"a foreign write failed ({type(exc).__name__}: {exc})")
            finally:
                work.task_done()

    def _keep(self, name: ForeignName, files: Mapping[str, bytes]) -> None:
        """Keep the group in the node tier (one blob: all of it or none)."""
        if keep_group(self.cache.tier, name, name.binding_key, files) is not None:
            self.counts["kept"] += 1

    def _publish(self, name: ForeignName, files: Mapping[str, bytes]) -> None:
        if self._publish_refused or not self._reachable():
            return
        refs = []
        for file_name in sorted(files):
            data = files[file_name]
            digest = hashlib.sha256(data).hexdigest()
            reply = self._request("PUT", f"/v1/blobs/{digest}", data, "application/octet-stream")
            if not self._published_ok(reply):
                return
            refs.append({"name": file_name, "digest": digest, "size": len(data)})
        group = json_body({**name.query(), "files": refs})
        reply = self._request("PUT", name.path(), group, "application/json")
        if self._published_ok(reply):
            self.counts["published"] += 1

    def _published_ok(self, reply: LeanResponse | None) -> bool:
        if reply is None:
            return False
        if reply.status_code == 200:
            return True
        if reply.status_code in (401, 403):
            self._publish_refused = True
            self._warn(
                "publish",
                f"{self.url} refused a foreign publish (HTTP {reply.status_code}): "
                "give KCACHE_TOKEN the publish scope (kcache token create NAME --scope publish); "
                "this process publishes nothing more",
            )
        else:
            self.counts["failed"] += 1
            self._warn(
                f"put{reply.status_code}",
                f"{self.url} refused a foreign publish: HTTP {reply.status_code} {reply.text[:200]}",
            )
        return False

    def _warn(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("kcache: %s", message)

    def close(self) -> None:
        """Finish the queued writes (bounded) and close the connections."""
        self.flush(EXIT_FLUSH_S)
        with self._http_lock:
            if self._http is not None:
                self._http.close()
                self._http = None
