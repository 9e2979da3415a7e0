"""What ``KernelCache.get`` returns: verified bytes plus metadata, loadable through cuda.core.

Before the driver sees an artifact, :func:`check_loadable` compares what it was built
for (a cubin's SM from its ELF header, a PTX file's ``.target`` and ``.version``) with
the device and driver, so a wrong one is refused with both named instead of the
driver's bare ``CUDA_ERROR_NO_BINARY_FOR_GPU``.
"""

from __future__ import annotations

import hashlib
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kcache.artifact import ArtifactMeta
from kcache.elf import cubin_sm
from kcache.errors import RecipeError
from kcache.outcomes import Outcome
from kcache.recipe import Recipe
from kcache.signing import Signature
from kcache.targets import parse_target
from kcache_client._device import driver_version
from kcache_client._trust import Trust
from kcache_client.errors import (
    ArchitectureMismatchError,
    DigestMismatchError,
    NoDeviceError,
    UntrustedArtifactError,
)

__all__ = ["Artifact", "ArtifactOrigin", "check_loadable"]

#: Where ``KernelCache.get`` found an artifact: this process's ``memory``, the ``node``
#: tier, a ``server`` hit, a compile on the server (``compiled`` by this request, or
#: ``waited`` for another's), or a ``local_compile`` here when the server could not answer.
ArtifactOrigin = Literal["memory", "node", "server", "compiled", "waited", "local_compile"]

#: The audit outcome (design §5) of each origin.
_OUTCOMES: dict[str, Outcome] = {
    "memory": "local_hit",
    "node": "local_hit",
    "server": "hit",
    "compiled": "compiled",
    "waited": "waited",
    "local_compile": "compiled",
}

_PTX_VERSION = re.compile(rb"^[ \t]*\.version[ \t]+(\d+)\.(\d+)", re.MULTILINE)
_PTX_TARGET = re.compile(rb"^[ \t]*\.target[ \t]+sm_(\d+)([af]?)\b", re.MULTILINE)


def check_loadable(
    kind: str,
    data: bytes,
    target: str,
    capability: tuple[int, int],
    driver: int | None,
    *,
    artifact: str = "the artifact",
    device: str = "the device",
) -> str | None:
    """Refuse an artifact that cannot run on a device of ``capability`` under ``driver``.

    ``kind`` and ``target`` are the artifact's metadata (the target's ``a``/``f``
    suffix; the SM itself is read from the bytes), ``capability`` the device's
    ``(major, minor)``, ``driver`` what ``cuDriverGetVersion`` answers (``13000`` is
    CUDA 13.0; None when unknown). Raises :class:`ArchitectureMismatchError` naming
    both sides:

    * a cubin (SM from bits 8-15 of the ELF ``e_flags``) runs on its own major
      version with an equal or higher minor (``sm_80`` on ``sm_86``), an ``sm_XXa``
      one on exactly ``sm_XX``;
    * PTX for ``sm_XX`` is compiled by the driver for any device from ``sm_XX`` on
      (``sm_XXa``: exactly that one; ``sm_XXf``: its major version), and only by a
      driver that knows its PTX ISA ``.version`` (cuda-bindings' table of PTX ISA
      versions and the CUDA releases that introduced them).

    Returns None when everything was checked, else a sentence saying what could not
    be (the PTX ISA version when the driver's version or the table is unknown).
    """
    have = f"sm_{capability[0]}{capability[1]}"
    if kind == "cubin":
        sm = cubin_sm(data)
        suffix = _suffix(target, sm)
        if not _runs(sm, suffix, capability, jit=False):
            rule = (
                f"an sm_{sm}{suffix} cubin runs only on sm_{sm}"
                if suffix == "a"
                else f"a cubin runs only on its own major version (sm_{sm // 10}x), from sm_{sm} on"
            )
            raise ArchitectureMismatchError(
                f"{artifact} is sm_{sm}{suffix}, {device} is {have}: {rule}; compile it for "
                f'{have} (target "auto" picks the device\'s own)',
                artifact=f"sm_{sm}{suffix}",
                device=have,
            )
        return None
    if kind != "ptx":
        return None  # LTO-IR is never loaded; load_module says so
    found = _PTX_TARGET.search(data)
    if found is None:
        return f"{artifact} is PTX without a .target line; its architecture was not checked"
    sm, suffix = int(found.group(1)), found.group(2).decode()
    if not _runs(sm, suffix, capability, jit=True):
        rule = {
            "a": f"PTX for sm_{sm}a is compiled only for sm_{sm}",
            "f": f"PTX for sm_{sm}f is compiled only for sm_{sm // 10}x from sm_{sm} on",
        }.get(suffix, f"PTX for sm_{sm} is compiled only for sm_{sm} and later devices")
        raise ArchitectureMismatchError(
            f"{artifact} is PTX for sm_{sm}{suffix}, {device} is {have}: {rule}",
            artifact=f"PTX for sm_{sm}{suffix}",
            device=have,
        )
    version = _PTX_VERSION.search(data)
    if version is None:
        return f"{artifact} is PTX without a .version line; its PTX ISA was not checked"
    isa = f"{int(version.group(1))}.{int(version.group(2))}"
    if driver is None:
        return (
            f"{artifact} is PTX ISA {isa}; the driver's version is unknown, so it was not checked"
        )
    try:
        from cuda.bindings.utils import get_minimal_required_cuda_ver_from_ptx_ver as needs
    except ImportError:
        return f"{artifact} is PTX ISA {isa}; cuda-bindings has no PTX ISA table, so it was not checked"
    try:
        needed = int(needs(isa))
    except ValueError:
        return (
            f"{artifact} is PTX ISA {isa}, newer than cuda-bindings' table; not checked against "
            f"the CUDA {_cuda(driver)} driver"
        )
    if driver < needed:
        raise ArchitectureMismatchError(
            f"{artifact} is PTX ISA {isa}, which needs a CUDA {_cuda(needed)} driver; {device} "
            f"runs a CUDA {_cuda(driver)} driver: update the driver, or compile to a cubin "
            f"(target {have})",
            artifact=f"PTX ISA {isa}",
            device=f"CUDA {_cuda(driver)} driver",
        )
    return None


