"""``divergence`` of ``/v1/stats``: ranks of one job that got different digests for one recipe.

Starts from the few recipes ``audit_divergences`` lists (one job ever got two digests
for them) and confirms each against the raw events by ``LIMIT 1`` index probes,
digest by digest and rank by rank (:func:`read_divergence`), so its cost follows the
number of such recipes, not of events. What the server observed and what clients
reported make separate rows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from kcache_server.auditing.counts import decode, encode
from kcache_server.auditing.events import CLIENT_TIERS
from kcache_server.auditing.stats_models import SERVER_TIER, Divergence, StatsQuery
from kcache_server.auditing.window_source import Present, filters, keyed
from kcache_server.auditing.windows import DAY
from kcache_server.models import audit_counts_table as _counts_t
from kcache_server.models import audit_digests_table as _digests
from kcache_server.models import audit_divergences_table as _divergences
from kcache_server.models import audit_events_table as _events

__all__ = ["read_divergence"]


def _same(column: Any, encoded: Any, as_int: bool = False) -> list[sa.ColumnElement[bool]]:
    """``column`` equals the :func:`encode` d value ``encoded``, as two index-friendly forms.

    One form compares by ``=`` (no match for an encoded NULL), the other matches
    ``IS NULL`` gated on the encoded NULL: an ``OR`` of both, or ``IS NOT DISTINCT
    FROM``, would cost PostgreSQL the index. Callers probe once per form.
    """
    return [column == decode(encoded, as_int), sa.and_(column.is_(None), encoded == "")]


def _probe(
    pick: Any, conds: list[list[sa.ColumnElement[bool]]], order: Any
) -> sa.ColumnElement[Any]:
    """The first ``pick`` of ``audit_events`` by ``order`` under every combination of ``conds``.

    Each inner list holds alternative conditions (see :func:`_same`); every
    combination is its own ``LIMIT 1`` index probe, and the answer is the first
    non-NULL one (the alternatives exclude each other, so at most one finds a row).
    """
    combos: list[list[sa.ColumnElement[bool]]] = [[]]
    for alternatives in conds:
        combos = [[*c, a] for c in combos for a in alternatives]
    probes = [
        sa.select(pick).where(*combo).order_by(*order).limit(1).scalar_subquery()
        for combo in combos
    ]
    return sa.func.coalesce(*probes)


Recipe = tuple[str, str, str]  # job id, base key, encoded target


def read_divergence(conn: sa.Connection, query: StatsQuery, present: Present) -> list[Divergence]:
    """Recipes (base key and target) that ranks of one job got different digests for.

    What the server observed and what clients reported are never merged into one row:
    a recipe the server itself saw two digests of is a row built from the server's
    events alone (``reported`` false); digests only client reports name make a row of
    their own (``reported`` true, with every event's word and the reporters named).
    One recipe can have both.

    A bounded number of statements, whatever the number of events, each a bounded set
    of index probes:

    1. Every digest ``audit_digests`` lists for a recipe of ``audit_divergences``
       (the recipes one job ever got two digests for) whose first and last
       sighting overlaps the window, with two ``EXISTS`` probes on
       ``(job_id, base_key, target, digest, tier, at)``: seen in the window by the
       server, by a client.
    2. For each row's recipe (at most ``limit``) and each rank its job has counts
       for: the rank's last digest and its first event naming the kernel, each a
       ``LIMIT 1`` probe on ``(job_id, base_key, target, rank, at, id)`` (the server's
       events only, for a server row); once for server rows, once for reported ones.
    3. For reported rows: who reported the digests the server did not see, from the
       client events of those recipes (on the same index's prefix).

    The answer is what grouping the raw events would give; a query filtered by
    client or kernel applies its filter inside the probes, which then may read
    more index entries (filtered queries read raw events anyway).
    """
    ev, dg, dv = _events.c, _digests.c, _divergences.c
    narrow = [dg.first_at < query.until] if query.until is not None else []
    if query.since is not None:
        narrow.append(dg.last_at >= query.since)
    if query.job_id is not None:
        narrow.append(dv.job_id == query.job_id)
    if query.target is not None:
        narrow.append(dv.target == encode(query.target))
    scope = [*filters(query, ev, ev.at), ev.job_id == dv.job_id, ev.base_key == dv.base_key]

    def seen(tiers: tuple[str, ...]) -> sa.ColumnElement[Any]:
        found = [
            sa.exists().where(*scope, ev.digest == dg.digest, ev.tier.in_(tiers), target)
            for target in _same(ev.target, dv.target)
        ]
        return sa.case((sa.or_(*found), 1), else_=0)

    rows = conn.execute(
        sa.select(
            dv.job_id,
            dv.base_key,
            dv.target,
            dg.digest,
            seen((SERVER_TIER,)).label("server"),
            seen(CLIENT_TIERS).label("client"),
        )
        .select_from(
            _divergences.join(
                _digests,
                sa.and_(dg.job_id == dv.job_id, dg.base_key == dv.base_key, dg.target == dv.target),
            )
        )
        .where(*narrow)
    ).all()
    by_server: dict[Recipe, set[str]] = defaultdict(set)
    by_clients: dict[Recipe, set[str]] = defaultdict(set)
    for row in rows:
        recipe = (row.job_id, row.base_key, row.target)
        if row.server:
            by_server[recipe].add(row.digest)
        if row.client:
            by_clients[recipe].add(row.digest)
    wanted: list[tuple[Recipe, bool]] = []
    for recipe in sorted({*by_server, *by_clients}):
        server, hearsay = by_server[recipe], by_clients[recipe] - by_server[recipe]
        if len(server) > 1:
            wanted.append((recipe, False))
        if hearsay and len(server | hearsay) > 1:
            wanted.append((recipe, True))
    wanted = wanted[: query.limit]
    if not wanted:
        return []
    observed = [r for r, reported in wanted if not reported]
    claimed = [r for r, reported in wanted if reported]
    probed = {
        False: _rank_digests(conn, query, present, observed, server_only=True),
        True: _rank_digests(conn, query, present, claimed, server_only=False),
    }
    reporters = _reporters(conn, query, {r: by_clients[r] - by_server[r] for r in claimed})
    out = []
    for recipe, reported in wanted:
        ranks, kernel = probed[reported].get(recipe, ({}, None))
        digests = by_server[recipe] | (by_clients[recipe] if reported else set())
        out.append(
            Divergence(
                job_id=recipe[0],
                base_key=recipe[1],
                target=None if recipe[2] == "" else recipe[2][1:],
                kernel=kernel,
                digests=sorted(digests),
                ranks=dict(
                    sorted(
                        ranks.items(),
                        key=lambda kv: (not kv[0].isdigit(), int(kv[0]) if kv[0].isdigit() else 0),
                    )
                ),
                reported=reported,
                reported_by=reporters.get(recipe, []) if reported else [],
            )
        )
    return out


def _rank_digests(
    conn: sa.Connection,
    query: StatsQuery,
    present: Present,
    recipes: list[Recipe],
    *,
    server_only: bool,
) -> dict[Recipe, tuple[dict[str, str], str | None]]:
    """Each recipe's last digest per rank and the first kernel named, from one statement of probes.

    ``server_only``: from the server's own events (a server row holds nothing of the
    clients' word); else from every event.
    """
    if not recipes:
        return {}
    ev, dv = _events.c, _divergences.c
    scope = [*filters(query, ev, ev.at), ev.job_id == dv.job_id, ev.base_key == dv.base_key]
    if server_only:
        scope.append(ev.tier == SERVER_TIER)
    # The ranks each job has counts for (a superset of those that got these recipes).
    c = _counts_t.c
    ranks = (
        sa.select(c.key.label("job_key"), c.key2.label("rank_key"))
        .where(
            c.dim == "job_rank",
            c.level == DAY,
            keyed(
                c, DAY, (None, None), present[("job_rank", DAY)], sorted({r[0] for r in recipes})
            ),
        )
        .distinct()
        .subquery("ranks")
    )
    per_rank = [*scope, ev.digest.is_not(None)]
    conds = [_same(ev.target, dv.target), _same(ev.rank, ranks.c.rank_key, as_int=True)]
    last = _probe(
        ev.id,
        [[sa.and_(*per_rank, t) for t in conds[0]], conds[1]],
        (ev.at.desc(), ev.id.desc()),
    )
    named = sa.func.coalesce(ev.kernel, "") != ""
    first_named = _probe(
        ev.id, [[sa.and_(*per_rank, named, t) for t in conds[0]], conds[1]], (ev.at, ev.id)
    )
    pairs = (
        sa.select(
            dv.job_id,
            dv.base_key,
            dv.target,
            ranks.c.rank_key,
            last.label("last_id"),
            first_named.label("named_id"),
        )
        .select_from(_divergences.join(ranks, ranks.c.job_key == sa.literal("=") + dv.job_id))
        .where(sa.tuple_(dv.job_id, dv.base_key, dv.target).in_(recipes))
        .subquery("pairs")
    )
    last_ev, named_ev = sa.alias(_events, "last_ev"), sa.alias(_events, "named_ev")
    result: dict[Recipe, tuple[dict[str, str], str | None]] = {}
    first: dict[Recipe, tuple[datetime, int]] = {}
    for probed in conn.execute(
        sa.select(
            pairs.c.job_id,
            pairs.c.base_key,
            pairs.c.target,
            last_ev.c.rank,
            last_ev.c.digest,
            named_ev.c.at,
            named_ev.c.id,
            named_ev.c.kernel,
        ).select_from(
            pairs.outerjoin(last_ev, last_ev.c.id == pairs.c.last_id).outerjoin(
                named_ev, named_ev.c.id == pairs.c.named_id
            )
        )
    ):
        recipe = (probed.job_id, probed.base_key, probed.target)
        ranks_of, kernel = result.get(recipe, ({}, None))
        if probed.digest is not None:
            ranks_of["-" if probed.rank is None else str(probed.rank)] = probed.digest
        if probed.kernel is not None and (
            recipe not in first or (probed.at, probed.id) < first[recipe]
        ):
            first[recipe] = (probed.at, probed.id)
            kernel = probed.kernel
        result[recipe] = (ranks_of, kernel)
    return result


def _reporters(
    conn: sa.Connection, query: StatsQuery, unseen: Mapping[Recipe, set[str]]
) -> dict[Recipe, list[str]]:
    """Who reported, in the window, the digests ``unseen`` by the server, per recipe (one statement).

    Reads the client events of those recipes on the prefix of ``(job_id, base_key,
    target, digest, tier, at)``; events reported before 0013 name no reporter.
    """
    if not unseen:
        return {}
    ev = _events.c
    rows = conn.execute(
        sa.select(ev.job_id, ev.base_key, ev.target, ev.digest, ev.reporter)
        .where(
            *filters(query, ev, ev.at),
            sa.tuple_(ev.job_id, ev.base_key).in_(sorted({(r[0], r[1]) for r in unseen})),
            ev.tier.in_(CLIENT_TIERS),
            ev.reporter.is_not(None),
        )
        .distinct()
    ).all()
    found: dict[Recipe, set[str]] = defaultdict(set)
    for row in rows:
        recipe = (row.job_id, row.base_key, encode(row.target))
        if row.digest in unseen.get(recipe, ()):
            found[recipe].add(row.reporter)
    return {recipe: sorted(names) for recipe, names in found.items()}
