"""Multi-rank warmup (design §8): every rank's kernels resolved once per job, or per node.

Every rank resolves ``auto`` for its own device and the ranks all-gather their concrete
recipes (:mod:`~kcache_client._collective`), so mixed targets are covered; the leader
(rank 0, or the lowest rank of each host with ``per_node``) resolves the union with
``get_many`` (``/v1/resolve/batch``, a progress bar) and so fills its node tier; its
broadcast of the outcomes is the barrier; every rank then loads its own recipes
through ``get`` (memory, then the tier the leader filled).

Failures cross process boundaries as plain data (JSON, never pickles), so every rank
raises the same :class:`~kcache_client.errors.WarmupError` with the same fields: a
compile error as :class:`~kcache_client.errors.WarmupCompileError`, a rank that does
not arrive or a leader that dies or runs out of time as
:class:`~kcache_client.errors.WarmupTimeoutError`. What a rank shared that no warmup
sends (a malformed verdict, entry or outcome in the store) is a WarmupError that says
so, the same on every rank, never taken for a rank that died.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kcache.errors import CompileError, KCacheError
from kcache.recipe import Recipe
from kcache_client._artifact import Artifact
from kcache_client._collective import Collective, as_collective
from kcache_client.errors import (
    RecipeRefusedError,
    RemoteCompileError,
    ServerResponseError,
    WarmupCompileError,
    WarmupError,
    WarmupTimeoutError,
)

__all__ = [
    "WarmupResult",
    "error_dict",
    "malformed",
    "recipe_outcome",
    "run_collective",
    "warmup",
]

_T = TypeVar("_T")

#: Share of the warmup timeout the leader may spend resolving; the rest is left for
#: broadcasting its answer before the other ranks give up.
_LEADER_SHARE = 0.85


@dataclass(frozen=True)
class WarmupResult:
    """What ``warmup`` gives each rank: its own artifacts, in the order it asked for them.

    ``statuses`` are the leader's outcomes for this rank's recipes (``hit``, ``compiled``,
    ``waited``, ``local_hit``); ``union_size`` is how many distinct recipes the leader
    resolved for the whole group (or node).
    """

    artifacts: list[Artifact]
    statuses: list[str]
    leader: bool
    union_size: int
    seconds: float


class WarmupCache(Protocol):
    """What a warmup needs of a ``KernelCache``."""

    rank: int

    @property
    def host(self) -> str:
        """This machine's name (the ranks of one node agree on it)."""
        ...

    def prepare(self, recipe: Recipe) -> Recipe:
        """The concrete recipe (``auto`` and the default toolchain filled in)."""
        ...

    def get(self, recipe: Recipe, *, compile: bool = True) -> Artifact:
        """One artifact: memory, node tier, server."""
        ...

    def get_many(
        self,
        recipes: Sequence[Recipe],
        *,
        compile: bool = True,
        progress: bool = False,
        context: Mapping[str, Any] | None = None,
    ) -> list[Artifact | KCacheError]:
        """An artifact or a typed error per recipe, through ``/v1/resolve/batch``."""
        ...

    def context(self) -> dict[str, Any]:
        """Who is asking, for the server's audit."""
        ...


def warmup(
    cache: WarmupCache,
    recipes: Iterable[Recipe],
    group: Any = None,
    *,
    per_node: bool = False,
    timeout: float = 1800.0,
    compile: bool = True,
    progress: bool | None = None,
) -> WarmupResult:
    """``KernelCache.warmup``: see its docstring and the module docstring."""
    started = time.monotonic()
    own = list(recipes)
    coll = as_collective(group, timeout=timeout)
    if coll is None:
        concrete = [cache.prepare(r) for r in own]
        keys = [r.key() for r in concrete]
        results = cache.get_many(concrete, compile=compile, progress=bool(progress))
        outcomes = {
            key: recipe_outcome(key, result) for key, result in zip(keys, results, strict=True)
        }
        _raise_first_error(outcomes, keys, leader=cache.rank)
        held = {key: r for key, r in zip(keys, results, strict=True) if isinstance(r, Artifact)}
        return _finish(
            cache, concrete, outcomes, held, leader=True, union=len(outcomes), started=started
        )
    return _warmup_group(cache, own, coll, per_node, timeout, compile, progress, started)


