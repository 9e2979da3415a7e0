"""GPU-less prebuild: a job manifest's kernels compiled on the server for other targets.

A new GPU generation (or a toolchain upgrade) should cost no cold compile in
production. A manifest (``kcache manifest save``) names each kernel a job used by its
recipe key; the server recorded each recipe it compiled, so from a CPU machine::

    prebuild(cache, manifest, ["sm_90", "sm_100"]) -> PrebuildResult
      per kernel:            GET /v1/recipes/{key}/recipe   the recipe, checked to hash to its key
      per kernel x target:   the same recipe, only its target changed (:func:`retarget`)
                             POST /v1/resolve {"compile": true}   hit, compiled or waited

:func:`prebuild` is the one entry point (``kcache prebuild`` calls it): a function of a
:class:`~kcache_client.KernelCache` rather than a method of it, because it only uses the
cache's server (no node tier, no bytes are downloaded: the server compiles and stores,
which is the point) and so the cache's module does not grow another job-level command.
At most ``jobs`` requests are in flight; a recipe the server holds already is a ``hit``
and not compiled again; identical resolves of two callers join one compile (``waited``).

Nothing is skipped without a word: a manifest kernel whose recipe the server does not
hold (compiled elsewhere, or too large to keep whole) is ``missing`` for every target,
with the server's reason; a recipe that does not compile for a target (NVRTC's log),
that the server refuses (a target its NVRTC does not support, a cubin asked of a
virtual target) or that cannot be made for it is ``failed``, with the first lines of
the reason. A server that cannot be reached, refuses the token, or answers what this
client cannot trust stops the run (raised): every later request would fail alike.

:func:`fleet_targets` is what ``kcache prebuild`` offers when no target is named: the
targets of the server's audited lookups (``GET /v1/stats?group_by=target``), busiest first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlencode

from kcache.artifact import ArtifactMeta
from kcache.artifact_header import parse_meta
from kcache.errors import CompileError, RecipeError
from kcache.job_manifest import JobManifest, ManifestKernel
from kcache.recipe import Recipe
from kcache.targets import Target, parse_target
from kcache_client.errors import (
    AuthenticationError,
    ClientError,
    RemoteNotFoundError,
    ServerResponseError,
)

if TYPE_CHECKING:
    from kcache_client._cache import KernelCache
    from kcache_client._remote import Remote

__all__ = [
    "DEFAULT_JOBS",
    "FLEET_WINDOW",
    "MAX_JOBS",
    "PrebuildItem",
    "PrebuildOutcome",
    "PrebuildResult",
    "fleet_targets",
    "parse_targets",
    "prebuild",
    "retarget",
]

#: Requests in flight by default: the server compiles in parallel on its own workers, and
#: a prebuild shares it with production lookups.
DEFAULT_JOBS = 4
#: The most a caller may ask for (the server's fairness bounds a token's share anyway).
MAX_JOBS = 64
#: The window of audited lookups whose targets count as the fleet's.
FLEET_WINDOW = "30d"
#: Lines of a compile log (or of a refusal) a failure is told with.
REASON_LINES = 3

#: How one (kernel, target) ended: the server's resolve status (``hit``: it held the
#: recipe already), ``planned`` (a dry run: it would compile), ``failed``, or ``missing``
#: (the server holds no recipe of the manifest's kernel).
PrebuildOutcome = Literal["hit", "compiled", "waited", "planned", "failed", "missing"]
_OK: frozenset[str] = frozenset({"hit", "compiled", "waited", "planned"})
OUTCOME_ORDER: tuple[PrebuildOutcome, ...] = (
    "compiled",
    "waited",
    "hit",
    "planned",
    "failed",
    "missing",
)


@dataclass(frozen=True)
class PrebuildItem:
    """One manifest kernel for one target, and how its prebuild ended."""

    #: The manifest's entry it was made from.
    kernel: ManifestKernel
    #: The target asked for (the recipe's own may be its virtual form: :func:`retarget`).
    target: str
    outcome: PrebuildOutcome
    #: The retargeted recipe's key (None when no recipe could be made).
    recipe_key: str | None = None
    #: The artifact the server holds for it now (hit, compiled, waited; a dry run's hit).
    artifact: ArtifactMeta | None = None
    #: ``failed`` or ``missing``: what went wrong, the compile log's first lines.
    reason: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the server holds (or, in a dry run, would compile) this kernel for the target."""
        return self.outcome in _OK

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (an item of ``kcache prebuild --json``)."""
        return {
            "kernel": self.kernel.kernel,
            "label": self.kernel.label,
            "source_key": self.kernel.recipe_key,
            "target": self.target,
            "outcome": self.outcome,
            "recipe_key": self.recipe_key,
            "digest": self.artifact.digest if self.artifact is not None else None,
            "reason": self.reason,
            "seconds": round(self.seconds, 3),
        }


@dataclass(frozen=True)
class PrebuildResult:
    """What :func:`prebuild` did: an item per (manifest kernel, target), in manifest order."""

    manifest: JobManifest
    targets: tuple[str, ...]
    items: tuple[PrebuildItem, ...]
    dry_run: bool = False

    @property
    def counts(self) -> dict[str, int]:
        """Items by outcome (every outcome named, zero included)."""
        counts: dict[str, int] = dict.fromkeys(OUTCOME_ORDER, 0)
        for item in self.items:
            counts[item.outcome] += 1
        return counts

    @property
    def failures(self) -> tuple[PrebuildItem, ...]:
        """The items that are ``failed`` or ``missing``."""
        return tuple(item for item in self.items if not item.ok)

    @property
    def complete(self) -> bool:
        """Whether every kernel is held (or would be compiled) for every target."""
        return not self.failures

    def prebuilt(self) -> JobManifest:
        """A manifest of what the server now holds for the asked targets (``kcache bundle create``)."""
        kernels = [
            ManifestKernel(
                item.recipe_key,
                item.artifact.digest,
                item.artifact.kernel or item.kernel.kernel,
                item.artifact.target,
                item.artifact.toolchain,
                item.artifact.kind,
                item.artifact.size,
            )
            for item in self.items
            if item.artifact is not None and item.recipe_key is not None
        ]
        return JobManifest.of(kernels, self.manifest.job_id)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form ``kcache prebuild --json`` prints."""
        return {
            "manifest": self.manifest.digest,
            "kernels": len(self.manifest),
            "targets": list(self.targets),
            "dry_run": self.dry_run,
            "counts": self.counts,
            "complete": self.complete,
            "items": [item.to_dict() for item in self.items],
        }


