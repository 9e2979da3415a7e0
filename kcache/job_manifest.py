"""Job manifests: the set of kernels a job used, as one versioned, diffable object.

A job is described by what it looked up, not by the code that asked: every kernel it
was served, by recipe key, with the digest, target, toolchain, kind and size of the
artifact that served it. The server records it from the audit events that name the
job (``GET /v1/jobs/{job}/manifest``); a client records its own (``KernelCache.manifest``).
Either is saved as JSON::

    {"format": "kcache-manifest", "version": 1, "job_id": "...", "created_at": 1.7e9,
     "digest": "<sha256>", "kernels": [{"recipe_key", "digest", "kernel", "target",
     "toolchain", "kind", "size"}, ...]}

A manifest may also name foreign groups, what the libraries' own cache hooks used
(docs/design.md section 10): ``"foreign": [{"library", "version", "target",
"toolchain", "key", "binding_key", "files": [{"name", "digest", "size"}]}, ...]``,
sorted by binding key. Such a manifest is version 2 (its digest covers the groups
too); one without is written as version 1, the same bytes and digest as before, so
an older kcache reads it, and refuses a version 2 one as a version it does not know.

Kernels are sorted by recipe key. The manifest's ``digest`` covers the version and
each kernel's recipe key and artifact digest (not the job, nor when it was made), so
two jobs that used the same kernels have the same digest: what a node tier's
completeness marker is named by. ``version`` is checked on reading: a manifest of a
later version is refused with a sentence saying so, never half understood.

:func:`diff_manifests` says what changed between two: kernels added, removed, and
changed (the same recipe key now served by another artifact, or one kernel of a target
whose recipe changed: same kernel name and target, other recipe key).
"""

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
from kcache.foreign import ForeignFileRef, ForeignName, ForeignNameError, check_files
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
    "ManifestForeign",
    "ManifestKernel",
    "diff_manifests",
]

MANIFEST_FORMAT = "kcache-manifest"
#: Bumped when the format changes incompatibly; readers refuse versions they do not know.
#: Version 2 names foreign groups; a manifest without any is still written as version 1.
MANIFEST_VERSION = 2
#: The versions this kcache reads.
READ_VERSIONS = (1, 2)
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


@dataclass(frozen=True, order=True)
class ManifestForeign:
    """One foreign group a job used: its binding's name and its files (docs/design.md 10)."""

    binding_key: str
    name: ForeignName
    files: tuple[ForeignFileRef, ...]

    @classmethod
    def of(cls, name: ForeignName, files: Any) -> ManifestForeign:
        """The entry of ``name``; ``files`` as ``{name, digest, size}`` items or refs (checked)."""
        refs = check_files([f.to_dict() if isinstance(f, ForeignFileRef) else f for f in files])
        return cls(name.binding_key, name, refs)

    @property
    def size(self) -> int:
        """The group's bytes."""
        return sum(f.size for f in self.files)

    @property
    def label(self) -> str:
        """How a person names it."""
        return f"{self.name.library}:{self.name.key}@{self.name.target}"

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (one item of ``foreign``)."""
        return {
            **self.name.to_dict(),
            "binding_key": self.binding_key,
            "files": [f.to_dict() for f in self.files],
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> ManifestForeign:
        """Inverse of :meth:`to_dict`, every field checked (ManifestError naming ``where``)."""
        if not isinstance(data, dict):
            raise ManifestError(f"{where} must be an object")
        try:
            entry = cls.of(ForeignName.checked(data), data.get("files"))
        except ForeignNameError as exc:
            raise ManifestError(f"{where}: {exc}") from None
        stated = data.get("binding_key")
        if stated is not None and stated != entry.binding_key:
            raise ManifestError(f"{where}.binding_key is not the binding key of its name")
        return entry

    def digest_line(self) -> str:
        """What the manifest's digest covers of it: the binding and every file."""
        files = ",".join(f"{f.name}:{f.digest}:{f.size}" for f in self.files)
        return f"foreign {self.binding_key} {files}\n"


