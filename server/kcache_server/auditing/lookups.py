"""Kernel lookups: what the hit rate and the compile time saved count, everywhere.

An audit event is a request: a process that reads its own warmup back from memory
makes one per ``get``, a warm fetch loop thousands. What an operator asks ("did this
job have to compile?", "what did the cache save?") is about kernels, so every figure
kcache shows (``kcache stats``, ``/v1/stats``, the dashboard, ``/metrics`` and the
Grafana panels built on it) counts **kernel lookups**, one definition:

- a *kernel lookup* is a process's first lookup of a recipe (the process: the job, rank,
  host, pid and client id its lookups carry). Its later lookups of the same recipe are
  repeats: a memory hit is always one (the process holds what it already got), and
  so is any lookup after the first, whatever answered it. A lookup that names no
  process (a fetch by key from an old client, a line of nginx's edge log) is a kernel
  lookup of its own each time;
- it is a **hit** when it needed no compile anywhere: its first lookup found the kernel
  (the server's index, ``hit``; a node tier, ``local_hit``) and no rank of its job had
  compiled it (or joined a compile of it) before: a job that compiled everything from
  cold has a hit rate of 0 whatever its other ranks then read from the node tier. A
  lookup without a job id is its own job. Everything else is a **miss**, with its
  reason (:func:`reason_text`);
- it **avoided a compile** when its process got the kernel without compiling or waiting
  for a compile (its first lookup was ``hit`` or ``local_hit``): at most once per process
  and kernel. The compile time saved is the sum of those kernels' compile times. So the
  cold job's other ranks avoided a compile each (they read rank 0's), while its hit
  rate is 0;
- the hit rate of a job, a kernel, a target, a rank or the fleet is hits / kernel
  lookups over the lookups that fall in the window (by the time of the first lookup).

The parts stay visible beside it: hits the server answered itself (``observed``) and hits
clients reported (``reported``: a node-tier hit, which the server never sees). A
client's report counts as a kernel lookup only for a digest the index knows, and at most
once per process and recipe, so a report of a million hits is one kernel lookup.
``late`` events (a frozen cache missed its tiers) are notes about a warmup's coverage,
not lookups: the fetch or compile that follows is the lookup.

:func:`record_lookups` decides each kernel lookup when its first event is written, in the
same transaction (:func:`~kcache_server.auditing.counts.write_events`), and returns the
new ones so the writer can count them in ``/metrics``; the decision is stored
(``audit_lookups``) and never revised, so ``/v1/stats`` and the counters agree. Two
replicas recording a job's compile and another rank's hit at the same moment may decide
that hit before they see the compile (a hit then); one replica never does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from kcache_server.models import (
    LOOKUP_REASON_LENGTH,
)
from kcache_server.models import artifacts_table as _artifacts
from kcache_server.models import audit_events_table as _events
from kcache_server.models import audit_job_builds_table as _builds
from kcache_server.models import audit_lookups_table as _lookups

__all__ = [
    "ERROR_REASONS",
    "LOOKUP_OUTCOMES",
    "REASONS",
    "identity_of",
    "process_of",
    "reason_text",
    "record_lookups",
]


#: Outcomes whose lookup found the kernel without a compile.
_FOUND = ("hit", "local_hit")
#: Outcomes of a compile: the job that asked needed it.
_BUILT = ("compiled", "waited")
#: The outcomes a kernel lookup can start with (``late`` and memory hits never start one).
LOOKUP_OUTCOMES = ("hit", "local_hit", "compiled", "waited", "miss", "error", "bypass")
#: Pairs per statement: 2 parameters each, well under SQLite's 32,766.
_PAIRS_PER_STATEMENT = 5000

#: Why a kernel lookup missed: the code stored, the words shown.
REASONS: dict[str, str] = {
    "first_build": "first build of this recipe",
    "evicted": "served before, then evicted or garbage-collected",
    "headers_changed": "header contents changed since an earlier build",
    "joined_compile": "joined a compile another request had started",
    "built_by_job": "another rank of this job compiled it",
    "not_cached": "not cached, and the caller did not ask to compile",
    # Not a kernel lookup's reason (a late note starts none): the last miss of a kernel.
    "late": "looked up after the warmup, outside what it covered",
}
#: A failed lookup's error code, in words (``error:<code>`` reasons).
ERROR_REASONS = {
    "compile_error": "compile error",
    "compile_timeout": "compile timed out",
    "compiler_crashed": "compiler crashed",
    "overloaded": "server overloaded",
    "lock_timeout": "timed out waiting for another compile",
    "invalid_recipe": "invalid recipe",
    "store_full": "artifact store full",
    "quota_exceeded": "token's storage quota reached",
    "set_aside": "its artifact failed a check and was set aside",
}


def reason_text(code: str | None) -> str | None:
    """The words for a kernel lookup's miss reason ``code`` (None for a hit)."""
    if code is None:
        return None
    kind, _, detail = code.partition(":")
    if kind == "error":
        return ERROR_REASONS.get(detail, (detail or "error").replace("_", " "))
    if kind == "bypass":
        return "compiled by the library outside kcache" + (f" ({detail})" if detail else "")
    if kind == "miss":  # a miss with an error code: not served for that reason
        return ERROR_REASONS.get(detail, detail.replace("_", " "))
    return REASONS.get(code, code.replace("_", " "))


