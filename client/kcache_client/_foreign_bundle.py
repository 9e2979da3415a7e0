"""A manifest's foreign groups in its prefetch: asked in the same one bundle request, kept where the hooks look.

A version 2 manifest names the foreign groups a job's library hooks used (docs/design.md
section 10). A prefetch asks for those the node tier lacks beside its kernels, in one
``POST /v1/bundle``; the answer opens with their section
(:mod:`kcache.foreign_section`), read here before the kernels' bundle: each group's
line must name a group asked for and not answered before, its files must hash to their
digests (the reader checks that before it hands a group over), and the server's
"published by <writer>" signature must verify by a key trusted for the server, as a
hook's lookup checks it. Only then is the group kept, as one blob in the node tier under
its binding key (:func:`~kcache_client._foreign_groups.keep_group`), where
:class:`~kcache_client._foreign.ForeignCache` reads it: a group torn, damaged or signed
by another key leaves nothing of itself, and its error is raised.

Foreign groups go only into the user's private, writable tier (the one the hooks read);
for any other, a manifest's groups are neither asked for nor named by its marker.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

from kcache.foreign_section import ForeignMissing, ForeignSectionReader
from kcache.job_manifest import JobManifest, ManifestForeign
from kcache_client._foreign_groups import keep_group, takes_foreign
from kcache_client._remote import Remote
from kcache_client._tier import NodeTier
from kcache_client.errors import ResponseRefusedError

__all__ = ["ForeignPart", "split", "wanted", "wanted_keys"]


def wanted(tier: NodeTier, manifest: JobManifest) -> tuple[ManifestForeign, ...]:
    """The manifest's groups a prefetch into ``tier`` brings (none into a tier the hooks do not read)."""
    return manifest.foreign if manifest.foreign and takes_foreign(tier) else ()


def wanted_keys(tier: NodeTier, manifest: JobManifest) -> list[str]:
    """What a complete marker of ``manifest`` in ``tier`` names: its recipe keys, and the
    binding keys of the groups the tier keeps, sorted."""
    return sorted([*manifest.recipe_keys, *(g.binding_key for g in wanted(tier, manifest))])


def split(
    tier: NodeTier, groups: Sequence[ManifestForeign]
) -> tuple[dict[str, str], list[ManifestForeign]]:
    """(binding key -> blob digest of the groups ``tier`` holds, the groups it lacks)."""
    held: dict[str, str] = {}
    lacking: list[ManifestForeign] = []
    for group in groups:
        digest = tier.held_digest(group.binding_key)
        if digest is None:
            lacking.append(group)
        else:
            held[group.binding_key] = digest
    return held, lacking


class ForeignPart:
    """The foreign section of one bundle answer, for ``groups`` (what was asked of it).

    ``kept`` counts the groups kept, ``held`` gets each one's binding key -> blob digest,
    ``missing`` the binding keys the server did not serve (or, after a well-formed
    section, did not answer at all).
    """

    def __init__(
        self,
        tier: NodeTier,
        remote: Remote,
        groups: Sequence[ManifestForeign],
        held: dict[str, str],
        where: str,
    ) -> None:
        self.tier = tier
        self.remote = remote
        self.groups = {g.binding_key: g for g in groups}
        self.held = held
        self.where = where
        self.kept = 0
        self.missing: list[str] = []

    @contextmanager
    def first(self, opened: AbstractContextManager[Iterable[bytes]]) -> Iterator[Iterable[bytes]]:
        """``opened``'s answer with its foreign section read, checked and kept: the rest."""
        with opened as chunks:
            if not self.groups:
                yield chunks
                return
            yield self._read(chunks)

    def _read(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        reader = ForeignSectionReader(
            chunks,
            max_file_bytes=self.remote.max_artifact_bytes,
            max_items=len(self.groups),
            where=self.where,
        )
        asked = dict(self.groups)
        for item in reader:
            key = item.binding_key if isinstance(item, ForeignMissing) else item.binding.binding_key
            group = asked.pop(key, None)
            if group is None:
                raise ResponseRefusedError(
                    self.where, f"a foreign group {key}, not asked for or answered before"
                )
            if isinstance(item, ForeignMissing):
                self.missing.append(key)
                continue
            self.remote.trust.check_foreign(
                self.remote.url, item.binding, item.signature, self.remote.keys, self.where
            )
            # The server's word now, whatever the feed said of the same bytes before.
            self.tier.withdrawals.reinstate((key, item.binding.group_digest))
            digest = keep_group(self.tier, group.name, key, item.files)
            if digest is not None:
                self.held[key] = digest
                self.kept += 1
        if takes_foreign(self.tier):
            self.missing += sorted(asked)  # a well-formed section that skipped them: told
        return reader.rest()
