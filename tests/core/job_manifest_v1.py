"""kcache 0.x's job manifest reader, as it was before manifests named foreign groups (format version 1).

Kept verbatim below this note (from commit d6076f7) so that a test can hand a version 2
manifest to a reader that predates it, as an older kcache on a node would read it.
"""

# ruff: noqa
# mypy: ignore-errors

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kcache.errors import KCacheError
from kcache.fsutil import atomic_write
from kcache.keys import is_hex_key

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "MAX_KERNELS",
    "MAX_MANIFEST_BYTES",
    "JobManifest",
    "ManifestDiff",
    "ManifestError",
    "ManifestKernel",
    "diff_manifests",
]

MANIFEST_FORMAT = "kcache-manifest"
#: Bumped when the format changes incompatibly; readers refuse versions they do not know.
MANIFEST_VERSION = 1
#: Kernels one manifest may list (a job's warmup set is hundreds to a few thousand).
MAX_KERNELS = 100_000
#: The largest manifest file read (a kernel is about 400 bytes of JSON).
MAX_MANIFEST_BYTES = 64 << 20


class ManifestError(KCacheError, ValueError):
    """A manifest that is malformed, of an unknown format or version, or too large."""


@dataclass(frozen=True, order=True)
class ManifestKernel:
    """One kernel a job used: its recipe key and the artifact that served it."""

    recipe_key: str
    digest: str
    kernel: str = ""
    target: str = ""
    toolchain: str = ""
    kind: str = ""
    size: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (one item of ``kernels``)."""
        return {
            "recipe_key": self.recipe_key,
            "digest": self.digest,
            "kernel": self.kernel,
            "target": self.target,
            "toolchain": self.toolchain,
            "kind": self.kind,
            "size": self.size,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> ManifestKernel:
        """Inverse of :meth:`to_dict`, every field checked (ManifestError naming ``where``)."""
        if not isinstance(data, dict):
            raise ManifestError(f"{where} must be an object")
        for name in ("recipe_key", "digest"):
            if not is_hex_key(data.get(name)):
                raise ManifestError(f"{where}.{name} must be 64 lower-case hex digits")
        texts = {}
        for name in ("kernel", "target", "toolchain", "kind"):
            value = data.get(name, "")
            if not isinstance(value, str) or len(value) > 1024:
                raise ManifestError(f"{where}.{name} must be a string of at most 1024 characters")
            texts[name] = value
        size = data.get("size", 0)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError(f"{where}.size must be a whole number of bytes")
        return cls(data["recipe_key"], data["digest"], size=size, **texts)

    @property
    def label(self) -> str:
        """How a person names it: the kernel and its target (the recipe key when unnamed)."""
        return f"{self.kernel or self.recipe_key[:16]}@{self.target or '?'}"


@dataclass(frozen=True)
class JobManifest:
    """The kernels a job used (see the module docstring); ``kernels`` sorted by recipe key."""

    kernels: tuple[ManifestKernel, ...]
    job_id: str | None = None
    created_at: float = field(default_factory=time.time)
    version: int = MANIFEST_VERSION

    @classmethod
    def of(
        cls, kernels: Iterable[ManifestKernel], job_id: str | None = None, **kw: Any
    ) -> JobManifest:
        """A manifest of ``kernels`` (one per recipe key: the last given wins), sorted."""
        by_key: dict[str, ManifestKernel] = {}
        for kernel in kernels:
            by_key[kernel.recipe_key] = kernel
        if len(by_key) > MAX_KERNELS:
            raise ManifestError(
                f"a manifest lists at most {MAX_KERNELS} kernels, not {len(by_key)}"
            )
        return cls(tuple(by_key[k] for k in sorted(by_key)), job_id, **kw)

    @property
    def digest(self) -> str:
        """sha256 over the version and each kernel's recipe key and artifact digest."""
        h = hashlib.sha256(f"{MANIFEST_FORMAT}/{self.version}\n".encode())
        for kernel in self.kernels:
            h.update(f"{kernel.recipe_key} {kernel.digest}\n".encode("ascii"))
        return h.hexdigest()

    @property
    def recipe_keys(self) -> list[str]:
        """The recipe keys, sorted."""
        return [k.recipe_key for k in self.kernels]

    def __len__(self) -> int:
        return len(self.kernels)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (module docstring)."""
        return {
            "format": MANIFEST_FORMAT,
            "version": self.version,
            "job_id": self.job_id,
            "created_at": self.created_at,
            "digest": self.digest,
            "kernels": [k.to_dict() for k in self.kernels],
        }

    @classmethod
    def from_dict(cls, data: Any) -> JobManifest:
        """Inverse of :meth:`to_dict`; ManifestError for anything else (a stated digest must match)."""
        if not isinstance(data, Mapping) or data.get("format") != MANIFEST_FORMAT:
            raise ManifestError(f'not a kcache manifest: "format" must be "{MANIFEST_FORMAT}"')
        version = data.get("version")
        if version != MANIFEST_VERSION:
            raise ManifestError(
                f"manifest version {version!r} is not one this kcache reads (it reads version "
                f"{MANIFEST_VERSION}): save it again with this release, or upgrade kcache"
            )
        kernels = data.get("kernels")
        if not isinstance(kernels, list):
            raise ManifestError('a manifest\'s "kernels" must be a list')
        if len(kernels) > MAX_KERNELS:
            raise ManifestError(
                f"a manifest lists at most {MAX_KERNELS} kernels, not {len(kernels)}"
            )
        job_id = data.get("job_id")
        if job_id is not None and (not isinstance(job_id, str) or len(job_id) > 256):
            raise ManifestError('a manifest\'s "job_id" must be a string of at most 256 characters')
        created = data.get("created_at", 0.0)
        if not isinstance(created, (int, float)) or isinstance(created, bool):
            raise ManifestError('a manifest\'s "created_at" must be unix seconds')
        parsed = [ManifestKernel.from_dict(k, f"kernels[{i}]") for i, k in enumerate(kernels)]
        manifest = cls.of(parsed, job_id, created_at=float(created))
        stated = data.get("digest")
        if stated is not None and stated != manifest.digest:
            raise ManifestError(
                f"the manifest states digest {stated}, its kernels make {manifest.digest}: "
                "it was edited by hand or damaged"
            )
        return manifest

    def dumps(self) -> str:
        """The JSON text, one kernel a line (diffable with plain tools too)."""
        body = self.to_dict()
        kernels = body.pop("kernels")
        head = json.dumps(body, sort_keys=True)[:-1]
        lines = ",\n".join("  " + json.dumps(k, sort_keys=True) for k in kernels)
        return f'{head}, "kernels": [\n{lines}\n]}}\n' if lines else f'{head}, "kernels": []}}\n'

    @classmethod
    def loads(cls, text: str | bytes) -> JobManifest:
        """Parse :meth:`dumps` (or any JSON of the form); ManifestError when it is not one."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ManifestError(f"a manifest must be JSON: {exc}") from None
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write to ``path`` atomically."""
        target = Path(path)
        atomic_write(target, self.dumps().encode())
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> JobManifest:
        """Read a manifest file (at most :data:`MAX_MANIFEST_BYTES`)."""
        with open(path, "rb") as handle:
            raw = handle.read(MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"{path} is larger than a manifest may be ({MAX_MANIFEST_BYTES} bytes)"
            )
        try:
            return cls.loads(raw)
        except ManifestError as exc:
            raise ManifestError(f"{path}: {exc}") from None


@dataclass(frozen=True)
class ManifestDiff:
    """What changed from manifest ``a`` to ``b``."""

    added: tuple[ManifestKernel, ...]
    removed: tuple[ManifestKernel, ...]
    #: (in ``a``, in ``b``): the same recipe key with another artifact, or the same kernel
    #: name and target with another recipe key.
    changed: tuple[tuple[ManifestKernel, ManifestKernel], ...]

    @property
    def same(self) -> bool:
        """Whether nothing changed."""
        return not (self.added or self.removed or self.changed)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form ``kcache manifest diff --json`` prints."""
        return {
            "added": [k.to_dict() for k in self.added],
            "removed": [k.to_dict() for k in self.removed],
            "changed": [
                {
                    "from": a.to_dict(),
                    "to": b.to_dict(),
                    "why": "artifact" if a.recipe_key == b.recipe_key else "recipe",
                }
                for a, b in self.changed
            ],
        }