def _hash(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, separators=(",", ":")).encode()).hexdigest()


def process_of(event: Mapping[str, Any]) -> str | None:
    """The process an event's lookup came from, as a hash; None when it names none."""
    who = tuple(event.get(k) for k in ("job_id", "rank", "host", "pid", "client_id"))
    return None if all(v is None for v in who) else _hash("process", *who)


def identity_of(event: Mapping[str, Any]) -> str | None:
    """What names the recipe of an event's lookup: its key, else a hash of what it has."""
    key = event.get("recipe_key")
    if key:
        return str(key)
    target = event.get("target")
    if event.get("base_key"):
        return _hash("base", event["base_key"], target)
    if event.get("kernel"):
        return _hash("kernel", event["kernel"], target)
    if event.get("outcome") == "bypass":
        return _hash("bypass", event.get("error"), target)
    return None


def _starts_lookup(event: Mapping[str, Any]) -> bool:
    """Whether the event may be a kernel lookup's first (no memory re-read, no late note)."""
    return event["outcome"] in LOOKUP_OUTCOMES and event.get("tier") != "memory"


def _insert(conn: sa.Connection, table: sa.Table) -> Any:
    return (postgresql if conn.dialect.name == "postgresql" else sqlite).insert(table)


def _chunks(items: Sequence[Any]) -> list[Sequence[Any]]:
    return [items[i : i + _PAIRS_PER_STATEMENT] for i in range(0, len(items), _PAIRS_PER_STATEMENT)]


def _existing(conn: sa.Connection, pairs: list[tuple[str, str]]) -> set[tuple[str, str]]:
    c = _lookups.c
    found: set[tuple[str, str]] = set()
    for chunk in _chunks(pairs):
        rows = conn.execute(
            sa.select(c.process, c.identity).where(sa.tuple_(c.process, c.identity).in_(chunk))
        )
        found.update((str(p), str(i)) for p, i in rows)
    return found


def _built(conn: sa.Connection, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], datetime]:
    """(job, identity) -> when the job first compiled it, for those of ``pairs`` it did."""
    c = _builds.c
    found: dict[tuple[str, str], datetime] = {}
    for chunk in _chunks(pairs):
        rows = conn.execute(
            sa.select(c.job_id, c.identity, c.at).where(sa.tuple_(c.job_id, c.identity).in_(chunk))
        )
        found.update({(str(j), str(i)): at for j, i, at in rows})
    return found


def _known_digests(conn: sa.Connection, digests: set[str]) -> set[str]:
    found: set[str] = set()
    ordered = sorted(digests)
    for i in range(0, len(ordered), _PAIRS_PER_STATEMENT):
        rows = conn.execute(
            sa.select(_artifacts.c.digest).where(
                _artifacts.c.digest.in_(ordered[i : i + _PAIRS_PER_STATEMENT])
            )
        )
        found.update(str(d) for (d,) in rows)
    return found


def _history(conn: sa.Connection, event: Mapping[str, Any]) -> str:
    """Why a compile was needed, from what the audit saw before it: evicted, headers, first."""
    ev = _events.c
    key, at = event.get("recipe_key"), event["at"]
    if key is not None:
        served = conn.execute(
            sa.select(ev.id)
            .where(
                ev.recipe_key == key,
                ev.at < at,
                ev.outcome.in_(("hit", "local_hit", "compiled")),
            )
            .limit(1)
        ).first()
        if served is not None:
            return "evicted"
    base = event.get("base_key")
    if base is not None and key is not None:
        target = event.get("target")
        sibling = conn.execute(
            sa.select(ev.id)
            .where(
                ev.base_key == base,
                ev.target.is_(None) if target is None else ev.target == target,
                ev.recipe_key != key,
                ev.at < at,
            )
            .limit(1)
        ).first()
        if sibling is not None:
            return "headers_changed"
    return "first_build"


def _miss_reason(conn: sa.Connection, event: Mapping[str, Any]) -> str:
    outcome, error = event["outcome"], event.get("error")
    if outcome == "compiled":
        reason = _history(conn, event)
    elif outcome == "waited":
        reason = "joined_compile"
    elif outcome == "miss":  # not_found: absent, and not to be compiled
        reason = f"miss:{error}" if error and error != "not_found" else "not_cached"
    elif outcome == "error":
        reason = f"error:{error or 'unknown'}"
    else:  # bypass
        reason = f"bypass:{error}" if error else "bypass:"
    return reason[:LOOKUP_REASON_LENGTH]


