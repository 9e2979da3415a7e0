"""Resolving recipes and fetching artifacts by key, each lookup audited, warm ones from memory.

One name per operation:

- :meth:`Resolver.resolve` (``POST /v1/resolve``): memory, else the engine (index, compile);
- :meth:`Resolver.resolve_batch` (``POST /v1/resolve/batch``): the same for each recipe, in
  parallel, an error becoming that recipe's result;
- :meth:`Resolver.artifact`: the artifact recorded for a recipe key, from memory, else the index;
- :meth:`Resolver.blob`: a blob's bytes, from memory, else the store.

``cached_artifact`` and ``cached_blob`` are the memory-only halves of the last two,
for the fetch fast path below the framework, which must not wait; ``memory_hit``,
``record_hit`` and ``hit_response`` are the memory-only half of ``resolve``, for the
resolve fast path.

The memory caches hold what the engine or the index answered for an exact recipe
key. Aliases only ever point at identical bytes, so an entry cannot go stale by
itself; what a recipe key does not cover is checked on every use (:meth:`Resolver._unservable`):
include-set files, and artifacts recorded without an exact dependency list. A binding
verification withdraws, on any replica, is forgotten here within the withdrawals
follower's poll (:meth:`Resolver.withdraw`, :mod:`kcache_server.withdrawals`).

A resolve says ``hit`` only for bytes it can serve. The store verifies a blob's digest on
every read; a resolve answered from memory needs the blob's verified bytes in memory,
or its file unchanged (inode, size, modification and change times) since this process
verified it, a file changed too recently for its times to tell (:data:`_RACY_NS`) being
read again; any other hit of the engine is read and verified before it is answered.
A blob that fails (its bytes no longer hash to their name) is set aside by the store
(its quarantine) and becomes a miss with that reason
(:class:`~kcache_server.errors.ArtifactSetAsideError`, 404 ``not_found``, as for an
evicted artifact): the resolve asks the engine again, which then compiles it afresh
when the caller may compile, and the fetch by key and by digest answer the same 404.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import anyio

from kcache.artifact import ArtifactMeta, CompileFailure
from kcache.artifact_header import decode_context
from kcache.deps import include_set_files_unchanged, proven
from kcache.engine import Resolution, failure_error
from kcache.errors import ArtifactNotFoundError, CorruptArtifactError, KCacheError
from kcache.lru import LruCache
from kcache.nvrtc import kernel_name
from kcache.outcomes import Outcome
from kcache.recipe import Recipe
from kcache_server.auditing.writer import AuditLog, AuditRecord
from kcache_server.backends import Backends
from kcache_server.errors import ArtifactSetAsideError, error_body, error_info
from kcache_server.recipe_records import RecipeRecords
from kcache_server.schemas import (
    ArtifactBody,
    BatchError,
    BatchResult,
    Context,
    ResolveResponse,
    SignatureBody,
)
from kcache_server.signer import ArtifactSigner

__all__ = ["Resolver", "error_result"]

#: Runs a blocking call on a worker thread under the request limits (``ServerState.run``).
Run = Callable[..., Awaitable[Any]]

# Blobs above this are served from disk every time instead of crowding the memory cache.
_MAX_CACHED_BLOB = 16 << 20
# Recipe keys whose artifact metadata is kept in memory.
_MAX_CACHED_KEYS = 100_000
#: A blob file changed less than this before it was verified is verified again next
#: time: file times are kept at a coarse granularity (a clock tick, or seconds on some
#: network filesystems), so a change right after a write may leave them as they were.
_RACY_NS = 2_000_000_000
# Digests this process saw fail their check, for the reason of the misses that follow.
_MAX_SET_ASIDE = 10_000
# Withdrawn bindings remembered, so that a read racing a withdrawal does not bring one back.
_MAX_WITHDRAWN = 10_000

_log = logging.getLogger(__name__)

#: What identifies one state of a blob file: inode, size, mtime and ctime (ns).
_Stamp = tuple[int, int, int, int]


@dataclass
class _Known:
    """What the index holds for one recipe key, and its response body once one was built."""

    meta: ArtifactMeta
    body: ArtifactBody | None = None


def error_result(exc: KCacheError) -> BatchError:
    """The result of one recipe of a batch that failed: its error body with ``status`` error."""
    return BatchError.model_validate({"status": "error", **error_body(exc)})


class Resolver:
    """The resolve and fetch use cases over the engine, the index and the store; see the module docstring."""

    def __init__(
        self,
        backends: Backends,
        audit: AuditLog,
        run: Run,
        blob_cache_bytes: int,
        signer: ArtifactSigner,
        recipe_records: RecipeRecords | None = None,
    ) -> None:
        self.backends = backends
        #: Signs every key -> artifact this resolver answers with.
        self.signer = signer
        self.audit = audit
        #: Where compiled and served recipes are kept and misses explained (off the loop).
        self.recipe_records = recipe_records
        self._run = run
        self._blobs: LruCache[str, bytes] = LruCache(max_bytes=blob_cache_bytes, size=len)
        self._known: LruCache[str, _Known] = LruCache(max_entries=_MAX_CACHED_KEYS)
        # Blob files verified by this process, as they were then (see the module docstring).
        self._verified: LruCache[str, _Stamp] = LruCache(max_entries=_MAX_CACHED_KEYS)
        self._set_aside: LruCache[str, bool] = LruCache(max_entries=_MAX_SET_ASIDE)
        # Bindings (recipe key, digest) withdrawn lately: never remembered again (withdraw).
        self._withdrawn: LruCache[tuple[str, str], bool] = LruCache(max_entries=_MAX_WITHDRAWN)
        #: The newest withdrawal id this process has acted on (its follower sets it), so
        #: that its answers are right as of it: ``X-KCache-Withdrawals-Through`` on a fetch
        #: by key. None until the follower has read the table (then nothing is claimed).
        self.withdrawn_through: int | None = None

    # ------------------------------------------------------------------ resolving
    async def resolve(
        self, recipe: Recipe, *, compile: bool, context: Context, route: str = "resolve"
    ) -> ResolveResponse:
        """Resolve one prepared recipe (a hit from memory when it can be) and audit it.

        Raises the engine's error (not found with ``compile`` false, a compile error).
        """
        answer = self._resolve_from_memory(recipe, context, route)
        if answer is None:
            answer = await self._run(self._resolve_with_engine, recipe, compile, context, route)
        return answer

    async def resolve_batch(
        self,
        recipes: Sequence[Recipe | KCacheError],
        *,
        compile: bool,
        context: Context,
    ) -> list[BatchResult]:
        """One result per recipe, in order; recipes are resolved in parallel.

        An item that is already an error (it failed its checks) and a recipe whose
        resolve fails both become ``{"status": "error", ...}`` results.
        """
        results: list[BatchResult | None] = [
            error_result(item) if isinstance(item, KCacheError) else None for item in recipes
        ]

        async def one(i: int, recipe: Recipe) -> None:
            try:
                results[i] = await self.resolve(
                    recipe, compile=compile, context=context, route="batch"
                )
            except KCacheError as exc:
                results[i] = error_result(exc)

        async with anyio.create_task_group() as group:
            for i, item in enumerate(recipes):
                if isinstance(item, Recipe):
                    group.start_soon(one, i, item)
        # Every slot is filled: an error up front, or by ``one`` (which catches what it raises).
        return cast(list[BatchResult], results)

    def _resolve_from_memory(
        self, recipe: Recipe, context: Context, route: str
    ) -> ResolveResponse | None:
        """A hit answered from memory (no worker thread, no database), or None to ask the engine.

        :meth:`memory_hit` decides, :meth:`record_hit` audits, :meth:`hit_response` answers:
        the resolve fast path below the framework calls the same three.
        """
        started = time.perf_counter()
        meta = self.memory_hit(recipe)
        if meta is None:
            return None
        self.record_hit(recipe, context, route, started, meta)
        return self.hit_response(recipe, meta)

    def memory_hit(self, recipe: Recipe) -> ArtifactMeta | None:
        """The artifact a resolve of ``recipe`` may be answered with from memory, or None.

        The key must be known here and still servable (:meth:`_unservable`), and the
        blob's bytes known good without reading them (:meth:`_trusted_blob`): a
        collected blob is compiled again, a damaged one found by the engine's path.
        This is the whole decision of a memory hit, shared with the resolve fast path.
        """
        known = self._cached(recipe.key())
        if known is None or not self._trusted_blob(known.meta.digest):
            return None
        return known.meta

    def hit_response(self, recipe: Recipe, meta: ArtifactMeta) -> ResolveResponse:
        """The answer to a resolve of ``recipe`` that :meth:`memory_hit` found ``meta`` for.

        Nothing in it belongs to the request: one key always answers the same body
        for the same ``meta``, so a caller may encode it once (the resolve fast path does).
        """
        key = recipe.key()
        known = self._known.get(key)
        if known is None or known.meta is not meta:
            known = _Known(meta)  # built for this answer only
        if known.body is None:  # built once per key, not per hit
            known.body = ArtifactBody.model_validate(meta.to_dict())
        return ResolveResponse(
            status="hit",
            recipe_key=key,
            base_key=recipe.base_key(),
            artifact=known.body,
            signature=self.signature(key, meta),
        )

    def signature(self, recipe_key: str, meta: ArtifactMeta) -> SignatureBody:
        """The server's signature of ``recipe_key`` -> ``meta``, as a response body part."""
        signature = self.signer.sign(recipe_key, meta)
        return SignatureBody(key_id=signature.key_id, signature=signature.signature)

    def record_hit(
        self, recipe: Recipe, context: Context, route: str, started: float, meta: ArtifactMeta
    ) -> None:
        """Audit a resolve of ``recipe`` answered from memory with ``meta`` (tallied per caller)."""
        self._audit(recipe, context, route, started, "hit", meta)

    def _resolve_with_engine(
        self, recipe: Recipe, compile: bool, context: Context, route: str
    ) -> ResolveResponse:
        """The engine's answer (blocking: index, lock, compile), audited and remembered."""
        started = time.perf_counter()
        try:
            result = self._engine_resolve(recipe, compile)
        except ArtifactSetAsideError:
            self._audit(recipe, context, route, started, "miss", error="set_aside")
            raise
        except ArtifactNotFoundError as exc:
            self._audit(recipe, context, route, started, "miss", error="not_found")
            raise ArtifactNotFoundError(
                f"no artifact for recipe {recipe.key()} (and compile is false)"
            ) from exc
        except KCacheError as exc:
            self._audit(recipe, context, route, started, "error", error=error_info(exc).code)
            raise
        self._audit(recipe, context, route, started, result.status, result.artifact, via=result.via)
        answer = ResolveResponse.model_validate(
            {
                **result.to_dict(),
                "signature": self.signer.sign(result.recipe_key, result.artifact).to_dict(),
            }
        )
        self._remember(result.recipe_key, _Known(result.artifact, answer.artifact))
        return answer

    def _engine_resolve(self, recipe: Recipe, compile: bool) -> Resolution:
        """The engine's answer, a hit only once its bytes are known good (see the module docstring).

        A hit whose blob fails its check (set aside by the store just now) is asked
        again: a miss now, compiled afresh with ``compile``, else
        :class:`ArtifactSetAsideError`. So is a compile whose linked recipe's blob failed.
        """
        key = recipe.key()
        set_aside = self._set_aside_digest(key)  # seen by an earlier request of this process
        for _ in range(2):
            try:
                result = self.backends.engine.resolve(recipe, compile=compile)
            except CorruptArtifactError as exc:  # a blob the engine read itself: a link input
                self._note_set_aside(exc)
                set_aside = exc.digest
                continue
            except ArtifactNotFoundError as exc:
                if set_aside is not None:
                    raise ArtifactSetAsideError(set_aside, key) from exc
                raise
            digest = result.artifact.digest
            if result.status == "compiled":
                self._set_aside.discard(digest)  # stored afresh
                return result
            if self._servable(digest):
                return result
            if self._set_aside.get(digest):
                set_aside = digest
        if set_aside is not None:  # set aside twice in a row: another copy failed its check too
            raise ArtifactSetAsideError(set_aside, key)
        raise ArtifactNotFoundError(  # collected twice between the engine's look and the read
            f"the blob of recipe {key} was removed while it was read; resolve it again"
        )

    def _set_aside_digest(self, recipe_key: str) -> str | None:
        known = self._known.get(recipe_key)
        if known is not None and self._set_aside.get(known.meta.digest):
            return known.meta.digest
        return None

    def _audit(
        self,
        recipe: Recipe,
        context: Context,
        route: str,
        started: float,
        outcome: Outcome,
        meta: ArtifactMeta | None = None,
        *,
        error: str | None = None,
        via: str | None = None,
    ) -> None:
        saved = meta.compile_seconds if meta is not None and outcome in ("hit", "waited") else 0.0
        latency_ms = (time.perf_counter() - started) * 1000.0
        who = context.model_dump()

        def make() -> AuditRecord:
            return AuditRecord(
                outcome=outcome,
                route=route,
                latency_ms=latency_ms,
                recipe_key=recipe.key(),
                base_key=recipe.base_key(),
                digest=meta.digest if meta is not None else None,
                kernel=kernel_name(recipe)[:1024],
                target=recipe.target,
                toolchain=recipe.toolchain,
                error=error,
                compile_seconds_saved=saved,
                **who,
            )

        if outcome == "hit" and meta is not None:
            # Repeated hits of one recipe by one caller become one counted row per flush.
            tally = (route, recipe.key(), meta.digest, *who.values())
            self.audit.tally(tally, make, latency_ms, saved)
            if via is not None and self.recipe_records is not None:  # found by the engine
                self.recipe_records.note(recipe, keep=True)
        else:
            record = make()
            # A miss is explained (and a compiled recipe kept) before the row is written.
            explain = outcome == "compiled" or (outcome == "miss" and error != "set_aside")
            if explain and self.recipe_records is not None:
                self.recipe_records.note(recipe, record, keep=outcome == "compiled")
            self.audit.record(record)

    # ------------------------------------------------------------------ fetching by key
    def _unservable(self, recipe_key: str, meta: ArtifactMeta) -> str | None:
        """Why ``meta`` must not be served for ``recipe_key`` now (None: it may be).

        The one check of the fetch path, for memory and index alike; the engine
        refuses the same artifacts when it resolves.
        """
        if not meta.dependencies_exact:
            # Recorded before every file a compile read was attributed: a changed
            # header it read might go unnoticed.
            return (
                f"the artifact for recipe {recipe_key} was recorded without an exact list of the files "
                "it read, so it is not served; resolve the recipe again to compile it afresh"
            )
        sets = self.backends.compiler.include_sets
        if not proven(meta.dependency_check, manifest=False, include_sets=sets):
            return (
                f"the artifact for recipe {recipe_key} was recorded before dependency lists were "
                "proven, and this server has include sets it may have missed, so it is not served; "
                "resolve the recipe again to compile it afresh"
            )
        if not include_set_files_unchanged(meta.dependencies, sets):
            return (
                f"the artifact for recipe {recipe_key} read include-set files that have changed since; "
                "resolve the recipe again"
            )
        return None

    def _cached(self, recipe_key: str) -> _Known | None:
        known = self._known.get(recipe_key)
        if known is not None and self._unservable(recipe_key, known.meta) is not None:
            self._known.discard(recipe_key)
            return None
        return known

    def cached_artifact(self, recipe_key: str) -> ArtifactMeta | None:
        """The artifact for ``recipe_key`` from memory if it may still be served (no I/O on the index)."""
        # The fast path's first call on every warm fetch: _cached inlined.
        known = self._known.get(recipe_key)
        if known is None:
            return None
        if self._unservable(recipe_key, known.meta) is not None:
            self._known.discard(recipe_key)
            return None
        return known.meta

    async def artifact(self, recipe_key: str) -> ArtifactMeta:
        """The artifact recorded for ``recipe_key``: from memory, else from the index (and remembered).

        Raises :class:`ArtifactNotFoundError` for an unknown key and for an artifact
        that may not be served (see :meth:`_unservable`), and the recorded error for
        a recipe whose compile failed.
        """
        meta = self.cached_artifact(recipe_key)
        if meta is None:
            meta = await self._run(self._artifact_from_index, recipe_key)
        return meta

    def _artifact_from_index(self, recipe_key: str) -> ArtifactMeta:
        entry = self.backends.index.lookup(recipe_key)
        if entry is None:
            raise ArtifactNotFoundError(f"no artifact for recipe {recipe_key}")
        if isinstance(entry, CompileFailure):
            raise failure_error(entry)
        problem = self._unservable(recipe_key, entry)
        if problem is not None:
            raise ArtifactNotFoundError(problem)
        # The blob read that follows notices one that was garbage-collected.
        self._remember(recipe_key, _Known(entry))
        return entry

    def forget(self, recipe_key: str) -> None:
        """Drop what memory holds for ``recipe_key`` (its blob was not found)."""
        self._known.discard(recipe_key)

    def cached_blob(self, digest: str) -> bytes | None:
        """A blob's bytes if they are in memory."""
        return self._blobs.get(digest)

    async def blob(self, digest: str) -> bytes:
        """A blob's verified bytes: from memory, else read from the store (and kept if small)."""
        data = self._blobs.get(digest)
        if data is None:
            data = await self._run(self._blob_from_store, digest)
        return data

    def _blob_from_store(self, digest: str) -> bytes:
        """Read and verify; a blob that fails is set aside by the store: :class:`ArtifactSetAsideError`."""
        read_at = time.time_ns()
        try:
            data = self.backends.store.get(digest)
        except ArtifactNotFoundError:  # the store's message names its directory: not for callers
            if self._set_aside.get(digest):
                raise ArtifactSetAsideError(digest) from None
            raise ArtifactNotFoundError(f"no blob {digest}") from None
        except CorruptArtifactError as exc:  # its text names the quarantine: for the log only
            self._note_set_aside(exc)
            raise ArtifactSetAsideError(digest) from None
        self._set_aside.discard(digest)
        stamp = self._stamp(digest)
        if stamp is not None and stamp[1] == len(data) and stamp[3] < read_at - _RACY_NS:
            self._verified.put(digest, stamp)
        if len(data) <= _MAX_CACHED_BLOB:
            self._blobs.put(digest, data)
        return data

    def _note_set_aside(self, exc: CorruptArtifactError) -> None:
        _log.warning("a stored blob failed its check and was set aside: %s", exc)
        self._set_aside.put(exc.digest, True)
        self._verified.discard(exc.digest)
        self._blobs.discard(exc.digest)

    def _stamp(self, digest: str) -> _Stamp | None:
        """The blob file's identity now (a bucket store's local copy), or None without one."""
        # The store's own file, without a pathlib object (every memory hit asks); never
        # path(), which fills a bucket store's local copy first.
        path = self.backends.store.local_file(digest)
        if path is None:
            return None
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def _trusted_blob(self, digest: str) -> bool:
        """Whether the bytes of ``digest`` are known good without reading them.

        Verified bytes in memory (while the store still has the blob: a collected one
        is compiled again), or a blob file unchanged since this process verified it.
        """
        if self._blobs.get(digest) is not None:
            return self.backends.store.has(digest)
        stamp = self._verified.get(digest)
        return stamp is not None and stamp == self._stamp(digest)

    def _servable(self, digest: str) -> bool:
        """Whether the engine's hit on ``digest`` can be served: trusted, else read and verified now."""
        if self._trusted_blob(digest):
            return True
        try:
            self._blob_from_store(digest)
        except ArtifactNotFoundError:  # set aside just now, or collected since the engine looked
            return False
        return True

    def forget_blob(self, digest: str) -> None:
        """Drop a blob's bytes from memory (the store is asked next time)."""
        self._blobs.discard(digest)

    def withdraw(self, recipe_key: str, digest: str) -> None:
        """Forget ``recipe_key``: its binding to ``digest`` was withdrawn (the index no longer has it).

        Called by this process's verifier and by the withdrawals follower for every
        replica's withdrawals. The pair is remembered (bounded), so an index read that
        began before the withdrawal and ends after it is not put back into memory. The
        digest's bytes stay: other recipes may be bound to them rightly.
        """
        self._withdrawn.put((recipe_key, digest), True)
        self._known.discard(recipe_key)

    def _remember(self, recipe_key: str, known: _Known) -> None:
        """Keep what the index or the engine answered for ``recipe_key``, unless it was withdrawn."""
        if self._withdrawn.get((recipe_key, known.meta.digest)) is None:
            self._known.put(recipe_key, known)

    def record_fetch(
        self,
        recipe_key: str,
        meta: ArtifactMeta | None,
        started: float,
        outcome: Outcome,
        context: str | None = None,
    ) -> None:
        """Audit a ``GET /v1/recipes/{key}/artifact`` (identical hits are tallied, not rowed).

        ``context`` is the request's ``X-KCache-Context`` as sent: who asked (a resolve's
        context fields), read only when a row is made; hits are tallied per context, so
        each job and process keeps its own row, as its resolves do.
        """
        latency_ms = (time.perf_counter() - started) * 1000.0

        def make() -> AuditRecord:
            return AuditRecord(
                outcome=outcome,
                route="fetch",
                latency_ms=latency_ms,
                recipe_key=recipe_key,
                digest=meta.digest if meta else None,
                kernel=meta.kernel if meta else None,
                target=meta.target if meta else None,
                toolchain=meta.toolchain if meta else None,
                **fetch_context(context),
            )

        if meta is not None and outcome == "hit":
            self.audit.tally(
                ("fetch", recipe_key, meta.digest, context), make, latency_ms, meta.compile_seconds
            )
        else:
            self.audit.record(make())


def fetch_context(value: str | None) -> dict[str, Any]:
    """A fetch's ``X-KCache-Context`` as the audit columns a resolve's context fills: the
    fields that decode and fit :class:`Context` (its bounds), the others left out."""
    fields = decode_context(value)
    if not fields:
        return {}
    try:
        return Context.model_validate(fields).model_dump(exclude_none=True)
    except ValueError:  # pydantic's ValidationError: one field out of bounds
        kept = {}
        for name, item in fields.items():
            try:
                kept.update(Context.model_validate({name: item}).model_dump(exclude_none=True))
            except ValueError:
                continue
        return kept