# ---------------------------------------------------------------------- targets
def parse_targets(values: Iterable[str]) -> tuple[Target, ...]:
    """The targets of ``values`` (each may be a comma-separated list), in order, once each.

    RecipeError (field ``target``) for a text that is not a target, for ``auto`` (a
    prebuild names the GPUs it builds for), and for an empty list.
    """
    found: dict[str, Target] = {}
    for value in values:
        for text in value.split(","):
            text = text.strip()
            if not text:
                continue
            if text == "auto":
                raise RecipeError(
                    "target",
                    '"auto" means the GPU of the machine that runs the kernel; a prebuild '
                    "names the targets it builds for: sm_90,sm_100",
                )
            found.setdefault(text, parse_target(text))
    if not found:
        raise RecipeError("target", "no target named; name one or more: sm_90,sm_100")
    return tuple(found.values())


def retarget(recipe: Recipe, target: Target, toolchain: str | None = None) -> Recipe:
    """``recipe`` for ``target`` (and ``toolchain``, when given): nothing else changes.

    A recipe of a real target (``sm_XX``, a cubin or its PTX/LTO-IR) takes ``target`` as
    given; one of a virtual target (``compute_XX``: PTX or LTO-IR) keeps its kind and
    takes the virtual form of ``target`` (``sm_100`` -> ``compute_100``). Linked recipes
    of the recipe's own architecture (the LTO-IR it links) follow it the same way; those
    of another architecture, and linked artifacts by digest, are kept as they are.
    RecipeError when the result is not a recipe (a cubin asked of a virtual target).
    """
    own = parse_target(recipe.target).sm
    return Recipe.from_dict(_retargeted(recipe.to_dict(), own, target, toolchain))