def diff_manifests(a: JobManifest, b: JobManifest) -> ManifestDiff:
    """Kernels added, removed and changed from ``a`` to ``b`` (see :class:`ManifestDiff`).

    A kernel name and target that appears exactly once among each side's unmatched
    kernels is one kernel whose recipe changed (new source, options, headers); where
    a name appears several times on a side (specializations), it is left as added and
    removed, since which replaced which cannot be told.
    """
    in_a = {k.recipe_key: k for k in a.kernels}
    in_b = {k.recipe_key: k for k in b.kernels}
    changed = [
        (in_a[key], in_b[key])
        for key in sorted(in_a.keys() & in_b.keys())
        if in_a[key].digest != in_b[key].digest
    ]
    only_a = [in_a[k] for k in sorted(in_a.keys() - in_b.keys())]
    only_b = [in_b[k] for k in sorted(in_b.keys() - in_a.keys())]

    def by_name(kernels: list[ManifestKernel]) -> dict[tuple[str, str], list[ManifestKernel]]:
        out: dict[tuple[str, str], list[ManifestKernel]] = {}
        for kernel in kernels:
            if kernel.kernel:
                out.setdefault((kernel.kernel, kernel.target), []).append(kernel)
        return out

    names_a, names_b = by_name(only_a), by_name(only_b)
    paired: set[str] = set()
    for name in sorted(names_a.keys() & names_b.keys()):
        if len(names_a[name]) == 1 and len(names_b[name]) == 1:
            old, new = names_a[name][0], names_b[name][0]
            changed.append((old, new))
            paired.update((old.recipe_key, new.recipe_key))
    return ManifestDiff(
        added=tuple(k for k in only_b if k.recipe_key not in paired),
        removed=tuple(k for k in only_a if k.recipe_key not in paired),
        changed=tuple(changed),
    )
