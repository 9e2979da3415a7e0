"""``kcache manifest save|diff``, ``kcache prefetch``, ``kcache bundle create|unpack``, ``kcache prebuild``, ``kcache layers``.

Jobs, not kernels: a job's manifest (the kernels it was served, from the server's audit)
is saved as a file, compared with another, replayed onto a node in one request
(``prefetch``), or written as one bundle file to ship with an image and stack under
a node tier as a read-only layer (``KCACHE_CACHE_LAYERS``), or compiled on the server
for other GPU targets from a CPU machine (``prebuild``). See design.md, "Jobs".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kcache.cli_toolkit import (
    UsageError,
    add_cache_dir_argument,
    add_server_arguments,
    readable_cache_dir,
    refuse_server_dir,
    server_url,
    writing_output,
)
from kcache.dirs import cache_dir

if TYPE_CHECKING:  # imported when a command runs: `kcache --help` stays instant
    from kcache.job_manifest import JobManifest
    from kcache_client._bundle import PrefetchResult
    from kcache_client._cache import KernelCache

__all__ = ["load_manifest", "prefetch_summary", "register"]


def load_manifest(path: str, option: str) -> JobManifest:
    """The manifest file ``path``; a missing or refused file is told as ``option``'s error."""
    return _load(path, option)


def prefetch_summary(done: PrefetchResult) -> dict[str, Any]:
    """The JSON line ``kcache prefetch`` and ``kcache warmup --manifest`` print."""
    return {
        "manifest": done.manifest_digest,
        "kernels": done.kernels,
        "held": done.held,
        "fetched": done.fetched,
        "missing": list(done.missing),
        "requests": done.requests,
    }


def _load(path: str, option: str) -> JobManifest:
    from kcache.job_manifest import JobManifest, ManifestError

    try:
        return JobManifest.load(path)
    except FileNotFoundError:
        raise UsageError(f"{option} {path}: no such file") from None
    except ManifestError as exc:
        raise UsageError(f"{option}: {exc}") from None


def _open_cache(args: argparse.Namespace, url: str | None) -> KernelCache:
    from kcache_client._command_settings import command_cache

    explicit = getattr(args, "cache_dir", None)
    refuse_server_dir(cache_dir(explicit), "--cache-dir" if explicit else "$KCACHE_CACHE_DIR")
    return command_cache(args, url)


@contextmanager
def _session(args: argparse.Namespace, url: str | None) -> Iterator[KernelCache]:
    """A cache for one command; a server that fails it told as the command's error."""
    from kcache_client.errors import NO_SERVER, AuthenticationError, ServerUnavailableError

    cache = _open_cache(args, url)
    try:
        yield cache
    except AuthenticationError as exc:
        raise UsageError(f"{exc}\npass a token with --token or $KCACHE_TOKEN") from exc
    except ServerUnavailableError as exc:
        if exc.url == NO_SERVER:  # the error says what to set already
            raise UsageError(str(exc)) from exc
        raise UsageError(f"{exc}\npass --server URL or set KCACHE_URL to a running server") from exc
    finally:
        cache.close()


def _print(value: dict[str, Any]) -> None:
    print(json.dumps(value, sort_keys=True))


def _cmd_manifest_save(args: argparse.Namespace) -> int:
    url = server_url(args)
    if url is None:
        raise UsageError("a job's manifest comes from the server: pass --server or set KCACHE_URL")
    with _session(args, url) as cache:
        manifest = cache.job_manifest(args.job)
    if not manifest.kernels and not manifest.foreign:
        print(
            f"kcache: the server's audit names no kernels served to job {args.job!r} (a typo, a "
            "job past the audit's retention, or one whose lookups carried no job id)",
            file=sys.stderr,
        )
        return 1
    writing_output("-o", args.o, lambda: manifest.save(args.o))
    _print(
        {
            "job_id": manifest.job_id,
            "kernels": len(manifest),
            "foreign": len(manifest.foreign),
            "digest": manifest.digest,
            "path": args.o,
        }
    )
    return 0


