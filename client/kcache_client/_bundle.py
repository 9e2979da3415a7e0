"""Bundles on the client: a manifest's artifacts in one request per node, as files, as layers.

- :func:`prefetch` (``KernelCache.prefetch``, ``warmup(manifest=...)``, ``kcache
  prefetch``): every artifact of a manifest the node's tiers lack, in one ``POST
  /v1/bundle`` whose answer is streamed into one pack of the node tier
  (:mod:`~kcache_client._packs`) as it arrives, each entry's framing, size and digest
  checked by :class:`~kcache.bundle_format.BundleReader`, the pack put in place once the
  server's signature over all entries verifies by a trusted key, as every answer must
  (:meth:`~kcache_client._remote.Remote.check_bundle`; each entry's own,
  :meth:`~kcache_client._remote.Remote.check_entry`, from a server without one). The
  processes of a node take the manifest's lock (its digest, the tier's per-key lock), so
  one of them asks; the others wake on its completeness marker. A tier whose marker
  names the manifest and still holds each entry makes no request.
- :func:`write_bundle_file` (``kcache bundle create``): one ``.kcb`` file of a manifest's
  artifacts, in the same format, from the tiers (prefetched first).
- :func:`load_bundle_file` and :func:`open_layers`: bundle files into a tier, and the
  read-only layers under a cache's writable node tier (:mod:`~kcache_client._bundle_layers`).

A version 2 manifest's foreign groups travel in the same one request, in a section of
the answer before its kernels (:mod:`~kcache_client._foreign_bundle`), and its marker
names them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kcache.artifact import ArtifactMeta
from kcache.bundle_format import (
    BundleEntry,
    BundleMissing,
    BundleReader,
    end_line,
    entry_head,
    header_line,
)
from kcache.errors import KCacheError
from kcache.job_manifest import JobManifest, ManifestForeign
from kcache.signing import BundleDigest, Signature
from kcache_client import _foreign_bundle as foreign
from kcache_client._bundle_layers import load_bundle_file, open_layers
from kcache_client._foreign_bundle import ForeignPart
from kcache_client._packs import PackWriter
from kcache_client._remote import Remote
from kcache_client._settings import ClientSettings
from kcache_client._stats import CacheStats
from kcache_client._tier import NodeTier
from kcache_client.errors import ResponseRefusedError

__all__ = [
    "BundleCache",
    "PrefetchResult",
    "Received",
    "fetch_teed",
    "load_bundle_file",
    "marked_complete",
    "open_layers",
    "prefetch",
    "publish_received",
    "write_bundle_file",
]


class BundleCache(Protocol):
    """What bundles need of a ``KernelCache``."""

    tier: NodeTier
    layers: list[NodeTier]
    stats: CacheStats
    settings: ClientSettings

    def _require_server(self) -> Remote:
        """The server, or ServerUnavailableError without one."""
        ...

    def context(self) -> dict[str, Any]:
        """Who is asking, for the server's audit."""
        ...

    def check_withdrawals(self) -> None:
        """Read the server's withdrawals now (kcache_client._withdrawals); never raises for it."""
        ...


@dataclass(frozen=True)
class PrefetchResult:
    """What a prefetch did: ``requests`` is 0 (the tiers held the manifest) or 1. ``kernels``,
    ``held`` and ``fetched`` count the manifest's foreign groups with its kernels."""

    manifest_digest: str
    kernels: int
    held: int
    fetched: int
    missing: tuple[str, ...]
    requests: int
    seconds: float

    @property
    def complete(self) -> bool:
        """Whether the node's tiers hold every kernel of the manifest now."""
        return not self.missing


def _tiers(cache: BundleCache) -> list[NodeTier]:
    return [cache.tier, *cache.layers]


def _held(tiers: Sequence[NodeTier], key: str) -> str | None:
    """The digest the first of ``tiers`` that holds ``key`` has for it (None: none holds it)."""
    return next((d for tier in tiers if (d := tier.held_digest(key)) is not None), None)


