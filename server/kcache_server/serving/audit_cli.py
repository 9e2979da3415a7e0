"""``kcache stats``: the ``/v1/stats`` summary as tables in a terminal.

With ``--server`` (or ``$KCACHE_URL``) it asks a running server; otherwise it reads
the database named by ``--db-url``/``--data-dir`` (or the ``KCACHE_*`` environment)
directly, so an operator can look without a server. It only reads: a database that
does not exist is reported, never created. ``--json`` prints the raw answer
(JSON escapes control characters itself).

Every string the tables show came from some client (kernel names, job ids, error
reasons); control characters and ANSI escapes among them are printed escaped
(``\x1b``), never sent raw to the terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from kcache.outcomes import OUTCOMES
from kcache_server.terminal import printable

__all__ = ["format_stats", "register"]


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{rate * 100:.1f}%"


def _secs(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], numeric: set[int] | None = None
) -> str:
    """A plain-text table whose columns fit their widest cell."""
    numeric = numeric or set()
    cells = [[printable(str(c)) for c in headers]] + [
        [("-" if c is None else printable(str(c))) for c in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def _clip(text: str | None, width: int) -> str:
    text = text or "-"
    return text if len(text) <= width else text[: width - 1] + "…"


def _store_lines(store: dict[str, Any] | None) -> list[str]:
    """The store's size against its cap, pins, and the window's evictions (none for an old server)."""
    if not store:
        return []
    from kcache.eviction import format_size

    cap = store.get("bytes_cap")
    used = int(store["bytes_used"])
    share = f" ({used / cap * 100:.1f}%)" if cap else ""
    return [
        f"store         {format_size(used)} of {format_size(cap) if cap else 'no cap'}{share}, "
        f"{store['artifacts']} artifacts, {store['pinned_artifacts']} pinned "
        f"({format_size(store['pinned_bytes'])})",
        f"evicted       {store['evictions']} artifacts, {format_size(store['bytes_freed'])} freed "
        "in the window",
    ]


def _headline_lines(stats: dict[str, Any]) -> list[str]:
    """The one hit rate over kernel lookups, its parts, the misses by reason, what was saved."""
    if "kernel_lookups" not in stats:  # a server from before kernel lookups
        return [f"hit rate      {_pct(stats.get('hit_rate'))}  (this server counts requests)"]
    hits, lookups = stats["kernel_hits"], stats["kernel_lookups"]
    lines = [
        f"hit rate      {_pct(stats['hit_rate'])}  ({hits} of {lookups} kernel lookups needed no "
        f"compile anywhere: {stats['observed_hits']} answered by the server, "
        f"{stats['reported_hits']} reported by clients)",
    ]
    reasons = stats.get("miss_reasons") or []
    if reasons:
        said = ", ".join(f"{r['kernel_lookups']} {r['text']}" for r in reasons)
        lines.append(f"misses        {stats['kernel_misses']}: {said}")
    else:
        lines.append(f"misses        {stats['kernel_misses']}")
    reported_saved = stats.get("reported_compile_seconds_saved", 0.0)
    lines.append(
        f"compile saved {_secs(stats['compile_seconds_saved'])}  ({stats['compiles_avoided']} "
        f"compiles avoided, at most one per process and kernel; {_secs(reported_saved)} of it "
        "reported by clients)"
    )
    return lines


def _requests_lines(stats: dict[str, Any]) -> list[str]:
    """Every lookup, repeats included, and who reported the clients' part."""
    observed = sum(stats["totals"].values())
    reported = sum(stats.get("reported", {}).values())
    lines = [
        f"requests      {stats['lookups']}  ({observed} seen by the server, {reported} reported by "
        "clients; repeats included: a process reading back what it got counts each time)"
    ]
    reporters = [
        f"{r['reporter'] or 'unattributed'} {r['lookups']}" for r in stats.get("reported_by", [])
    ]
    if reporters:
        lines.append(f"reported by   {', '.join(reporters)}")
    return lines


def _ranks(ranks: list[dict[str, Any]]) -> str:
    """Each rank with its hit rate: what that rank got (``0:100% 1:0%``)."""
    return " ".join(
        f"{'?' if r['rank'] is None else r['rank']}:{_pct(r.get('hit_rate'))}" for r in ranks
    )


def _nameless(stats: dict[str, Any]) -> str:
    return "(no job id)" if stats.get("group_by") == "job" else "(none)"


