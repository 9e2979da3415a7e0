"""The engine: one lookup-or-compile sequence over the store, index, lock and compiler seams.

    recipe -> key -> index (exact) -> manifest match -> [miss] lock -> re-check
           -> compile -> validate -> publish blob -> record index -> release

The CLI, the server and a client compiling locally all run this same sequence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Literal

from kcache.artifact import ArtifactMeta, CompileFailure, CompileOutput
from kcache.compilers import Compiler
from kcache.deps import (
    ABSENT,
    WHOLE_SET,
    include_set_files_unchanged,
    proven,
    set_place,
    unchanged,
)
from kcache.errors import (
    ArtifactNotFoundError,
    ArtifactTooLargeError,
    CompileError,
    CompileTimeoutError,
    CorruptArtifactError,
    IncludeSetChangedError,
    RecipeError,
)
from kcache.include_sets import CURRENT_AGE_S
from kcache.index.base import Index
from kcache.locks import KeyLock
from kcache.nvrtc import kernel_name
from kcache.outcomes import ResolveStatus
from kcache.recipe import Recipe, include_set_digest, include_set_name
from kcache.store.base import ArtifactStore

__all__ = ["Engine", "Resolution", "Via", "failure_error"]

#: How many times a resolve pins again a set this side pinned, when it changed meanwhile.
_REPINS = 3

#: How a resolve found its artifact: by the recipe's own key, by a manifest match (an
#: entry of another recipe with the same base key whose headers read are unchanged), or
#: by compiling it.
Via = Literal["key", "manifest", "compile"]

log = logging.getLogger(__name__)

#: The error each kind of negative entry is answered with (any other kind: CompileError).
_FAILURE_ERRORS: dict[str, type[CompileError]] = {
    "timeout": CompileTimeoutError,
    "too_large": ArtifactTooLargeError,
}


def failure_error(entry: CompileFailure) -> CompileError:
    """The error a recorded failure is answered with (``cached`` set, the recorded log)."""
    return _FAILURE_ERRORS.get(entry.kind, CompileError)(entry.recipe_key, entry.log, cached=True)


@dataclass(frozen=True)
class Resolution:
    """The outcome of :meth:`Engine.resolve`."""

    status: ResolveStatus
    recipe_key: str
    base_key: str
    artifact: ArtifactMeta
    recipe: Recipe
    seconds: float
    via: Via = "key"

    def to_dict(self) -> dict[str, object]:
        """JSON form (the body of a resolve response)."""
        return {
            "status": self.status,
            "recipe_key": self.recipe_key,
            "base_key": self.base_key,
            "artifact": self.artifact.to_dict(),
        }


class Engine:
    """Resolve recipes to published artifacts, compiling each missing one exactly once.

    ``max_artifact_bytes`` refuses compiler output over that size (nothing is stored).
    ``failure_ttl_s`` is how long a compile that timed out, or whose output was too
    large, is remembered as a negative entry, so repeats are answered at once instead
    of holding a worker again; such failures may come from load or settings rather
    than the recipe, so unlike compile errors they expire (0: not remembered).
    """

    def __init__(
        self,
        store: ArtifactStore,
        index: Index,
        lock: KeyLock,
        compiler: Compiler,
        *,
        lock_timeout: float = 900.0,
        max_artifact_bytes: int | None = None,
        failure_ttl_s: float = 0.0,
    ) -> None:
        self.store = store
        self.index = index
        self.lock = lock
        self.compiler = compiler
        self.lock_timeout = lock_timeout
        self.max_artifact_bytes = max_artifact_bytes
        self.failure_ttl_s = failure_ttl_s
        #: Called with every resolution (the server's verifier samples hits from it).
        self.observers: list[Callable[[Resolution], None]] = []

    @property
    def toolchain_id(self) -> str:
        """The id recipes without a toolchain are resolved to."""
        return self.compiler.toolchain.id

    def prepare(self, recipe: Recipe) -> Recipe:
        """Fill in the default toolchain and the include sets' digests; check it can be keyed here.

        An include set named without a digest is pinned to its contents now
        (:meth:`IncludeSets.digest <kcache.include_sets.IncludeSets.digest>`); one pinned
        to other contents is kept as it is: its key may still be held (:meth:`resolve`
        answers it by that key only).
        """
        sets = self.compiler.include_sets
        for i, name in enumerate(recipe.include_sets):
            sets.get(name, f"include_sets[{i}]")
        digests = sets.digests() if recipe.unpinned_include_sets() else None
        resolved = recipe.with_defaults(toolchain=self.toolchain_id, include_sets=digests)
        resolved.key()  # raises UnresolvedRecipeError for target "auto"
        return resolved

    def check_include_sets(self, recipe: Recipe, *, max_age_s: float | None = None) -> None:
        """Raise :class:`IncludeSetChangedError` unless every set ``recipe`` pins has those contents now."""
        sets = self.compiler.include_sets
        for i, entry in enumerate(recipe.include_sets):
            pinned = include_set_digest(entry)
            if pinned is None:
                continue
            name = include_set_name(entry)
            current = sets.digest(name, max_age_s=max_age_s)
            if current != pinned and max_age_s != 0:
                # The digest kept may be older than the caller's: look again (at most
                # ten walks a second, however many requests pin another version).
                current = sets.digest(name, max_age_s=CURRENT_AGE_S)
            if current != pinned:
                raise IncludeSetChangedError(f"include_sets[{i}]", name, pinned, current)
        for item in recipe.link:
            if item.recipe is not None:
                self.check_include_sets(item.recipe, max_age_s=max_age_s)

    def resolve(self, recipe: Recipe, *, compile: bool = True) -> Resolution:
        """Return the artifact for ``recipe``, compiling it (once, across processes) if needed.

        Raises ArtifactNotFoundError when absent and ``compile`` is false, CompileError
        when the compiler rejects it (now or in a recorded earlier attempt), and
        IncludeSetChangedError when the caller pinned an include set to contents it no
        longer has. A set that *this side* pinned (the recipe named it without a digest)
        and that changed within the second its digest is kept is pinned again, walked
        now, and the recipe resolved once more.
        """
        origin = recipe.pinned_from() or recipe
        repins = 0
        while True:
            try:
                return self._resolve(recipe, compile)
            except IncludeSetChangedError:
                repins += 1
                if not origin.unpinned_include_sets() or repins > _REPINS:
                    raise  # the caller's own pin is its answer to give; or a set never still
            fresh = self.compiler.include_sets.digests(max_age_s=0)
            recipe = origin.with_defaults(include_sets=fresh)

    def _pinned_contents(self, recipe: Recipe) -> dict[str, Mapping[str, str | None]]:
        """Each set ``recipe`` pins, walked now: name -> its files' hashes; IncludeSetChangedError
        when one no longer holds the pinned contents (a compile would read other files)."""
        sets = self.compiler.include_sets
        walked: dict[str, Mapping[str, str | None]] = {}
        for i, entry in enumerate(recipe.include_sets):
            name, pin = include_set_name(entry), include_set_digest(entry)
            digest, files = sets.contents(name, max_age_s=0)
            if digest != pin:
                raise IncludeSetChangedError(f"include_sets[{i}]", name, str(pin), digest)
            walked[name] = MappingProxyType({**files, WHOLE_SET: digest})
        return walked

    def _check_read_as_pinned(
        self, recipe: Recipe, output: CompileOutput, pinned: Mapping[str, Mapping[str, str | None]]
    ) -> None:
        """IncludeSetChangedError unless every set file the compile read, and every place it
        looked, is as the pinned contents hold it (files elsewhere in a set may change meanwhile)."""
        for dep in output.dependencies:
            name, relative = set_place(dep.name)
            if name is None or name not in pinned:
                continue
            if dep.sha256 != (pinned[name].get(relative) or ABSENT):
                i = [include_set_name(entry) for entry in recipe.include_sets].index(name)
                pin = include_set_digest(recipe.include_sets[i]) or ""
                now = self.compiler.include_sets.digest(name, max_age_s=0)
                raise IncludeSetChangedError(f"include_sets[{i}]", name, pin, now)

    def _resolve(self, recipe: Recipe, compile: bool) -> Resolution:
        started = time.perf_counter()
        recipe = self.prepare(recipe)
        key, base = recipe.key(), recipe.base_key()
        found = self._find(recipe, key, base)
        if found is not None:
            return self._observed(
                Resolution(
                    "hit", key, base, found[0], recipe, time.perf_counter() - started, found[1]
                )
            )
        if not compile:
            raise ArtifactNotFoundError(f"no artifact for recipe {key}")
        with self.lock.hold(key, self.lock_timeout) as waited:
            found = self._find(recipe, key, base)
            if found is not None:
                status: ResolveStatus = "waited" if waited else "hit"
                elapsed = time.perf_counter() - started
                return self._observed(
                    Resolution(status, key, base, found[0], recipe, elapsed, found[1])
                )
            meta = self._compile_and_publish(recipe, key, base)
        elapsed = time.perf_counter() - started
        return self._observed(Resolution("compiled", key, base, meta, recipe, elapsed, "compile"))

    def _observed(self, resolution: Resolution) -> Resolution:
        for observe in self.observers:
            try:
                observe(resolution)
            except Exception:  # an observer's failure is never the caller's
                log.exception("a resolution observer failed")
        return resolution

    def read(self, meta: ArtifactMeta) -> bytes:
        """The artifact's bytes, verified against its digest."""
        return self.store.get(meta.digest)

    # ------------------------------------------------------------------ internals
    def holding(self, recipe: Recipe) -> tuple[ArtifactMeta, Via] | CompileFailure | None:
        """What :meth:`resolve` would answer ``recipe`` with, without compiling or recording anything.

        ``(artifact, "key")`` for an artifact held under the recipe's own key,
        ``(artifact, "manifest")`` for a dependency-aware match (an artifact of the same
        base key whose recorded headers and include-set files are this recipe's), the
        :class:`CompileFailure` a resolve would answer with, or None: a resolve would
        compile (or miss). A manifest match records no alias here, unlike :meth:`resolve`.
        Raises :class:`IncludeSetChangedError` when a set ``recipe`` pins changed since.
        """
        recipe = self.prepare(recipe)
        key = recipe.key()
        entry = self.index.lookup(key)
        if isinstance(entry, CompileFailure):
            return entry
        return self._find(recipe, key, recipe.base_key(), record=False)

    def held_under(self, recipe_key: str) -> tuple[ArtifactMeta, Via] | CompileFailure | None:
        """:meth:`holding` by key alone (no manifest match: that needs the recipe's headers)."""
        entry = self.index.lookup(recipe_key)
        if isinstance(entry, CompileFailure):
            return entry
        if entry is not None and self._usable(entry):
            return entry, "key"
        return None

    def _find(
        self, recipe: Recipe, key: str, base: str, *, record: bool = True
    ) -> tuple[ArtifactMeta, Via] | None:
        header_hashes = recipe.header_hashes()
        entry = self.index.lookup(key)
        if isinstance(entry, CompileFailure):
            raise failure_error(entry)
        if entry is not None and self._usable(entry):
            return entry, "key"
        # Past the exact key, the files a recipe pins must be the ones here: a manifest
        # match checks today's files, and a compile reads them.
        self.check_include_sets(recipe)
        sets = self.compiler.include_sets
        for candidate in self.index.manifest(base):
            # A match rests on the list alone: one recorded before lists were proven may
            # miss a header the compile read.
            if not proven(candidate.dependency_check, manifest=True, include_sets=sets):
                continue
            if not unchanged(
                candidate.dependencies,
                header_hashes,
                recipe.include_sets,
                self.compiler.include_sets,
            ):
                continue
            meta = self.index.artifact(candidate.digest)
            if (
                meta is not None
                and meta.dependencies_exact
                and proven(meta.dependency_check, manifest=True, include_sets=sets)
                and self.store.has(meta.digest)
            ):
                if record:
                    self.index.record_alias(key, meta.digest)
                return meta, "manifest"
        return None

    def _usable(self, meta: ArtifactMeta) -> bool:
        # An artifact whose dependency list may miss a file it read (recorded before every
        # read was attributed, or before lists were proven, where include-set files could
        # be the ones missed) is never served: a changed file would not be noticed.
        sets = self.compiler.include_sets
        return (
            meta.dependencies_exact
            and proven(meta.dependency_check, manifest=False, include_sets=sets)
            and include_set_files_unchanged(meta.dependencies, sets)
            and self.store.has(meta.digest)
        )

    def link_inputs(self, recipe: Recipe) -> list[bytes]:
        """The bytes of ``recipe``'s link entries, in order (linked recipes resolved first)."""
        inputs = []
        for i, item in enumerate(recipe.link):
            if item.recipe is not None:
                if item.recipe.output != "ltoir":
                    raise RecipeError(
                        f"link[{i}].recipe.output", 'linked recipes must have output "ltoir"'
                    )
                inputs.append(self.read(self.resolve(item.recipe).artifact))
            else:
                assert item.digest is not None
                try:
                    inputs.append(self.store.get(item.digest))
                except (ArtifactNotFoundError, CorruptArtifactError) as exc:
                    raise RecipeError(
                        f"link[{i}].digest", f"no usable stored artifact: {exc}"
                    ) from exc
        return inputs

    def _compile_and_publish(self, recipe: Recipe, key: str, base: str) -> ArtifactMeta:
        pinned = self._pinned_contents(recipe)
        link_inputs = self.link_inputs(recipe)
        try:
            output: CompileOutput = self.compiler.compile(recipe, link_inputs)
        except CompileTimeoutError as exc:
            exc.recipe_key = key
            exc.log = self._remember(key, "timeout", exc.log)
            raise
        except CompileError as exc:
            self.index.record_failure(CompileFailure(key, exc.log))
            exc.recipe_key = key
            raise
        # A set edited while the compile ran: what it read may not be what the key pins.
        self._check_read_as_pinned(recipe, output, pinned)
        return self.publish(recipe, key, base, output)

    def publish(self, recipe: Recipe, key: str, base: str, output: CompileOutput) -> ArtifactMeta:
        """Store ``output`` of ``recipe`` and record it under ``key`` and ``base`` (blob first)."""
        limit = self.max_artifact_bytes
        if limit is not None and len(output.data) > limit:
            detail = (
                f"the compile produced {len(output.data)} bytes of {output.kind}; the limit is {limit} "
                "bytes (max_artifact_bytes), so nothing was stored. Split the program into smaller "
                "ones, or ask the operator to raise the limit"
            )
            raise ArtifactTooLargeError(key, self._remember(key, "too_large", detail))
        digest = self.store.put(output.data)  # blob first; an orphan blob is harmless
        meta = ArtifactMeta(
            digest=digest,
            size=len(output.data),
            kind=output.kind,
            target=output.target,
            toolchain=output.toolchain,
            lowered_names=output.lowered_names,
            compile_seconds=output.compile_seconds,
            log=output.log,
            dependencies=output.dependencies,
            dependencies_exact=output.dependencies_exact,
            dependency_check=output.dependency_check,
            kernel=kernel_name(recipe),
        )
        self.index.record_artifact(key, base, meta)
        return meta

    def _remember(self, key: str, kind: str, detail: str) -> str:
        """Record an expiring negative entry of ``kind``; returns ``detail`` noting until when."""
        if self.failure_ttl_s <= 0:
            return detail
        now = time.time()
        until = now + self.failure_ttl_s
        noted = (
            f"{detail}\n(this recipe is answered with this error, without compiling, until "
            f"{datetime.fromtimestamp(until, timezone.utc):%Y-%m-%d %H:%M:%S} UTC: failure_ttl_s, "
            "KCACHE_FAILURE_TTL_S where the server runs)"
        )
        try:
            self.index.record_failure(CompileFailure(key, noted, now, kind, until))
        except Exception:
            # The caller's error says what happened; not remembering it only costs time.
            log.warning("could not record the %s of recipe %s", kind, key, exc_info=True)
            return detail
        return noted