def _warmup_group(
    cache: WarmupCache,
    own: list[Recipe],
    coll: Collective,
    per_node: bool,
    timeout: float,
    compile: bool,
    progress: bool | None,
    started: float,
) -> WarmupResult:
    rank, size = coll.rank, coll.world_size
    # The leader's requests name its place in this warmup's group; the cache's own
    # rank (the job's) is left as it is for everything else.
    context = {"rank": rank, "world_size": size}
    concrete_or_error: list[Recipe] | dict[str, Any]
    try:
        concrete_or_error = [cache.prepare(r) for r in own]
        mine: Any = {
            "host": cache.host,
            "recipes": [(r.key(), r.to_dict()) for r in concrete_or_error],
        }
    except Exception as exc:  # shared with everyone below, so no rank waits for this one
        concrete_or_error = error_dict(exc, rank)
        mine = {"host": cache.host, "error": concrete_or_error}
    gathered = run_collective(lambda: coll.all_gather(mine), "all-gather of the recipes", 0)
    _check_gathered(gathered, size)
    for entry in gathered:
        if "error" in entry:
            raise WarmupError.from_dict(entry["error"])
    assert isinstance(concrete_or_error, list)
    concrete = concrete_or_error

    hosts = [entry["host"] for entry in gathered]
    members = [r for r in range(size) if not per_node or hosts[r] == cache.host]
    leader = members[0]
    leaders = sorted({hosts.index(host) for host in hosts}) if per_node else [0]
    payload: dict[str, Any] | None = None
    held: dict[str, Artifact] = {}
    if rank == leader:
        union: dict[str, Recipe] = {}
        for member in members:
            for key, data in gathered[member]["recipes"]:
                if key not in union:
                    union[key] = Recipe.from_dict(data)
        show = progress if progress is not None else True
        payload, held = _lead(
            cache, list(union.values()), compile, show, timeout * _LEADER_SHARE, leader, context
        )
    if per_node:
        answers = run_collective(
            lambda: coll.all_gather(payload), "gather of the leaders' outcomes", leader
        )
    else:
        answers = [
            run_collective(lambda: coll.broadcast(payload, 0), "broadcast of the outcomes", 0)
        ]
    _check_outcomes(answers, leaders if per_node else [0])
    # Every leader's failure is checked in rank order, so with several leaders
    # (per_node) every rank still raises the same error, not only its node's ranks.
    for r in leaders:
        if answers[r].get("error"):
            raise WarmupError.from_dict(answers[r]["error"])
    payload = answers[leader]  # leader is 0 without per_node: the broadcast's only answer
    assert isinstance(payload, dict)
    outcomes = payload["outcomes"]
    _raise_first_error(outcomes, list(outcomes), leader=leader)
    return _finish(
        cache,
        concrete,
        outcomes,
        held,
        leader=rank == leader,
        union=len(outcomes),
        started=started,
    )


def _lead(
    cache: WarmupCache,
    union: list[Recipe],
    compile: bool,
    progress: bool,
    budget: float,
    leader: int,
    context: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Artifact]]:
    """Resolve the union within ``budget`` seconds: the outcomes (plain data) and the artifacts.

    Every failure becomes plain data in the outcomes' ``error``.
    """
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kcache-warmup")
    future = pool.submit(cache.get_many, union, compile=compile, progress=progress, context=context)
    try:
        results = future.result(timeout=budget)
    except concurrent.futures.TimeoutError:
        error = WarmupTimeoutError(
            f"warmup: the leader (rank {leader}) did not resolve {len(union)} recipes within {budget:.0f}s",
            kind="TimeoutError",
            leader=leader,
        )
        return {"outcomes": {}, "error": error.to_dict()}, {}
    except Exception as exc:
        return {"outcomes": {}, "error": error_dict(exc, leader)}, {}
    finally:
        pool.shutdown(wait=False)  # a stuck request must not hold the broadcast back
    keys = [r.key() for r in union]
    outcomes = {key: recipe_outcome(key, result) for key, result in zip(keys, results, strict=True)}
    held = {key: r for key, r in zip(keys, results, strict=True) if isinstance(r, Artifact)}
    return {"outcomes": outcomes, "error": None}, held


def _finish(
    cache: WarmupCache,
    concrete: list[Recipe],
    outcomes: dict[str, dict[str, Any]],
    held: Mapping[str, Artifact],
    *,
    leader: bool,
    union: int,
    started: float,
) -> WarmupResult:
    # The leader has its artifacts already; every other rank loads its own through get():
    # memory, then the tier the leader filled (a rank on another node downloads once per node).
    artifacts = [held.get(r.key()) or cache.get(r) for r in concrete]
    statuses = [str(outcomes.get(a.recipe_key, {}).get("status", "local_hit")) for a in artifacts]
    return WarmupResult(artifacts, statuses, leader, union, time.monotonic() - started)