def format_stats(stats: dict[str, Any], width: int = 100) -> str:
    """The summary a person reads: headline numbers, tiers, groups, missed kernels, divergence."""
    since = stats.get("since")
    until = stats.get("until")
    window = " .. ".join(
        datetime.fromtimestamp(t).astimezone().isoformat(sep=" ", timespec="seconds")
        if t
        else open_end
        for t, open_end in ((since, "the first record kept"), (until, "now"))
    )
    observed: dict[str, int] = stats["totals"]
    reported: dict[str, int] = stats.get("reported", {})
    every = {o: observed.get(o, 0) + reported.get(o, 0) for o in OUTCOMES}
    parts = [
        f"window        {window}",
        *_headline_lines(stats),
        *_requests_lines(stats),
        *_store_lines(stats.get("store")),
        "",
        "requests by tier",
        _table(
            ["tier", *OUTCOMES, "total"],
            [
                [tier, *(counts.get(o, 0) for o in OUTCOMES), sum(counts.values())]
                for tier, counts in sorted(stats["by_tier"].items())
            ]
            + [["all", *(every[o] for o in OUTCOMES), stats["lookups"]]],
            numeric=set(range(1, len(OUTCOMES) + 2)),
        ),
    ]
    if stats.get("groups"):
        parts += [
            "",
            f"by {stats['group_by']}",
            _table(
                [
                    str(stats["group_by"]),
                    "kernel lookups",
                    "hits",
                    "misses",
                    "hit rate",
                    "saved",
                    "requests",
                    "ranks",
                ],
                [
                    [
                        # Lookups that named no job (or client, ...): said so, not "None".
                        _clip(
                            str(g["key"]) if g["key"] is not None else _nameless(stats), width // 3
                        )
                        + (" DIVERGED" if g.get("divergent") else ""),
                        g.get("kernel_lookups", 0),
                        g.get("kernel_hits", 0),
                        g.get("kernel_misses", 0),
                        _pct(g["hit_rate"]),
                        _secs(g["compile_seconds_saved"]),
                        g["total"],
                        _ranks(g["ranks"]) if g.get("ranks") else "",
                    ]
                    for g in stats["groups"]
                ],
                numeric={1, 2, 3, 4, 5, 6},
            ),
        ]
    if stats.get("top_missed"):
        parts += [
            "",
            "top missed kernels",
            _table(
                ["kernel", "missed kernel lookups", "errors", "last miss reason"],
                [
                    [
                        _clip(m["kernel"], width // 3),
                        m["misses"],
                        m["errors"],
                        _clip(m["last_miss_reason"], width // 2),
                    ]
                    for m in stats["top_missed"]
                ],
                numeric={1, 2},
            ),
        ]
    if stats.get("divergence"):
        parts += [
            "",
            "DIVERGENCE: ranks of one job resolved the same recipe to different digests",
            _table(
                ["job", "kernel", "target", "ranks -> digest"],
                [
                    [
                        d["job_id"]
                        + (
                            f" (reported by {', '.join(d.get('reported_by') or ['clients'])})"
                            if d.get("reported")
                            else ""
                        ),
                        _clip(d["kernel"], width // 4),
                        d["target"],
                        " ".join(f"{r}:{digest[:12]}" for r, digest in d["ranks"].items()),
                    ]
                    for d in stats["divergence"]
                ],
            ),
        ]
    return "\n".join(parts)


def _params(args: argparse.Namespace) -> dict[str, str]:
    names = ("since", "until", "job_id", "client_id", "kernel", "target", "group_by", "top")
    return {n: str(getattr(args, n)) for n in names if getattr(args, n) is not None}


def _remote(url: str, token: str | None, params: dict[str, str]) -> dict[str, Any]:
    from kcache.errors import KCacheError

    request = urllib.request.Request(
        url.rstrip("/") + "/v1/stats?" + urllib.parse.urlencode(params),
        headers={
            "Accept": "application/json",
            **({"Authorization": f"Bearer {token}"} if token else {}),
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            data: dict[str, Any] = json.load(response)
            return data
    except urllib.error.HTTPError as exc:
        try:
            detail = json.load(exc).get("detail", exc.reason)
        except ValueError:
            detail = exc.reason
        hint = (
            "\npass a token with --token or $KCACHE_TOKEN (the stats need the read scope)"
            if exc.code in (401, 403)
            else ""
        )
        raise KCacheError(f"{url} answered {exc.code}: {printable(str(detail))}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        # Chained to the socket's own error, which says what kind of failure it was: a
        # server out of reach exits 1 like every other command's (kcache.cli).
        raise KCacheError(
            f"server unreachable at {url} ({reason})\nstart it, check --server / $KCACHE_URL, "
            "or read a server's database directly with --data-dir DIR or --db-url URL"
        ) from (reason if isinstance(reason, BaseException) else exc)


#: (query parameter, group_by value, option) of each filter ``kcache stats`` takes.
_FILTERS = (
    ("job_id", "job", "--job"),
    ("kernel", "kernel", "--kernel"),
    ("client_id", "client", "--client"),
    ("target", "target", "--target"),
)


def _unknown_filter(
    stats: dict[str, Any],
    params: dict[str, str],
    fetch: Any,
) -> str | None:
    """What to say when a filter matched no lookup at all (a typo, another window), else None.

    The answer of a filter nothing matched is all zeros, which reads like a job that ran
    and looked nothing up; instead it names the filter and what the window does hold.
    """
    if stats.get("lookups") or stats.get("kernel_lookups"):
        return None
    for name, group, option in _FILTERS:
        value = params.get(name)
        if value is None:
            continue
        others = {k: v for k, v in params.items() if k != name and k not in ("group_by", "top")}
        seen = fetch({**others, "group_by": group, "top": "1", "limit": "10"})
        keys = [str(g["key"]) for g in seen.get("groups", []) if g.get("key") is not None]
        window = f"since {params.get('since', 'the start')}" + (
            f" until {params['until']}" if params.get("until") else ""
        )
        held = (
            f"{group}s with lookups in it: {', '.join(printable(k) for k in keys)}"
            if keys
            else f"no {group} has lookups in it"
        )
        return (
            f"kcache stats: no lookups of {group} {printable(value)!r} in this window ({window}): "
            f"check {option}, or widen --since; {held} (kcache stats --group-by {group})"
        )
    return None


def _local(args: argparse.Namespace, params: dict[str, str]) -> dict[str, Any]:
    from kcache_server import migrate
    from kcache_server.auditing.query_times import parse_window
    from kcache_server.auditing.stats import compute_stats
    from kcache_server.auditing.stats_models import StatsQuery
    from kcache_server.db import open_database
    from kcache_server.serving._cli_support import load_settings, require_database

    settings = load_settings(args)
    require_database(settings, args, "kcache stats")
    engine = open_database(settings.database_url)
    try:
        migrate.check_schema(engine, settings.database_url)
        since, until = parse_window(
            params.get("since"), params.get("until"), ("--since", "--until")
        )
        query = StatsQuery(
            since=since,
            until=until,
            job_id=params.get("job_id"),
            client_id=params.get("client_id"),
            kernel=params.get("kernel"),
            target=params.get("target"),
            group_by=params.get("group_by"),  # type: ignore[arg-type]
            top=int(params.get("top", args.top)),
            limit=int(params.get("limit", 200)),
        )
        return compute_stats(engine, query, settings.max_store_bytes).model_dump()
    finally:
        engine.dispose()


def _cmd_stats(args: argparse.Namespace) -> int:
    from kcache.cli_toolkit import server_url

    if getattr(args, "cache_dir", None):  # a client's node tier: the client's `cache info`
        from kcache.cli_toolkit import run_command

        return run_command(
            ["cache", "info", "--cache-dir", args.cache_dir, *(["--json"] if args.json else [])],
            needs="the client (pip install ./client: kcache-client), whose cache directory it is",
        )
    params = _params(args)
    # --data-dir / --db-url read a database directly; otherwise a configured server answers.
    url = None if (args.data_dir or args.db_url) else server_url(args)
    token = args.token or os.environ.get("KCACHE_TOKEN")

    def fetch(asked: dict[str, str]) -> dict[str, Any]:
        return _remote(url, token, asked) if url else _local(args, asked)

    stats = fetch(params)
    unknown = _unknown_filter(stats, params, fetch)
    if unknown is not None:
        print(unknown, file=sys.stderr)
        return 1
    if args.json:
        json.dump(stats, sys.stdout, indent=2)
        print()
    else:
        print(format_stats(stats, shutil.get_terminal_size((100, 20)).columns))
    return 0


def register(subparsers: Any) -> None:
    """Add ``kcache stats`` (entry point of the ``kcache.commands`` group)."""
    p = subparsers.add_parser(
        "stats",
        help="hit rate, outcomes, missed kernels and rank divergence",
        description="What a kcache server saw in a window (default the last 24 hours): the hit "
        "rate over kernel lookups (its parts: answered by the server, reported by clients), "
        "misses by reason, compile time saved, requests by tier, a table by job (or what "
        "--group-by names), the most missed kernels and jobs whose ranks got different "
        "artifacts. Asks a server (--server, default $KCACHE_URL; a read token), or reads a "
        "server's database (--data-dir, --db-url); --cache-dir shows a client cache "
        "directory's own numbers. --job, --client, --kernel and --target narrow it; one that "
        "matches nothing says so, naming what the window holds.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--server", help="ask this kcache server (default $KCACHE_URL)")
    where.add_argument("--data-dir", help="read this server data directory's database instead")
    where.add_argument("--db-url", help="read this database instead")
    where.add_argument(
        "--cache-dir",
        help="show this client cache directory's own numbers instead (no server: `kcache cache info`)",
    )
    p.add_argument("--token", help="bearer token for --server (default $KCACHE_TOKEN)")
    p.add_argument(
        "--since", default="24h", help="unix seconds, ISO 8601 or a span: 15m, 6h, 7d (default 24h)"
    )
    p.add_argument("--until", help="window end (default now)")
    p.add_argument("--job", dest="job_id", help="only this job id")
    p.add_argument("--client", dest="client_id", help="only this client id")
    p.add_argument("--kernel", help="only this kernel")
    p.add_argument("--target", help="only this target, e.g. sm_90")
    p.add_argument(
        "--group-by",
        choices=["kernel", "target", "client", "job", "rank"],
        default="job",
        help="one row per job (default), kernel, target, client id or rank, with its kernel "
        "lookups, hits, misses, hit rate, time saved, requests and ranks",
    )
    p.add_argument("--top", type=int, default=10, help="how many missed kernels to list")
    p.add_argument("--json", action="store_true", help="print the /v1/stats JSON")
    p.set_defaults(func=_cmd_stats)

    from kcache_server.serving._cli_support import guard_commands

    guard_commands([p])
