"""Bundle files into a tier, and the read-only layers under a cache's writable node tier.

- :func:`load_bundle_file` (``kcache bundle unpack``, and a file layer): a bundle file
  into a tier. Every entry is checked first (framing, digest, a signature by a key this
  client trusts: ``KCACHE_TRUSTED_KEYS`` or a pinned server's), and nothing is written
  unless all pass: a file truncated, tampered with or signed by an unknown key leaves
  the tier as it was.
- :func:`open_layers`: the read-only layers under a cache's writable node tier
  (``ClientSettings.layers``, ``KCACHE_CACHE_LAYERS``): tier directories, used as they
  are (read only, signed entries only, never touched or evicted), and bundle files,
  unpacked once (checked as above) into ``<cache_dir>/layers/<id>/`` and used from there.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from kcache.bundle_format import BundleEntry, BundleError, BundleMissing, BundleReader, read_chunks
from kcache.errors import KCacheError
from kcache.fsutil import atomic_write
from kcache_client._tier import NodeTier
from kcache_client._trust import Trust

__all__ = ["load_bundle_file", "open_layers"]

#: Where bundle-file layers are unpacked, under the writable tier's root.
_LAYERS_DIR = "layers"
_UNPACKED = ".unpacked"


def _checked_entries(path: Path, trust: Trust, max_entry_bytes: int) -> Iterator[BundleEntry]:
    """The file's entries, each checked (framing, digest, a trusted signature); BundleError else."""
    with open(path, "rb") as handle:
        reader = BundleReader(read_chunks(handle), max_entry_bytes=max_entry_bytes, where=str(path))
        for item in reader:
            if isinstance(item, BundleMissing):
                continue
            problem = trust.entry_problem(item.recipe_key, item.meta, item.signature)
            if problem is not None:
                raise BundleError(
                    f"{path}: the entry of recipe {item.recipe_key} is refused: {problem}"
                )
            yield item


def load_bundle_file(
    tier: NodeTier, path: str | os.PathLike[str], trust: Trust, *, max_entry_bytes: int
) -> int:
    """Publish every entry of a bundle file into ``tier``, after all of them are checked.

    Raises :class:`~kcache.bundle_format.BundleError` (nothing written) for a file that
    is truncated, damaged, tampered with or signed by a key ``trust`` does not accept.
    The file is read twice (checked whole, then published, each entry checked again),
    so it is never held in memory.
    """
    source = Path(path)
    count = sum(1 for _ in _checked_entries(source, trust, max_entry_bytes))
    published = 0
    for entry in _checked_entries(source, trust, max_entry_bytes):
        tier.publish(entry.recipe_key, None, entry.meta, entry.data, entry.signature)
        published += 1
    tier.flush()
    if published != count:
        raise BundleError(f"{source} changed while it was read ({count} entries, then {published})")
    return published


def _file_layer(root: Path, path: Path, trust: Trust, max_entry_bytes: int) -> Path:
    """The directory a bundle file is unpacked into (once per file identity), checked whole."""
    st = os.stat(path)
    ident = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
    target = root / _LAYERS_DIR / hashlib.sha256(ident.encode()).hexdigest()[:32]
    if (target / _UNPACKED).is_file():
        return target
    unpacking = NodeTier(target, max_bytes=0, trust=trust)
    try:
        load_bundle_file(unpacking, path, trust, max_entry_bytes=max_entry_bytes)
    except BundleError as exc:
        raise KCacheError(
            f"the cache layer {path} is refused: {exc}. Remove it from KCACHE_CACHE_LAYERS, or "
            "give the key that signed it in KCACHE_TRUSTED_KEYS if it is a trusted server's"
        ) from None
    atomic_write(target / _UNPACKED, str(path).encode(), durable=False)
    return target


def open_layers(
    paths: Sequence[Path], root: Path, trust: Trust, *, max_entry_bytes: int
) -> list[NodeTier]:
    """The read-only layers of ``paths`` (module docstring), in order."""
    layers = []
    for path in paths:
        directory = _file_layer(root, path, trust, max_entry_bytes) if path.is_file() else path
        layers.append(NodeTier(directory, max_bytes=0, trust=trust, read_only=True))
    return layers