def recipe_outcome(key: str, result: Artifact | KCacheError) -> dict[str, Any]:
    """One recipe's result as plain data (the broadcast's; `kcache warmup` prints it)."""
    if isinstance(result, Artifact):
        return {"status": result.outcome, "digest": result.digest}
    if isinstance(result, CompileError):
        detail = result.detail if isinstance(result, RemoteCompileError) else str(result)
        return {
            "status": "error",
            "error": "compile_error",
            "detail": detail,
            "log": result.log,
            "recipe_key": result.recipe_key or key,
        }
    if isinstance(result, ServerResponseError | RecipeRefusedError):
        return {
            "status": "error",
            "error": result.code,
            "detail": result.detail,
            "log": getattr(result, "log", ""),
            "recipe_key": key,
        }
    return {
        "status": "error",
        "error": type(result).__name__,
        "detail": str(result),
        "log": "",
        "recipe_key": key,
    }


def error_dict(exc: BaseException, leader: int) -> dict[str, Any]:
    """A failure as plain data, identical on every rank that receives it."""
    if isinstance(exc, WarmupError):
        return exc.to_dict()
    if isinstance(exc, KCacheError) and hasattr(exc, "log") and hasattr(exc, "recipe_key"):
        return WarmupCompileError(
            f"warmup: recipe {exc.recipe_key} does not compile: {exc}",
            kind=type(exc).__name__,
            recipe_key=exc.recipe_key,
            log=str(exc.log),
            leader=leader,
        ).to_dict()
    return WarmupError(
        f"warmup failed on rank {leader}: {type(exc).__name__}: {exc}",
        kind=type(exc).__name__,
        leader=leader,
    ).to_dict()


def _raise_first_error(
    outcomes: dict[str, dict[str, Any]], order: list[str], *, leader: int
) -> None:
    for key in order:
        outcome = outcomes.get(key, {})
        if outcome.get("status") != "error":
            continue
        log = str(outcome.get("log") or "")
        detail = str(outcome.get("detail") or "")
        if outcome.get("error") == "compile_error":
            raise WarmupCompileError(
                f"warmup: recipe {key} does not compile: {detail or log.strip()[:200]}",
                kind="RemoteCompileError",
                recipe_key=key,
                log=log,
                leader=leader,
            )
        raise WarmupError(
            f"warmup: the server refused recipe {key}: {outcome.get('error')}: {detail}",
            kind=str(outcome.get("error")),
            recipe_key=key,
            log=log,
            leader=leader,
        )


def malformed(what: str, rank: int, problem: str) -> WarmupError:
    """The error of data a rank shared that no kcache warmup sends (the same on every rank)."""
    return WarmupError(
        f"warmup: malformed {what} from rank {rank} (of the group): {problem}",
        kind="MalformedVerdict",
        leader=rank,
    )


def _check_gathered(gathered: Any, size: int) -> None:
    """Refuse an all-gather of the recipes that is not one entry per rank as warmups send them."""
    if not isinstance(gathered, list) or len(gathered) != size:
        raise malformed("all-gather of the recipes", 0, f"not a list of {size} entries")
    for rank, entry in enumerate(gathered):
        if not isinstance(entry, dict) or not isinstance(entry.get("host"), str):
            raise malformed("recipes", rank, "not an object naming its host")
        if "error" in entry:
            error = entry["error"]
            if not isinstance(error, dict) or not isinstance(error.get("message"), str):
                raise malformed("recipes", rank, "an error without a message")
            continue
        recipes = entry.get("recipes")
        if not isinstance(recipes, list) or not all(
            isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], dict)
            for item in recipes
        ):
            raise malformed("recipes", rank, "not a list of [key, recipe] pairs")


def _check_outcomes(answers: Any, leaders: list[int]) -> None:
    """Refuse leaders' outcomes that are not what a warmup's leader broadcasts."""
    for rank in leaders:
        answer = answers[rank] if isinstance(answers, list) and rank < len(answers) else None
        if not isinstance(answer, dict) or not isinstance(answer.get("outcomes"), dict):
            raise malformed("outcomes", rank, "not an object with outcomes")
        error = answer.get("error")
        if error is not None and (
            not isinstance(error, dict) or not isinstance(error.get("message"), str)
        ):
            raise malformed("outcomes", rank, "an error without a message")
        if not all(isinstance(o, dict) for o in answer["outcomes"].values()):
            raise malformed("outcomes", rank, "an outcome that is not an object")


def run_collective(op: Callable[[], _T], what: str, leader: int) -> _T:
    """Run a collective; a peer that died or timed out becomes the same error on every rank.

    A WarmupError passes as it is: the built-in collectives raise one that every member
    of the call agreed on. Any other failure (a custom Collective's) is given a message
    that depends only on the step, so it too reads alike on every rank.
    """
    try:
        return op()
    except WarmupError:
        raise
    except Exception as exc:
        raise WarmupTimeoutError(
            f"warmup: the {what} failed (a rank or the leader, rank {leader}, died or timed out)",
            kind=type(exc).__name__,
            leader=leader,
        ) from exc