@dataclass(frozen=True)
class JobManifest:
    """The kernels a job used (see the module docstring); ``kernels`` sorted by recipe key,
    ``foreign`` by binding key. ``version`` is what the content needs (0, the default:
    1 without foreign groups, else 2)."""

    kernels: tuple[ManifestKernel, ...]
    job_id: str | None = None
    created_at: float = field(default_factory=time.time)
    version: int = 0
    foreign: tuple[ManifestForeign, ...] = ()

    def __post_init__(self) -> None:
        if self.version == 0:
            object.__setattr__(self, "version", 2 if self.foreign else 1)
        if self.foreign and self.version < 2:
            raise ManifestError(
                f"a manifest of version {self.version} cannot name foreign groups (version 2 can)"
            )

    @classmethod
    def of(
        cls,
        kernels: Iterable[ManifestKernel],
        job_id: str | None = None,
        *,
        foreign: Iterable[ManifestForeign] = (),
        **kw: Any,
    ) -> JobManifest:
        """A manifest of ``kernels`` (one per recipe key: the last given wins) and ``foreign``
        groups (one per binding key, likewise), sorted."""
        by_key: dict[str, ManifestKernel] = {}
        for kernel in kernels:
            by_key[kernel.recipe_key] = kernel
        groups: dict[str, ManifestForeign] = {}
        for group in foreign:
            groups[group.binding_key] = group
        if len(by_key) + len(groups) > MAX_KERNELS:
            raise ManifestError(
                f"a manifest lists at most {MAX_KERNELS} kernels and foreign groups, not "
                f"{len(by_key) + len(groups)}"
            )
        return cls(
            tuple(by_key[k] for k in sorted(by_key)),
            job_id,
            foreign=tuple(groups[k] for k in sorted(groups)),
            **kw,
        )

    @property
    def digest(self) -> str:
        """sha256 over the version, each kernel's recipe key and artifact digest, and (version
        2) each foreign group's binding key and files."""
        h = hashlib.sha256(f"{MANIFEST_FORMAT}/{self.version}\n".encode())
        for kernel in self.kernels:
            h.update(f"{kernel.recipe_key} {kernel.digest}\n".encode("ascii"))
        for group in self.foreign:
            h.update(group.digest_line().encode("ascii"))
        return h.hexdigest()

    @property
    def binding_keys(self) -> list[str]:
        """The foreign groups' binding keys, sorted."""
        return [g.binding_key for g in self.foreign]

    @property
    def recipe_keys(self) -> list[str]:
        """The recipe keys, sorted."""
        return [k.recipe_key for k in self.kernels]

    def __len__(self) -> int:
        return len(self.kernels)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (module docstring); ``foreign`` only in a manifest that names any."""
        body: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "version": self.version,
            "job_id": self.job_id,
            "created_at": self.created_at,
            "digest": self.digest,
            "kernels": [k.to_dict() for k in self.kernels],
        }
        if self.foreign or self.version >= 2:
            body["foreign"] = [g.to_dict() for g in self.foreign]
        return body

    @classmethod
    def from_dict(cls, data: Any) -> JobManifest:
        """Inverse of :meth:`to_dict`; ManifestError for anything else (a stated digest must match)."""
        if not isinstance(data, Mapping) or data.get("format") != MANIFEST_FORMAT:
            raise ManifestError(f'not a kcache manifest: "format" must be "{MANIFEST_FORMAT}"')
        version = data.get("version")
        if version not in READ_VERSIONS or isinstance(version, bool):
            raise ManifestError(
                f"manifest version {version!r} is not one this kcache reads (it reads versions "
                f"{', '.join(map(str, READ_VERSIONS))}): save it again with this release, or "
                "upgrade kcache"
            )
        foreign = data.get("foreign", [])
        if version < 2 and "foreign" in data:
            raise ManifestError(
                f'a version {version} manifest has no "foreign" groups: version 2 names them'
            )
        if not isinstance(foreign, list):
            raise ManifestError('a manifest\'s "foreign" must be a list')
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
        if len(kernels) + len(foreign) > MAX_KERNELS:
            raise ManifestError(
                f"a manifest lists at most {MAX_KERNELS} kernels and foreign groups, not "
                f"{len(kernels) + len(foreign)}"
            )
        parsed = [ManifestKernel.from_dict(k, f"kernels[{i}]") for i, k in enumerate(kernels)]
        groups = [ManifestForeign.from_dict(g, f"foreign[{i}]") for i, g in enumerate(foreign)]
        manifest = cls.of(
            parsed, job_id, foreign=groups, created_at=float(created), version=version
        )
        stated = data.get("digest")
        if stated is not None and stated != manifest.digest:
            raise ManifestError(
                f"the manifest states digest {stated}, its entries make {manifest.digest}: "
                "it was edited by hand or damaged"
            )
        return manifest

    def dumps(self) -> str:
        """The JSON text, one kernel (and foreign group) a line (diffable with plain tools too)."""
        body = self.to_dict()
        lists = {name: body.pop(name) for name in ("kernels", "foreign") if name in body}
        text = json.dumps(body, sort_keys=True)[:-1]
        for name, items in lists.items():
            lines = ",\n".join("  " + json.dumps(k, sort_keys=True) for k in items)
            text += f', "{name}": [\n{lines}\n]' if lines else f', "{name}": []'
        return text + "}\n"

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
    #: Foreign groups added, removed, and changed (the same binding with other files).
    foreign_added: tuple[ManifestForeign, ...] = ()
    foreign_removed: tuple[ManifestForeign, ...] = ()
    foreign_changed: tuple[tuple[ManifestForeign, ManifestForeign], ...] = ()

    @property
    def same(self) -> bool:
        """Whether nothing changed."""
        return not (
            self.added
            or self.removed
            or self.changed
            or self.foreign_added
            or self.foreign_removed
            or self.foreign_changed
        )

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
            **(
                {
                    "foreign": {
                        "added": [g.to_dict() for g in self.foreign_added],
                        "removed": [g.to_dict() for g in self.foreign_removed],
                        "changed": [
                            {"from": a.to_dict(), "to": b.to_dict()}
                            for a, b in self.foreign_changed
                        ],
                    }
                }
                if self.foreign_added or self.foreign_removed or self.foreign_changed
                else {}
            ),
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
    groups_a = {g.binding_key: g for g in a.foreign}
    groups_b = {g.binding_key: g for g in b.foreign}
    return ManifestDiff(
        added=tuple(k for k in only_b if k.recipe_key not in paired),
        removed=tuple(k for k in only_a if k.recipe_key not in paired),
        changed=tuple(changed),
        foreign_added=tuple(groups_b[k] for k in sorted(groups_b.keys() - groups_a.keys())),
        foreign_removed=tuple(groups_a[k] for k in sorted(groups_a.keys() - groups_b.keys())),
        foreign_changed=tuple(
            (groups_a[k], groups_b[k])
            for k in sorted(groups_a.keys() & groups_b.keys())
            if groups_a[k].files != groups_b[k].files
        ),
    )
