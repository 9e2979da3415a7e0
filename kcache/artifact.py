"""Artifact metadata and negative entries, as stored by every ``Index``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kcache.deps import DEPENDENCY_CHECK, Dependency

__all__ = ["ArtifactMeta", "CompileFailure", "CompileOutput", "ManifestEntry", "now_us"]


def now_us() -> float:
    """The time, in epoch seconds to the microsecond: what an SQL index keeps of it.

    A process that answers from the metadata it just made and one that reads the same
    row back from the database then say the same ``created_at``.
    """
    return round(time.time(), 6)


@dataclass(frozen=True)
class CompileOutput:
    """What one compile produced, before it is published."""

    data: bytes
    kind: str  # "cubin" | "ptx" | "ltoir"
    target: str
    toolchain: str
    log: str
    lowered_names: dict[str, str]
    dependencies: tuple[Dependency, ...]
    dependencies_exact: bool
    compile_seconds: float
    #: How the dependency list was proven (:data:`kcache.deps.DEPENDENCY_CHECK`).
    dependency_check: int = DEPENDENCY_CHECK


@dataclass(frozen=True)
class ArtifactMeta:
    """A published artifact: the blob's digest plus what is known about it."""

    digest: str
    size: int
    kind: str
    target: str
    toolchain: str
    lowered_names: dict[str, str] = field(default_factory=dict)
    compile_seconds: float = 0.0
    log: str = ""
    dependencies: tuple[Dependency, ...] = ()
    dependencies_exact: bool = True
    kernel: str = ""
    created_at: float = field(default_factory=now_us)
    #: How ``dependencies`` was proven: 0 by releases that trusted NVRTC's trace alone
    #: (:func:`kcache.deps.proven` says what such a record may still serve).
    dependency_check: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the ``artifact`` object of API responses)."""
        return {
            "digest": self.digest,
            "size": self.size,
            "kind": self.kind,
            "target": self.target,
            "toolchain": self.toolchain,
            "lowered_names": dict(self.lowered_names),
            "compile_seconds": self.compile_seconds,
            "log": self.log,
            "dependencies": [d.to_dict() for d in self.dependencies],
            "dependencies_exact": self.dependencies_exact,
            "kernel": self.kernel,
            "created_at": self.created_at,
            "dependency_check": self.dependency_check,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ArtifactMeta:
        """Inverse of :meth:`to_dict`."""
        return cls(
            digest=data["digest"],
            size=int(data["size"]),
            kind=data["kind"],
            target=data["target"],
            toolchain=data["toolchain"],
            lowered_names=dict(data.get("lowered_names", {})),
            compile_seconds=float(data.get("compile_seconds", 0.0)),
            log=data.get("log", ""),
            dependencies=_dependencies(data.get("dependencies", [])),
            dependencies_exact=bool(data.get("dependencies_exact", True)),
            kernel=data.get("kernel", ""),
            created_at=float(data.get("created_at", 0.0)),
            dependency_check=int(data.get("dependency_check", 0)),
        )


def _dependencies(items: list[dict[str, str]]) -> tuple[Dependency, ...]:
    """``Dependency(d["name"], d["sha256"])`` for each item, without the frozen ``__init__``.

    A node-tier hit builds one per header the kernel read; the dataclass's frozen
    ``__init__`` (an ``object.__setattr__`` per field) was about a fifth of the hit.
    The objects are the same: equal, hashed and ordered by the same two fields.
    """
    out = []
    new = object.__new__
    for item in items:
        dep = new(Dependency)
        fields = dep.__dict__
        fields["name"] = item["name"]
        fields["sha256"] = item["sha256"]
        out.append(dep)
    return tuple(out)


@dataclass(frozen=True)
class CompileFailure:
    """A negative entry: this recipe failed to compile, with the compiler's log.

    ``kind`` says how: ``error`` (the compiler rejected it; kept for good),
    ``timeout`` (it ran past the time limit) or ``too_large`` (its output was over the
    artifact size limit). The last two may depend on load or settings, so they carry
    ``expires_at`` (epoch seconds), after which indexes no longer return them.
    """

    recipe_key: str
    log: str
    created_at: float = field(default_factory=now_us)
    kind: str = "error"
    expires_at: float | None = None

    def expired(self, now: float | None = None) -> bool:
        """True once ``expires_at`` has passed (never for an entry without one)."""
        if self.expires_at is None:
            return False
        return self.expires_at <= (time.time() if now is None else now)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "recipe_key": self.recipe_key,
            "log": self.log,
            "created_at": self.created_at,
            "kind": self.kind,
            "expires_at": self.expires_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompileFailure:
        """Inverse of :meth:`to_dict`."""
        expires = data.get("expires_at")
        return cls(
            data["recipe_key"],
            data["log"],
            float(data.get("created_at", 0.0)),
            str(data.get("kind", "error")),
            None if expires is None else float(expires),
        )


@dataclass(frozen=True)
class ManifestEntry:
    """Under a base key: the headers one compile read (with hashes) -> the artifact it made."""

    digest: str
    dependencies: tuple[Dependency, ...]
    created_at: float = field(default_factory=now_us)
    #: As :attr:`ArtifactMeta.dependency_check`: only a proven entry is ever matched.
    dependency_check: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "digest": self.digest,
            "dependencies": [d.to_dict() for d in self.dependencies],
            "created_at": self.created_at,
            "dependency_check": self.dependency_check,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ManifestEntry:
        """Inverse of :meth:`to_dict`."""
        return cls(
            digest=data["digest"],
            dependencies=_dependencies(data["dependencies"]),
            created_at=float(data.get("created_at", 0.0)),
            dependency_check=int(data.get("dependency_check", 0)),
        )