def _suffix(target: str, sm: int) -> str:
    """The ``a``/``f`` of the metadata's target, when it names the same SM as the bytes."""
    try:
        parsed = parse_target(target)
    except RecipeError:
        return ""
    return parsed.suffix if parsed.sm == sm else ""


def _runs(sm: int, suffix: str, capability: tuple[int, int], *, jit: bool) -> bool:
    built = (sm // 10, sm % 10)
    if suffix == "a":
        return capability == built
    if suffix == "f" or not jit:
        return capability[0] == built[0] and capability[1] >= built[1]
    return capability >= built  # plain PTX: the driver compiles it for any later device


def _cuda(version: int) -> str:
    """``13000`` -> ``13.0`` (cuDriverGetVersion's encoding: 1000 * major + 10 * minor)."""
    return f"{version // 1000}.{version % 1000 // 10}"


def _cuda_core() -> Any:
    """``cuda.core`` (newer releases) or ``cuda.core.experimental`` (older ones), imported lazily."""
    try:
        import cuda.core as core

        if hasattr(core, "ObjectCode"):
            return core
    except ImportError:
        pass
    try:
        import cuda.core.experimental as experimental
    except ImportError as exc:
        raise ImportError("Artifact.load() needs cuda.core: pip install cuda-core") from exc
    return experimental


def _device(core: Any, device: int | None) -> tuple[Any, tuple[int, int]]:
    """cuda.core's ``Device`` (``device``, else the current one) and its compute capability.

    Without a usable GPU (no driver library, no device, a device number that does not
    exist) this is :class:`NoDeviceError` in one line, as ``target="auto"`` gives, not the
    driver loader's traceback (cuda.pathfinder's ``DynamicLibNotFoundError`` under
    cuda.core's ``cuInit``). Its cause is kept in the message, not as a chained traceback:
    what went wrong is one sentence, and ``get()`` never needed the GPU.
    """
    try:
        dev = core.Device(device) if device is not None else core.Device()
        capability = tuple(dev.compute_capability)
        return dev, (int(capability[0]), int(capability[1]))
    except Exception as exc:  # the driver library missing raises pathfinder's own types
        which = f"device {device}" if device is not None else "a CUDA device"
        cause = " ".join(str(exc).split()) or type(exc).__name__
        raise NoDeviceError(
            f"Artifact.load() needs {which} (an NVIDIA GPU and its driver), and none is usable "
            f"here: {type(exc).__name__}: {cause} (the artifact itself was fetched: its bytes "
            "are .data, its file .path, for a machine with a GPU)"
        ) from None


@dataclass(frozen=True)
class Artifact:
    """A compiled kernel whose bytes have been checked against ``digest``.

    :attr:`data` are the bytes that were checked (read once, hashed), :attr:`path` a file
    holding exactly them (read-only; copy it to modify it),
    ``metadata`` the server's record (target, toolchain, lowered names, dependencies),
    ``recipe`` the concrete recipe (``auto`` and the toolchain filled in) it was keyed from,
    ``origin`` where this call found it (:data:`ArtifactOrigin`).
    """

    recipe_key: str
    #: The recipe's base key (what manifests are indexed by). Given as ``""`` (what ``get``
    #: does), it is the recipe's, computed when first read: most callers never read it, and
    #: keying costs a rank 4 us per kernel it loads (B12).
    base_key: str
    digest: str
    data: bytes = field(repr=False)
    # The blob's path as a string: a Path is built when asked for (pathlib costs a few
    # microseconds, a good part of a node-tier hit, and most callers only want ``data``).
    blob_path: str
    metadata: ArtifactMeta = field(repr=False)
    recipe: Recipe = field(repr=False)
    origin: ArtifactOrigin
    #: The server's signature of ``recipe_key`` -> ``metadata`` (None: compiled locally).
    signature: Signature | None = field(default=None, repr=False)
    #: What the signature was checked against when it was found (checked again on load):
    #: the keys of the server this cache looks up through (kcache_client._trust).
    trust: Trust | None = field(default=None, repr=False, compare=False)
    #: ``materialize(digest, data)`` returns the path of a file holding exactly ``data``,
    #: the checked bytes of ``digest`` (written from them where the tier's own file is not
    #: one: a pack entry, a shared tier); see :attr:`path`. One function per cache, not one
    #: object per artifact: a rank holding 800 kernels keeps fewer objects for the
    #: collector to walk (B12).
    materialize: Callable[[str, bytes], str] | None = field(default=None, repr=False, compare=False)
    #: How the one check that found it usable judged it, where it was found (:meth:`found`):
    #: ``signed`` (a server's answer, its signature verified), the standing of the tier it
    #: was found in (``private``: this user's own entry, used as it is; ``shared``,
    #: ``untrusted``: its signature verified) or ``compiled here``. Not an argument of the
    #: constructor, so ``dataclasses.replace`` drops it: an artifact altered after it was
    #: found (its bytes, metadata, signature, key or trust replaced) is checked in full.
    verdict: str | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def found(cls, verdict: str, **fields: Any) -> Artifact:
        """An artifact as the check that found it usable left it, with that check's ``verdict``
        (what :meth:`check`, and so ``load()``, accepts without checking again)."""
        art = cls(**fields)
        object.__setattr__(art, "verdict", verdict)  # a frozen field set once, where it is made
        return art

    @property
    def path(self) -> Path:
        """A file holding exactly the checked bytes (read-only; copy it to modify it).

        The blob in the node-local tier when that tier is this user's own and the file is
        the one verified; otherwise (a kernel held in a pack, a shared tier whose files
        others could rewrite after the check) a file written from the checked bytes into
        this user's private tier, when this is first asked for (most callers only read
        ``data``).
        """
        if self.materialize is not None:
            return Path(self.materialize(self.digest, self.data))
        return Path(self.blob_path)

    @property
    def outcome(self) -> Outcome:
        """The audit word for how it was obtained: ``local_hit``, ``hit``, ``compiled``, ``waited``."""
        return _OUTCOMES[self.origin]

    def found_in(self, origin: ArtifactOrigin) -> Artifact:
        """The same artifact, as found in ``origin`` (a copy; the bytes are shared)."""
        # A shallow copy of the fields, not dataclasses.replace (which runs __init__ and its
        # frozen setattr per field): this runs on every node-tier hit, where 2 us show.
        copy = object.__new__(Artifact)
        vars(copy).update(vars(self), origin=origin)
        return copy

    @property
    def lowered_names(self) -> dict[str, str]:
        """Name expression (``add<float, 256>``) -> mangled symbol, as NVRTC lowered it."""
        return dict(self.metadata.lowered_names)

    @property
    def kind(self) -> str:
        """``cubin``, ``ptx`` or ``ltoir``."""
        return self.metadata.kind

    def check(self) -> None:
        """Refuse an artifact whose bytes or signature no longer hold (what loading runs first).

        An artifact as ``get`` found it is accepted on the verdict made then
        (:attr:`verdict`): one check, one verdict, so ``load()`` never refuses what
        ``get`` returned, and pays no second verification (a kernel's signature is
        verified once per file, not once per ``get`` and again per ``load``). Otherwise
        (built by hand, or altered after it was found with ``dataclasses.replace``: its
        metadata replaced, its bytes swapped, another ``trust``) the bytes must hash to the metadata's digest (DigestMismatchError), and a
        signature must verify for ``recipe_key`` -> ``metadata`` by a key trusted here
        (UntrustedArtifactError, naming the missing trust and the setting that gives it).
        """
        if self.verdict is not None:
            return
        actual = hashlib.sha256(self.data).hexdigest()
        if actual != self.metadata.digest or self.digest != self.metadata.digest:
            raise DigestMismatchError(self.blob_path, self.metadata.digest, actual)
        if self.signature is not None and self.trust is not None:
            problem = self.trust.entry_problem(self.recipe_key, self.metadata, self.signature)
            if problem is not None:
                raise UntrustedArtifactError(f"the artifact of recipe {self.recipe_key}", problem)

    def load_module(self, device: int | None = None) -> Any:
        """Load into ``device`` (default: the current one, else 0) and return cuda.core's ObjectCode.

        The stored lowered names are passed as the symbol mapping, so
        ``module.get_kernel("add<float, 256>")`` finds the mangled kernel. An artifact
        built for another architecture, or PTX newer than the driver, is refused first
        with :class:`~kcache_client.errors.ArchitectureMismatchError` (see
        :func:`check_loadable`); without a usable GPU (no driver, no such device) it is
        :class:`~kcache_client.errors.NoDeviceError`, one line.
        """
        self.check()
        core = _cuda_core()
        dev, capability = _device(core, device)
        unchecked = check_loadable(
            self.kind,
            self.data,
            self.metadata.target,
            capability,
            driver_version(),
            artifact=f"artifact {self.recipe_key[:16]} ({self.metadata.kernel or self.recipe.name})",
            device=f"the device (GPU {dev.device_id})",
        )
        if unchecked is not None:
            warnings.warn(unchecked, RuntimeWarning, stacklevel=3)
        dev.set_current()
        # cuda.core looks mangled names up as bytes (what NVRTC hands back), keys as given.
        mapping = {expr: mangled.encode() for expr, mangled in self.lowered_names.items()} or None
        name = self.metadata.kernel or self.recipe.name
        if self.kind == "cubin":
            return core.ObjectCode.from_cubin(self.data, name=name, symbol_mapping=mapping)
        if self.kind == "ptx":
            return core.ObjectCode.from_ptx(self.data, name=name, symbol_mapping=mapping)
        raise ValueError(
            f"a {self.kind} artifact cannot be loaded; link it into a cubin first (lto: true)"
        )

    def load(self, name: str | None = None, *, device: int | None = None) -> Any:
        """A launchable ``cuda.core`` Kernel.

        ``name`` is a name expression of the recipe (``add<float, 256>``) or an
        ``extern "C"`` kernel name; by default the recipe's only name expression, else
        the kernel the metadata names. Launch it with ``cuda.core.launch``.
        """
        if name is None:
            if len(self.recipe.name_expressions) > 1:
                raise ValueError(
                    f"the recipe has {len(self.recipe.name_expressions)} kernels; "
                    f"pass one of {list(self.recipe.name_expressions)} to load()"
                )
            name = (
                self.recipe.name_expressions[0]
                if self.recipe.name_expressions
                else self.metadata.kernel
            )
        return self.load_module(device).get_kernel(name)


def _base_key(self: Artifact) -> str:
    known: str = self.__dict__.get("_base_key", "")
    if not known:
        known = self.recipe.base_key()
        self.__dict__["_base_key"] = known  # frozen fields stay; this is a memo of one
    return known


def _set_base_key(self: Artifact, value: str) -> None:
    self.__dict__["_base_key"] = value  # what the dataclass's __init__ sets


# ``base_key`` stays a field (the constructor, replace(), equality and repr see it) whose
# value, when given as "", is the recipe's own, computed on first read.
Artifact.base_key = property(_base_key, _set_base_key)  # type: ignore[assignment]