def marked_complete(tiers: Sequence[NodeTier], manifest: JobManifest) -> bool:
    """The tier's marker names every key of the manifest (and foreign group the tier keeps),
    and their files are all still here."""
    marked = tiers[0].marked(manifest.digest)
    if marked is None or sorted(k for k, _ in marked) != foreign.wanted_keys(tiers[0], manifest):
        return False
    for tier in tiers:
        tier.packs.refresh()
    return all(any(t.present(k, d) for t in tiers) for k, d in marked)


def prefetch(cache: BundleCache, manifest: JobManifest) -> PrefetchResult:
    """``KernelCache.prefetch``: see the module docstring."""
    started = time.monotonic()
    tiers = _tiers(cache)
    tier = cache.tier
    groups = foreign.wanted(tier, manifest)
    size = len(manifest) + len(groups)
    for each in tiers:  # the packs first: a key they hold is not looked for as an alias file
        each.packs.refresh()
    if any(_held(tiers, key) is not None for key in manifest.recipe_keys) or any(
        tier.held_digest(g.binding_key) is not None for g in groups
    ):
        cache.check_withdrawals()  # what the tiers hold of it and the server withdrew: not held

    def result(held: int, fetched: int, missing: tuple[str, ...], requests: int) -> PrefetchResult:
        took = time.monotonic() - started
        return PrefetchResult(manifest.digest, size, held, fetched, missing, requests, took)

    if marked_complete(tiers, manifest):
        return result(size, 0, (), 0)

    # One process per node asks (the lock guards no correctness: publishing is atomic,
    # so without it the worst is a second request); the others find its marker as soon
    # as it appears, without queueing for the lock one after another (a convoy: B12).
    def marker() -> bool | None:
        return True if marked_complete(tiers, manifest) else None

    with tier.hold_unless(manifest.digest, marker) as found:
        if not found:
            tier.flush()
        if found or marked_complete(tiers, manifest):
            return result(size, 0, (), 0)
        held, lacking_groups = foreign.split(tier, groups)
        lacking: list[str] = []
        for key in manifest.recipe_keys:
            digest = _held(tiers, key)
            if digest is None:
                lacking.append(key)
            else:
                held[key] = digest
        asking = bool(lacking or lacking_groups)
        fetched, missing = _fetch(cache, lacking, held, lacking_groups) if asking else (0, [])
        if not missing:
            tier.flush()  # the records of what was published, before the marker names them
            tier.mark_complete(manifest.digest, held.items())
        unheld = len(lacking) + len(lacking_groups)
        return result(size - unheld, fetched, tuple(missing), 1 if asking else 0)


@dataclass(frozen=True)
class Received:
    """A bundle answer's bytes that came by another way than this process's own request: a
    peer's copy of the server's answer, sent over the job's process group
    (:mod:`~kcache_client._fanout`). Checked exactly as the server's answer is
    (:func:`_fetch`): nothing a peer sends is trusted more than the server's word.
    ``where`` names it in errors."""

    chunks: Iterable[bytes]
    where: str


def publish_received(
    cache: BundleCache, manifest: JobManifest, received: Received
) -> tuple[int, list[str]]:
    """Check and keep a bundle answer to a request for ``manifest`` (its kernels and all of its
    foreign groups) that a peer forwarded, as if this process had asked the server itself
    (:func:`_fetch`); (kept, missing)."""
    return _fetch(cache, manifest.recipe_keys, {}, manifest.foreign, received=received)


def fetch_teed(
    cache: BundleCache, manifest: JobManifest, tee: Callable[[bytes], object]
) -> tuple[int, list[str]]:
    """One bundle request for ``manifest`` (its kernels and all of its foreign groups:
    :func:`_fetch`), each piece of the answer also handed to ``tee`` as it arrives (a copy
    for the job's other nodes); (kept, missing)."""
    return _fetch(cache, manifest.recipe_keys, {}, manifest.foreign, tee=tee)


def _opened(
    cache: BundleCache,
    remote: Remote,
    keys: list[str],
    part: ForeignPart,
    received: Received | None,
    tee: Callable[[bytes], object] | None,
) -> AbstractContextManager[Iterable[bytes]]:
    """The answer's pieces after its foreign section (read and kept by ``part``): the
    server's to this request, or what a peer forwarded."""
    if received is not None:
        return part.first(nullcontext(received.chunks))
    cache.stats.add("bundle_requests")
    context = cache.context()
    named = [group.name.to_dict() for group in part.groups.values()]
    answer = remote.bundle(keys, context=context, foreign=named)
    return part.first(answer if tee is None else _teed(answer, tee))