def _retargeted(
    data: dict[str, Any], own: int, target: Target, toolchain: str | None
) -> dict[str, Any]:
    current = parse_target(data["target"])
    out = dict(data)
    if current.sm == own:
        family = "compute" if current.is_virtual else target.family
        out["target"] = f"{family}_{target.sm}{target.suffix}"
    if toolchain is not None:
        out["toolchain"] = toolchain
    out["link"] = [
        {"recipe": _retargeted(item["recipe"], own, target, toolchain)}
        if "recipe" in item
        else item
        for item in data.get("link", ())
    ]
    return out


def fleet_targets(cache: KernelCache, window: str = FLEET_WINDOW) -> list[tuple[str, int]]:
    """(target, lookups) of the server's audited lookups within ``window``, busiest first.

    From ``GET /v1/stats?group_by=target``: every lookup the server saw or was told of,
    a prebuild's own included. Groups that are not a target are left out.
    """
    query = urlencode({"group_by": "target", "since": window, "limit": 200, "top": 1})
    body = cache._require_server().transport.request_json("GET", f"/v1/stats?{query}")
    groups = body.get("groups") if isinstance(body, dict) else None
    found: dict[str, int] = {}
    for group in groups if isinstance(groups, list) else ():
        if not isinstance(group, dict):
            continue
        key, total = group.get("key"), group.get("total")
        if not isinstance(key, str) or not isinstance(total, int):
            continue
        try:
            parse_target(key)
        except RecipeError:
            continue
        found[key] = found.get(key, 0) + total
    return sorted(found.items(), key=lambda pair: (-pair[1], pair[0]))


# ---------------------------------------------------------------------- prebuild
def prebuild(
    cache: KernelCache,
    manifest: JobManifest,
    targets: Sequence[str],
    *,
    toolchain: str | None = None,
    jobs: int = DEFAULT_JOBS,
    dry_run: bool = False,
    progress: Callable[[PrebuildItem, int, int], None] | None = None,
) -> PrebuildResult:
    """Compile every kernel of ``manifest`` for each of ``targets`` on ``cache``'s server.

    See the module docstring. ``targets`` are target texts, each possibly a
    comma-separated list (checked by :func:`parse_targets`); ``toolchain`` a toolchain id
    to build with instead of each recipe's own (``"default"``: the server's); ``jobs`` the
    requests in flight (1 to :data:`MAX_JOBS`). ``dry_run`` compiles nothing: each recipe is looked up
    by key (``GET /v1/recipes/{key}``, not a lookup on the audit's books), a ``hit`` when
    the server holds it, else ``planned`` (a recipe that a dependency-aware match would
    serve is counted as planned). ``progress(item, done, total)`` is called in the
    calling thread as each item ends. The resolves carry the cache's context, with the
    job id ``prebuild-<manifest digest>`` unless the settings name a job.

    Raises RecipeError for a bad target list, ValueError for a bad ``jobs``, and the
    server's errors that stop the run (ServerUnavailableError, AuthenticationError, a
    MetadataError or UntrustedArtifactError of an answer that cannot be trusted).
    """
    chosen = parse_targets(targets)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= MAX_JOBS:
        raise ValueError(f"jobs must be a whole number from 1 to {MAX_JOBS}, not {jobs!r}")
    remote = cache._require_server()
    if toolchain == "default":
        toolchain = cache.default_toolchain()
    context = dict(cache.context())
    context["job_id"] = cache.settings.job_id or f"prebuild-{manifest.digest[:16]}"
    total = len(manifest) * len(chosen)
    results: dict[tuple[str, str], PrebuildItem] = {}
    done = 0

    def finished(item: PrebuildItem) -> None:
        nonlocal done
        results[(item.kernel.recipe_key, item.target)] = item
        done += 1
        if progress is not None:
            progress(item, done, total)

    # A window of work in flight, kernels read as it drains: the first line comes after
    # the first kernel, not after every recorded recipe of a 100,000-kernel manifest was
    # fetched (and held: 300 MB), as it did.
    window = jobs * 4
    kernels = iter(manifest.kernels)
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="kcache-prebuild") as pool:
        pending: dict[Future[Any], ManifestKernel | None] = {}

        def refill() -> None:
            while len(pending) < window:
                kernel = next(kernels, None)
                if kernel is None:
                    return
                pending[pool.submit(_recorded, remote, kernel.recipe_key)] = kernel

        try:
            refill()
            while pending:
                ready, _ = wait(pending, return_when=FIRST_COMPLETED)
                for job in ready:
                    kernel = pending.pop(job)
                    if kernel is None:  # one (kernel, target) ended
                        finished(job.result())
                        continue
                    recorded = job.result()
                    for target in chosen:
                        if isinstance(recorded, str):  # the server's reason it holds none
                            finished(PrebuildItem(kernel, target.text, "missing", reason=recorded))
                        else:
                            item = pool.submit(
                                _one, remote, kernel, recorded, target, toolchain, context, dry_run
                            )
                            pending[item] = None
                refill()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    items = tuple(
        results[(kernel.recipe_key, target.text)]
        for kernel in manifest.kernels
        for target in chosen
    )
    return PrebuildResult(manifest, tuple(t.text for t in chosen), items, dry_run)


