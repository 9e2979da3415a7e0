"""The words for how a lookup ended, the same in responses, events, stats, the CLI and the dashboard.

- ``hit``: the server's index had it;
- ``local_hit``: the client's memory or node-local tier had it (only clients see these,
  and report them with ``POST /v1/events``);
- ``compiled``: it was absent and this request compiled it;
- ``waited``: it was absent and this request joined another's compile;
- ``miss``: it was absent and not compiled (``"compile": false``);
- ``error``: the compile failed, now or in a remembered failure;
- ``bypass``: an adapter (CuPy, cuda.core) handed a compile kcache cannot key safely
  (``backend="nvcc"``, PTX input, a PCH option, ...) to the library itself, uncached;
  clients report these too, with the reason in the event's ``reason``;
- ``late``: a frozen client (``KernelCache.freeze``, after its warmup) missed its memory
  and node tier: a kernel its warmup did not cover. Only clients see these. In mode
  ``error`` it is the lookup's only record (refused before any request); in mode
  ``warn`` the fetch or compile that follows is recorded by the server too, beside it.

``hit_rate`` is (``hit`` + ``local_hit``) / all lookups. Every list of outcomes is
derived from :data:`Outcome` here, so adding one is a change in one place.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "CLIENT_OUTCOMES",
    "HIT_OUTCOMES",
    "MISS_OUTCOMES",
    "OUTCOMES",
    "SERVED_OUTCOMES",
    "SERVER_OUTCOMES",
    "ClientOutcome",
    "Outcome",
    "ResolveStatus",
    "parse_outcome",
]

#: Every outcome of a lookup.
Outcome = Literal["hit", "local_hit", "compiled", "waited", "miss", "error", "bypass", "late"]
#: The outcomes of a resolve that produced an artifact (the ``status`` of a resolve answer).
ResolveStatus = Literal["hit", "compiled", "waited"]
#: What a client observes on its own (its memory and node tier); the server records the rest.
ClientOutcome = Literal["local_hit", "bypass", "late"]

#: Every outcome, in the order they are shown.
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)
#: Outcomes only clients report.
CLIENT_OUTCOMES: tuple[ClientOutcome, ...] = get_args(ClientOutcome)
#: Outcomes the server observes itself.
SERVER_OUTCOMES: tuple[Outcome, ...] = tuple(o for o in OUTCOMES if o not in CLIENT_OUTCOMES)
#: Lookups the cache answered.
HIT_OUTCOMES: frozenset[Outcome] = frozenset({"hit", "local_hit"})
#: Lookups it did not: compiled (or joined a compile), absent, or failed.
MISS_OUTCOMES: frozenset[Outcome] = frozenset(OUTCOMES) - HIT_OUTCOMES
#: Lookups that ended with a kcache artifact (found, compiled or joined): not ``miss``,
#: ``error`` or ``bypass`` (the library compiled that one, and kcache kept nothing), nor
#: ``late`` (a late lookup that went on is recorded again with what served it).
SERVED_OUTCOMES: frozenset[Outcome] = frozenset(OUTCOMES) - {"miss", "error", "bypass", "late"}


def parse_outcome(value: object, field: str = "outcome") -> Outcome:
    """``value`` as an :data:`Outcome` (say, a status another process sent), else ValueError naming ``field``."""
    for outcome in OUTCOMES:
        if value == outcome:
            return outcome
    raise ValueError(f"{field} must be one of {', '.join(OUTCOMES)}; got {str(value)[:80]!r}")