@contextmanager
def _teed(
    answer: AbstractContextManager[Iterator[bytes]], tee: Callable[[bytes], object]
) -> Iterator[Iterable[bytes]]:
    """A request's answer whose pieces are also handed to ``tee``."""
    with answer as chunks:

        def pieces() -> Iterator[bytes]:
            for piece in chunks:
                tee(piece)
                yield piece

        yield pieces()


def _fetch(
    cache: BundleCache,
    keys: list[str],
    held: dict[str, str],
    groups: Sequence[ManifestForeign] = (),
    *,
    received: Received | None = None,
    tee: Callable[[bytes], object] | None = None,
) -> tuple[int, list[str]]:
    """One bundle request for ``keys`` and the foreign ``groups``, its entries and groups
    checked and kept; (kept, missing). The groups' section comes first; each group is
    kept once it checks whole (:mod:`~kcache_client._foreign_bundle`).

    ``received``: no request; the bytes a peer forwarded of the server's answer to one
    for ``keys``, checked and kept the same way. ``tee``: each piece of the answer is
    also handed to it as it arrives.

    Each entry's framing, size and digest are checked as it arrives, and the entries go
    into one pack of the node tier (:mod:`~kcache_client._packs`), put in place once the
    server's signature over all of them verifies (one verification: the trailer's; one
    per entry from a server that sends none). A stream cut or damaged half way keeps
    the entries that arrived whole, each checked by its own signature first, and the
    error is raised. Into a tier this process may not write, entries go one by one
    through :meth:`NodeTier.publish`, which knows what the tier's standing allows.
    """
    remote = cache._require_server()
    where = f"{remote.url}/v1/bundle" if received is None else received.where
    tier = cache.tier
    part = ForeignPart(tier, remote, groups, held, where)
    missing: list[str] = part.missing
    opened = _opened(cache, remote, keys, part, received, tee)
    if not tier.standing.writable or tier.read_only:
        fetched, unanswered = _fetch_each(cache, remote, opened, where, keys, held, missing)
        return fetched + part.kept, unanswered
    signed = BundleDigest()
    arrived: list[tuple[str, ArtifactMeta, Signature]] = []
    pack = tier.packs.writer()
    try:
        with opened as chunks:
            reader = BundleReader(
                chunks, max_entry_bytes=remote.max_artifact_bytes, where=where, max_items=len(keys)
            )
            try:
                for item in _asked_entries(reader, keys, held, missing, where):
                    remote.check_size(item.meta, where)
                    pack.add(item.recipe_key, item.meta, item.data, item.signature, item.head)
                    signed.add(item.recipe_key, item.meta)
                    arrived.append((item.recipe_key, item.meta, item.signature))
            except KCacheError:
                _keep(cache, remote, pack, arrived, held, where)  # each by its own signature
                raise
        if reader.signature is not None:
            remote.check_bundle(signed, reader.signature, where)
        # The pack keeps the signature over all of its entries (they are the answer's, in its
        # order): a process reading it from a shared tier checks one signature, not one each.
        # Without one (a server that predates bundle signatures), each entry's own is checked.
        _keep(cache, remote, pack, arrived, held, where, reader.signature)
    finally:
        pack.abandon()  # nothing, once kept
    return len(arrived) + part.kept, _unanswered(keys, held, missing)


def _asked_entries(
    reader: BundleReader, keys: list[str], held: dict[str, str], missing: list[str], where: str
) -> Iterator[BundleEntry]:
    """The reader's entries, each of a key asked for and not answered before; missing keys
    (each asked for and not answered before, too) noted in ``missing``.

    So every key asked for is answered at most once, entry or missing line, and what a
    server sends is bounded by what was asked, whatever it sends (the reader's
    ``max_items`` counts the lines; this, which keys they name).
    """
    asked = set(keys) - held.keys()
    for item in reader:
        if item.recipe_key not in asked:
            gap = isinstance(item, BundleMissing)
            said = "a missing line" if gap else "an entry"
            also = " or answered" if gap else ""
            raise ResponseRefusedError(
                where, f"{said} for recipe {item.recipe_key}, not asked for{also}"
            )
        asked.discard(item.recipe_key)
        if isinstance(item, BundleMissing):
            missing.append(item.recipe_key)
        else:
            yield item