def _recorded(remote: Remote, recipe_key: str) -> Recipe | str:
    """The recipe the server recorded under ``recipe_key``, checked; else the reason it has none."""
    try:
        body = remote.transport.request_json("GET", f"/v1/recipes/{recipe_key}/recipe")
    except RemoteNotFoundError as exc:
        return exc.detail or str(exc)
    where = f"{remote.url}/v1/recipes/{recipe_key}/recipe"
    data = body.get("recipe") if isinstance(body, dict) else None
    try:
        recipe = Recipe.from_dict(data if isinstance(data, dict) else {})
        key = recipe.key()
    except RecipeError as exc:
        return f"{where} answered a recipe this client cannot read ({exc})"
    if key != recipe_key:
        raise ClientError(
            f"{where} answered a recipe whose key is {key}, not the key asked for: refused "
            "(client and server run different kcache versions, or the answer was altered)"
        )
    return recipe


def _one(
    remote: Remote,
    kernel: ManifestKernel,
    recorded: Recipe,
    target: Target,
    toolchain: str | None,
    context: dict[str, Any],
    dry_run: bool,
) -> PrebuildItem:
    """One (kernel, target): retarget, then resolve with compile (or, dry, look the key up)."""
    started = time.perf_counter()
    key: str | None = None
    try:
        recipe = retarget(recorded, target, toolchain)
        key = recipe.key()
        if dry_run:
            return _looked_up(remote, kernel, target, key, started)
        status, meta, _ = remote.resolve(recipe, key, compile=True, context=context)
    except (CompileError, RecipeError) as exc:
        return _failed(kernel, target, key, _reason(exc), started)
    except AuthenticationError:
        raise  # the token, not this recipe: every request would be refused alike
    except ServerResponseError as exc:  # refused (400/422), store full (507), ...
        return _failed(kernel, target, key, _first_lines(exc.detail or str(exc)), started)
    return PrebuildItem(
        kernel, target.text, status, key, meta, seconds=time.perf_counter() - started
    )


def _looked_up(
    remote: Remote, kernel: ManifestKernel, target: Target, key: str, started: float
) -> PrebuildItem:
    try:
        body = remote.transport.request_json("GET", f"/v1/recipes/{key}")
    except RemoteNotFoundError:
        return PrebuildItem(
            kernel, target.text, "planned", key, seconds=time.perf_counter() - started
        )
    try:
        meta: ArtifactMeta | None = parse_meta(body, "artifact")
    except ValueError:  # the key is held; its metadata is only shown
        meta = None
    return PrebuildItem(
        kernel, target.text, "hit", key, meta, seconds=time.perf_counter() - started
    )


def _failed(
    kernel: ManifestKernel, target: Target, key: str | None, reason: str, started: float
) -> PrebuildItem:
    return PrebuildItem(
        kernel, target.text, "failed", key, reason=reason, seconds=time.perf_counter() - started
    )


def _reason(exc: Exception) -> str:
    """The first lines of a compile's log (the error lines first), or the error's text."""
    if isinstance(exc, CompileError) and exc.log.strip():
        lines = [line.strip() for line in exc.log.splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()]
        return "\n".join((errors or lines)[:REASON_LINES])
    return _first_lines(str(exc))


def _first_lines(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "\n".join(lines[:REASON_LINES])
