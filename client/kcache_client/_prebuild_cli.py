"""What ``kcache prebuild`` says: its options, a line per kernel, the table, the failures, the offer.

The command itself runs in :mod:`kcache_client._job_cli` beside the other job commands
(it shares their session and manifest loading); the work is
:func:`kcache_client._prebuild.prebuild`. Here is only what is told: progress and
failures on stderr, the kernels x targets table (or ``--json``) on stdout, and, when no
target is named, the targets the fleet used with the command to run.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when the command runs: building the parser stays instant
    from kcache.job_manifest import JobManifest
    from kcache_client._prebuild import PrebuildItem, PrebuildResult

__all__ = [
    "add_prebuild_parser",
    "failure_lines",
    "offer_message",
    "progress_line",
    "summary",
]

#: How each outcome reads in the table.
_CELL = {
    "compiled": "compiled",
    "waited": "compiled",  # joined another caller's compile of the same recipe
    "hit": "cached",
    "planned": "to compile",
    "failed": "FAILED",
    "missing": "no recipe",
}


#: ``--jobs``' default and bound as its help states them (the library's own:
#: ``_prebuild.DEFAULT_JOBS`` and ``MAX_JOBS``, which check it; a test holds them equal).
_JOBS_HELP = "requests in flight, 1 to 64 (default 4)"


def add_prebuild_parser(subparsers: Any) -> argparse.ArgumentParser:
    """The ``kcache prebuild`` parser (the caller adds the server options and the function)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "prebuild",
        help="compile a manifest's kernels for other GPU targets on the server (no GPU needed)",
        description="For each kernel of the manifest, the server's recorded recipe with only "
        "its target changed is resolved with compile: true, so a new GPU generation or "
        "toolchain costs no cold compile in production. Kernels the server holds already "
        "count as cached. Without --target, lists the targets the fleet used and exits 2. "
        "Exit 1 when a kernel failed or the server holds no recipe of it.",
    )
    parser.add_argument(
        "--manifest",
        required=True,
        metavar="FILE|JOB",
        help="a manifest file (kcache manifest save), or a job id whose manifest the server recorded",
    )
    parser.add_argument(
        "--target",
        action="append",
        metavar="LIST",
        help="targets to build for, comma-separated (sm_90,sm_100; compute_XX for PTX); repeatable",
    )
    parser.add_argument(
        "--toolchain",
        metavar="ID",
        help="build with this toolchain instead of each recipe's own ('default': the server's)",
    )
    parser.add_argument("--jobs", type=int, metavar="N", help=_JOBS_HELP)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="compile nothing: say which kernels the server holds and which it would compile",
    )
    parser.add_argument(
        "-o",
        metavar="MANIFEST_OUT",
        help="write a manifest of the prebuilt kernels (for kcache bundle create)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return parser


def _span(window: str) -> str:
    """``30d`` -> ``30 days`` (the stats query's span, as a person reads it)."""
    units = {"m": "minutes", "h": "hours", "d": "days"}
    return f"{window[:-1]} {units[window[-1]]}" if window[-1:] in units else window


def progress_line(item: PrebuildItem, done: int, total: int) -> str:
    """One line on stderr as a (kernel, target) ends."""
    took = f" ({item.seconds:.2f} s)" if item.outcome in ("compiled", "waited") else ""
    return f"kcache: [{done}/{total}] {item.kernel.label} -> {item.target}: {item.outcome}{took}"


def summary(result: PrebuildResult) -> str:
    """The kernels x targets table and a line of counts."""
    from kcache_client._cache_cli_text import text_table

    by_kernel: dict[str, list[str]] = {}
    labels: dict[str, str] = {}
    for item in result.items:
        labels[item.kernel.recipe_key] = item.kernel.label
        by_kernel.setdefault(item.kernel.recipe_key, []).append(_CELL[item.outcome])
    rows = [[labels[key], *cells] for key, cells in by_kernel.items()]
    counts = result.counts
    words = [
        f"{counts['compiled'] + counts['waited']} compiled",
        f"{counts['hit']} already cached",
        f"{counts['failed']} failed",
    ]
    if counts["planned"]:
        words.insert(0, f"{counts['planned']} to compile")
    if counts["missing"]:
        words.append(f"{counts['missing']} without a recipe on the server")
    line = f"{len(result.manifest)} kernels x {len(result.targets)} targets: " + ", ".join(words)
    if result.dry_run:
        line += " (dry run: nothing compiled)"
    return text_table(["kernel", *result.targets], rows) + "\n" + line


def failure_lines(result: PrebuildResult) -> list[str]:
    """Each failure named: kernel, target, recipe key and the reason's first lines.

    A kernel the server holds no recipe of is told once, not once per target.
    """
    lines: list[str] = []
    told: set[str] = set()
    for item in result.failures:
        kernel = item.kernel
        if item.outcome == "missing":
            if kernel.recipe_key in told:
                continue
            told.add(kernel.recipe_key)
            head = f"no recipe: {kernel.label} (recipe {kernel.recipe_key})"
        else:
            key = item.recipe_key or f"from {kernel.recipe_key}"
            head = f"failed: {kernel.label} for {item.target} (recipe {key})"
        reason = item.reason.splitlines() or ["(no reason given)"]
        lines.append(f"kcache: {head}: {reason[0]}")
        lines.extend(f"kcache:     {more}" for more in reason[1:])
    return lines


def offer_message(
    manifest_arg: str,
    server_arg: str | None,
    manifest: JobManifest,
    fleet: Sequence[tuple[str, int]],
    toolchain_targets: Sequence[str],
) -> str:
    """Why ``--target`` is needed, the targets the fleet used, and the command to run."""
    from kcache_client._prebuild import FLEET_WINDOW

    own = sorted({k.target for k in manifest.kernels if k.target})
    window = _span(FLEET_WINDOW)
    lines = [
        f"prebuild needs --target: the targets to build the manifest's {len(manifest)} kernels for"
    ]
    if fleet:
        used = ", ".join(f"{target} ({count} lookups)" for target, count in fleet)
        lines.append(f"the fleet looked up these targets in the last {window}: {used}")
    else:
        lines.append(f"the server's audit names no lookup's target in the last {window}")
    if own:
        lines.append(f"the manifest's kernels are built for: {', '.join(own)}")
    if toolchain_targets:
        lines.append(f"the server compiles for: {', '.join(toolchain_targets)}")
    suggested = [target for target, _ in fleet if target not in own]
    if not suggested:  # the fleet runs only what the manifest has: offer the newest GPUs
        suggested = [t for t in toolchain_targets if t not in own][-2:]
        lines.append(
            "the fleet uses no target the manifest lacks: for a new GPU generation, name "
            "its target (the newest the server compiles for are suggested)"
        )
    command = ["kcache", "prebuild", "--manifest", manifest_arg]
    if server_arg:
        command += ["--server", server_arg]
    command += ["--target", ",".join(suggested) or "sm_XX"]
    lines.append(f"run: {shlex.join(command)}")
    return "\n".join(lines)