def _row(event: Mapping[str, Any], process: str | None, identity: str) -> dict[str, Any]:
    count = max(int(event.get("count", 1)), 1)
    saved = float(event.get("compile_seconds_saved") or 0.0)
    found = event["outcome"] in _FOUND
    return {
        "at": event["at"],
        "process": process,
        "identity": identity,
        "outcome": event["outcome"],
        "tier": event.get("tier") or "server",
        "hit": found,
        "reason": None,
        # A named process is one lookup however many its event stands for; an unnamed
        # event is as many lookups as it counts, each having avoided its compile.
        "count": 1 if process is not None else count,
        "saved": (saved / count if process is not None else saved) if found else 0.0,
        "recipe_key": event.get("recipe_key"),
        "base_key": event.get("base_key"),
        "digest": event.get("digest"),
        "kernel": event.get("kernel"),
        "target": event.get("target"),
        "client_id": event.get("client_id"),
        "job_id": event.get("job_id"),
        "rank": event.get("rank"),
        "reporter": event.get("reporter"),
    }


def record_lookups(
    conn: sa.Connection, events: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Record the kernel lookups ``events`` start, in ``conn``'s transaction; returns the new ones.

    ``events`` are ``audit_events`` rows being written (each with ``at``). A few
    statements per batch, whatever its size, plus two index probes per compile that
    starts a lookup (why it was needed).
    """
    ordered = sorted(
        (e for e in events if _starts_lookup(e)), key=lambda e: e["at"]
    )  # stable: a batch's order within one time
    builds: dict[tuple[str, str], datetime] = {}
    for e in events:
        if e.get("job_id") is not None and e["outcome"] in _BUILT:
            identity = identity_of(e)
            if identity is not None:
                pair = (str(e["job_id"]), identity)
                builds[pair] = min(builds.get(pair, e["at"]), e["at"])
    if builds:
        stmt = _insert(conn, _builds)
        conn.execute(
            stmt.on_conflict_do_update(
                index_elements=["job_id", "identity"],
                set_={
                    "at": sa.case(
                        (stmt.excluded.at < _builds.c.at, stmt.excluded.at), else_=_builds.c.at
                    )
                },
            ),
            [{"job_id": j, "identity": i, "at": at} for (j, i), at in sorted(builds.items())],
        )
    client_digests = {
        str(e["digest"]) for e in ordered if e.get("tier") != "server" and e.get("digest")
    }
    known = _known_digests(conn, client_digests) if client_digests else set()
    firsts: dict[tuple[str, str], Mapping[str, Any]] = {}
    unnamed: list[tuple[Mapping[str, Any], str]] = []
    for e in ordered:
        identity = identity_of(e)
        if identity is None:
            continue
        if e["outcome"] == "local_hit" and str(e.get("digest")) not in known:
            continue  # a report of bytes this fleet never served: the client's word alone
        process = process_of(e)
        if process is None:
            unnamed.append((e, identity))
        else:
            firsts.setdefault((process, identity), e)
    seen = _existing(conn, sorted(firsts)) if firsts else set()
    fresh = [(pair, e) for pair, e in firsts.items() if pair not in seen]
    jobs = sorted({(str(e["job_id"]), pair[1]) for pair, e in fresh if e.get("job_id") is not None})
    built = _built(conn, jobs) if jobs else {}
    rows = []
    for (process, identity), e in fresh:
        rows.append(_decided(conn, _row(e, process, identity), e, built))
    for e, identity in unnamed:
        rows.append(_decided(conn, _row(e, None, identity), e, built))
    if not rows:
        return []
    stmt = _insert(conn, _lookups)
    new = conn.execute(
        stmt.on_conflict_do_nothing(index_elements=["process", "identity"]).returning(
            _lookups.c.process, _lookups.c.identity, _lookups.c.at
        ),
        rows,
    ).all()
    # Another writer may have recorded some of them meanwhile: only those inserted here.
    inserted = {(p, i, at) for p, i, at in new}
    return [r for r in rows if (r["process"], r["identity"], r["at"]) in inserted]


def _decided(
    conn: sa.Connection,
    row: dict[str, Any],
    event: Mapping[str, Any],
    built: Mapping[tuple[str, str], datetime],
) -> dict[str, Any]:
    """``row`` with its hit and reason decided."""
    if row["hit"]:
        job = event.get("job_id")
        when = built.get((str(job), row["identity"])) if job is not None else None
        if when is not None and when <= event["at"]:
            row["hit"], row["reason"] = False, "built_by_job"
    else:
        row["reason"] = _miss_reason(conn, event)
    return row