def _cmd_manifest_diff(args: argparse.Namespace) -> int:
    from kcache.job_manifest import diff_manifests

    a, b = _load(args.a, "A"), _load(args.b, "B")
    diff = diff_manifests(a, b)
    if args.json:
        _print(diff.to_dict())
    else:
        for kernel in diff.added:
            print(f"+ {kernel.label}  {kernel.recipe_key}")
        for kernel in diff.removed:
            print(f"- {kernel.label}  {kernel.recipe_key}")
        for old, new in diff.changed:
            why = "artifact" if old.recipe_key == new.recipe_key else "recipe"
            print(f"~ {new.label}  {old.recipe_key[:16]} -> {new.recipe_key[:16]} ({why} changed)")
        for group in diff.foreign_added:
            print(f"+ foreign {group.label}  {group.binding_key}")
        for group in diff.foreign_removed:
            print(f"- foreign {group.label}  {group.binding_key}")
        for _, group in diff.foreign_changed:
            print(f"~ foreign {group.label}  {group.binding_key[:16]} (files changed)")
        foreign = len(diff.foreign_added) + len(diff.foreign_removed) + len(diff.foreign_changed)
        print(
            f"{len(diff.added)} added, {len(diff.removed)} removed, {len(diff.changed)} changed"
            + (f"; {foreign} foreign groups differ" if foreign else ""),
            file=sys.stderr,
        )
    return 0 if diff.same else 1


def _cmd_prefetch(args: argparse.Namespace) -> int:
    manifest = _load(args.manifest, "--manifest")
    with _session(args, server_url(args)) as cache:
        done = cache.prefetch(manifest)
    _print(prefetch_summary(done))
    return 0 if done.complete else 1


def _cmd_bundle_create(args: argparse.Namespace) -> int:
    from kcache_client._bundle import write_bundle_file

    manifest = _load(args.manifest, "--manifest")
    with _session(args, server_url(args)) as cache:
        count = writing_output("-o", args.o, lambda: write_bundle_file(cache, manifest, args.o))
    _print({"manifest": manifest.digest, "entries": count, "path": args.o})
    return 0


def _cmd_bundle_unpack(args: argparse.Namespace) -> int:
    from kcache.bundle_format import BundleError
    from kcache_client._bundle import load_bundle_file

    cache = _open_cache(args, None)
    try:
        count = load_bundle_file(
            cache.tier, args.file, cache.trust, max_entry_bytes=cache.settings.max_artifact_bytes
        )
    except BundleError as exc:
        print(f"kcache: {exc}; nothing was written", file=sys.stderr)
        return 1
    finally:
        cache.close()
    _print({"entries": count, "cache_dir": str(cache.tier.root)})
    return 0


def _cmd_layers(args: argparse.Namespace) -> int:
    explicit = getattr(args, "cache_dir", None)
    readable_cache_dir(cache_dir(explicit), "--cache-dir", bool(explicit))  # it makes none
    cache = _open_cache(args, None)
    try:
        rows = [("writable", cache.tier)] + [("read-only", layer) for layer in cache.layers]
        for kind, tier in rows:
            usage = tier.usage()
            _print(
                {
                    "layer": kind,
                    "path": str(tier.root),
                    "entries": usage.entries,
                    "bytes": usage.bytes_used,
                    "evicted": kind == "writable" and usage.marks.bounded,
                }
            )
    finally:
        cache.close()
    return 0


def _prebuild_manifest(args: argparse.Namespace, cache: KernelCache) -> JobManifest:
    """``--manifest``: a file where one is (or the text names a path), else a job id's manifest."""

    from kcache_client.errors import RemoteNotFoundError

    text = args.manifest
    if os.path.exists(text) or "/" in text or os.sep in text or text.endswith(".json"):
        return _load(text, "--manifest")
    try:
        manifest = cache.job_manifest(text)
    except RemoteNotFoundError:
        manifest = None
    if manifest is None or not manifest.kernels:
        raise UsageError(
            f"--manifest {args.manifest}: no such file, and the server's audit names no kernels "
            "of a job of that id; pass a manifest file (kcache manifest save) or a job id"
        )
    return manifest