def _keep(
    cache: BundleCache,
    remote: Remote,
    pack: PackWriter,
    arrived: list[tuple[str, ArtifactMeta, Signature]],
    held: dict[str, str],
    where: str,
    signature: Signature | None = None,
) -> None:
    """Put the pack in place and note what it holds: with ``signature``, the answer's over
    all of its entries (verified), else once each entry's own signature is checked."""
    if signature is None:
        for key, meta, own in arrived:
            remote.check_entry(key, meta, own, where)
    tier = cache.tier
    if pack.commit(signature) is None:
        return
    tier.packs.adopt(pack)
    tier.stored(pack.bytes)
    for key, meta, _ in arrived:
        held[key] = meta.digest
        cache.stats.add("bundle_entries")


def _fetch_each(
    cache: BundleCache,
    remote: Remote,
    opened: AbstractContextManager[Iterable[bytes]],
    where: str,
    keys: list[str],
    held: dict[str, str],
    missing: list[str],
) -> tuple[int, list[str]]:
    """:func:`_fetch` into a tier this process does not write packs into: entry by entry."""
    fetched = 0
    with opened as chunks:
        reader = BundleReader(
            chunks, max_entry_bytes=remote.max_artifact_bytes, where=where, max_items=len(keys)
        )
        for item in _asked_entries(reader, keys, held, missing, where):
            key = item.recipe_key
            signature = remote.check_entry(key, item.meta, item.signature, where)
            cache.tier.publish(key, None, item.meta, item.data, signature)
            held[key] = item.meta.digest
            fetched += 1
            cache.stats.add("bundle_entries")
    return fetched, _unanswered(keys, held, missing)


def _unanswered(keys: list[str], held: dict[str, str], missing: list[str]) -> list[str]:
    """``missing``, and the keys a well-framed answer skipped (told, not guessed at)."""
    return missing + sorted(set(keys) - held.keys() - set(missing))


# ---------------------------------------------------------------------- files
def _entries_of(cache: BundleCache, manifest: JobManifest) -> Iterator[BundleEntry]:
    tiers = _tiers(cache)
    for kernel in manifest.kernels:
        for tier in tiers:
            found = tier.lookup_signed(kernel.recipe_key)
            if found is not None:
                break
        else:
            raise KCacheError(
                f"recipe {kernel.recipe_key} ({kernel.label}) is not in this node's tiers and the "
                "server did not have it: the bundle would be incomplete"
            )
        meta, data, signature = found
        if signature is None:
            raise KCacheError(
                f"recipe {kernel.recipe_key} ({kernel.label}) is held unsigned (a local compile): "
                "a bundle carries signed artifacts only; compile it on the server"
            )
        yield BundleEntry(kernel.recipe_key, meta, signature, data)


def write_bundle_file(
    cache: BundleCache, manifest: JobManifest, path: str | os.PathLike[str]
) -> int:
    """Write the manifest's artifacts (prefetched into the node tier first) as one bundle file.

    Returns how many entries it holds. The file appears whole or not at all (written
    beside it and renamed).
    """
    if not marked_complete(_tiers(cache), manifest):
        done = prefetch(cache, manifest)
        if done.missing:
            raise KCacheError(
                f"the server has no artifact for {len(done.missing)} recipes of the manifest "
                f"(first {done.missing[0]}): resolve them first (kcache warmup), then bundle"
            )
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)  # as a manifest's save makes its own
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    count = 0
    try:
        with open(partial, "wb") as out:
            out.write(header_line())
            for entry in _entries_of(cache, manifest):
                head = entry_head(entry.recipe_key, entry.meta, entry.signature)
                out.writelines((head, entry.data, b"\n"))
                count += 1
            out.write(end_line(count, 0))
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return count