def _cmd_prebuild(args: argparse.Namespace) -> int:
    from kcache.errors import RecipeError
    from kcache_client._prebuild import (
        DEFAULT_JOBS,
        MAX_JOBS,
        fleet_targets,
        parse_targets,
        prebuild,
    )
    from kcache_client._prebuild_cli import failure_lines, offer_message, progress_line, summary

    url = server_url(args)
    if url is None:
        raise UsageError("a prebuild compiles on the server: pass --server or set KCACHE_URL")
    if args.o and args.dry_run:
        raise UsageError("-o writes what was prebuilt, and a --dry-run prebuilds nothing: drop one")
    try:
        targets = parse_targets(args.target) if args.target is not None else None
    except RecipeError as exc:
        raise UsageError(f"--target: {exc.detail}") from None
    jobs = DEFAULT_JOBS if args.jobs is None else args.jobs
    if not 1 <= jobs <= MAX_JOBS:
        raise UsageError(f"--jobs {jobs}: requests in flight are 1 to {MAX_JOBS}")
    with _session(args, url) as cache:
        manifest = _prebuild_manifest(args, cache)
        if targets is None:
            toolchains = cache.toolchains().get("toolchains") or [{}]
            raise UsageError(
                offer_message(
                    args.manifest,
                    args.server,
                    manifest,
                    fleet_targets(cache),
                    [str(t) for t in toolchains[0].get("targets", [])],
                )
            )
        done = prebuild(
            cache,
            manifest,
            [t.text for t in targets],
            toolchain=args.toolchain,
            jobs=jobs,
            dry_run=args.dry_run,
            progress=lambda item, n, total: print(progress_line(item, n, total), file=sys.stderr),
        )
    if args.o:
        writing_output("-o", args.o, lambda: done.prebuilt().save(args.o))
    if args.json:
        _print({**done.to_dict(), "path": args.o})
    else:
        print(summary(done))
    for line in failure_lines(done):
        print(line, file=sys.stderr)
    return 0 if done.complete else 1


def _client_args(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    add_cache_dir_argument(parser)


def register(subparsers: Any) -> None:
    """Add ``kcache manifest``, ``kcache prefetch``, ``kcache bundle``, ``kcache prebuild``, ``kcache layers``."""
    manifest = subparsers.add_parser(
        "manifest", help="a job's kernels as a file: save one from the server, diff two"
    )
    actions = manifest.add_subparsers(dest="manifest_command", required=True)
    save = actions.add_parser(
        "save", help="save the manifest the server recorded for a job (GET /v1/jobs/JOB/manifest)"
    )
    save.add_argument("--job", required=True, help="the job id (KCACHE_JOB_ID of its ranks)")
    save.add_argument("-o", required=True, metavar="FILE", help="where to write it")
    _client_args(save)
    save.set_defaults(func=_cmd_manifest_save)
    diff = actions.add_parser(
        "diff", help="kernels added, removed and changed from manifest A to B (exit 1 if any)"
    )
    diff.add_argument("a", metavar="A")
    diff.add_argument("b", metavar="B")
    diff.add_argument("--json", action="store_true", help="one JSON object")
    diff.set_defaults(func=_cmd_manifest_diff)

    pre = subparsers.add_parser(
        "prefetch",
        help="fetch every kernel of a manifest this node lacks, in one request",
        description="One POST /v1/bundle for what the cache directory (and its layers) lack; "
        "nothing when it holds the manifest already. Prints what it did; exit 1 when the "
        "server lacked some of the kernels.",
    )
    pre.add_argument("--manifest", required=True, metavar="FILE")
    _client_args(pre)
    pre.set_defaults(func=_cmd_prefetch)

    bundle = subparsers.add_parser("bundle", help="a manifest's kernels as one signed file")
    bactions = bundle.add_subparsers(dest="bundle_command", required=True)
    create = bactions.add_parser("create", help="write a manifest's kernels into one .kcb file")
    create.add_argument("--manifest", required=True, metavar="FILE")
    create.add_argument("-o", required=True, metavar="FILE", help="the bundle file to write")
    _client_args(create)
    create.set_defaults(func=_cmd_bundle_create)
    unpack = bactions.add_parser(
        "unpack",
        help="check a bundle file whole, then publish it into a cache directory",
        description="Every entry's digest and signature (KCACHE_TRUSTED_KEYS, or a pinned "
        "server's key) is checked before anything is written; a refused file writes nothing. "
        "The directory can then serve as a read-only layer (KCACHE_CACHE_LAYERS).",
    )
    unpack.add_argument("file")
    add_cache_dir_argument(unpack)
    unpack.set_defaults(func=_cmd_bundle_unpack)

    from kcache_client._prebuild_cli import add_prebuild_parser

    prebuild = add_prebuild_parser(subparsers)
    _client_args(prebuild)
    prebuild.set_defaults(func=_cmd_prebuild)

    layers = subparsers.add_parser(
        "layers", help="the cache directory and the read-only layers under it (KCACHE_CACHE_LAYERS)"
    )
    add_cache_dir_argument(layers)
    layers.set_defaults(func=_cmd_layers)
