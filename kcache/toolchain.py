"""The toolchain: NVRTC and nvJitLink from the NVIDIA wheels, and NVRTC's bundled headers.

A toolchain id names everything outside the recipe that can change the output: the
NVRTC and nvJitLink versions, a hash of their shared libraries, and a hash of the
bundled header tree that compiles include (``cuda_fp16.h``, ``cuda/std``, ``cub``).
The headers are extracted once per toolchain into a cache directory, atomically.

NVRTC must be 13.3 or later (its bundled headers); nvJitLink may be any CUDA 13 release.
An older nvJitLink beside a newer NVRTC is what an image with torch's pinned CUDA wheels
gets (torch 2.11 pins nvJitLink 13.0, compiling needs NVRTC >= 13.3): it cannot link the
newer NVRTC's LTO-IR, so such a toolchain compiles every recipe except LTO ones
(``lto: true``), which :meth:`Toolchain.check` refuses by name with the pip command that
fixes it (:func:`nvjitlink_install_advice`). Nothing else here uses nvJitLink.
A server needs no compiler to serve what is already compiled: :func:`probe_toolchain`
gives it a toolchain that compiles nothing and says why (:attr:`Toolchain.cannot_compile`)
where :func:`load_toolchain` would raise (an NVRTC older than 13.3, none at all).
:func:`toolchain_id` gives the id alone, from what the last load wrote down
(:mod:`kcache.toolchain_memo`) while that still holds, without loading anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from kcache import toolchain_memo
from kcache.dirs import toolchain_dir
from kcache.errors import RecipeError, ToolchainAbsentError, ToolchainError

if TYPE_CHECKING:
    from kcache.recipe import Recipe

__all__ = [
    "Toolchain",
    "load_toolchain",
    "nvjitlink_install_advice",
    "nvrtc_install_advice",
    "probe_toolchain",
    "toolchain_id",
]

# The first NVRTC (and cuda-bindings) with nvrtcInstallBundledHeaders, whose headers every
# compile includes; the core's `nvrtc` extra asks for at least this.
_BUNDLED_HEADERS_SINCE = "13.3"


@dataclass(frozen=True)
class Toolchain:
    """A concrete, prepared NVRTC + nvJitLink toolchain."""

    id: str
    nvrtc_version: str
    nvjitlink_version: str
    include_dir: Path  # bundled headers, passed as -I along with include_dir / "cccl"
    supported_sms: tuple[int, ...]
    libraries: tuple[Path, ...]
    #: Why this toolchain compiles nothing (the installed NVRTC, the one needed, the pip
    #: command); empty for a toolchain that compiles. See :meth:`absent`.
    cannot_compile: str = ""

    @classmethod
    def absent(cls, reason: str, nvrtc_version: str = "") -> Toolchain:
        """The toolchain of a process that cannot compile, ``reason`` saying why.

        It has no id (no headers were extracted, so there is nothing to hash), no
        targets and no libraries: a server holding it serves what others compiled.
        """
        return cls(
            id="",
            nvrtc_version=nvrtc_version,
            nvjitlink_version="",
            include_dir=Path(),
            supported_sms=(),
            libraries=(),
            cannot_compile=reason,
        )

    @property
    def compiles(self) -> bool:
        """False for a toolchain that compiles nothing (:attr:`cannot_compile` says why)."""
        return not self.cannot_compile

    @property
    def include_flags(self) -> list[str]:
        """The ``-I`` options for the bundled headers (and nothing else)."""
        return [f"-I{self.include_dir}", f"-I{self.include_dir / 'cccl'}"]

    def supports(self, sm: int) -> bool:
        """True when NVRTC of this toolchain can target ``sm``."""
        return sm in self.supported_sms

    @property
    def links_lto(self) -> bool:
        """True when nvJitLink here can link NVRTC's LTO-IR: it is at least as new as NVRTC.

        nvJitLink refuses LTO-IR from a newer NVRTC (``ERROR_OUTDATED_LIBRARY``); cubins
        and PTX never reach nvJitLink, so only ``lto`` recipes depend on this.
        """
        return _release(self.nvjitlink_version) >= _release(self.nvrtc_version)

    def check(self, recipe: Recipe, side: str = "here", where: str = "") -> None:
        """Refuse (:class:`RecipeError`) a recipe this toolchain cannot compile, and its linked recipes.

        A recipe names this toolchain's id (prepared recipes always name one) and a
        target its NVRTC compiles for. ``side`` says where, in the message ("here",
        "on this server"); ``where`` prefixes the field of a linked recipe
        (``link[0].recipe.target``).
        """
        if not self.compiles:
            raise ToolchainError(self.cannot_compile)
        if recipe.toolchain != self.id:
            raise RecipeError(
                f"{where}toolchain",
                f"{recipe.toolchain!r} is not available {side}, which has {self.id!r} "
                "(omit the field to use that default)",
            )
        target = recipe.parsed_target
        if not self.supports(target.sm):
            supported = ", ".join(f"sm_{sm}" for sm in self.supported_sms)
            raise RecipeError(
                f"{where}target",
                f"{target.text} is not supported by NVRTC {self.nvrtc_version} {side} ({supported})",
            )
        if recipe.lto and not self.links_lto:
            raise RecipeError(
                f"{where}lto",
                f"LTO recipes are not compiled {side}: nvJitLink {self.nvjitlink_version} is "
                f"older than NVRTC {self.nvrtc_version} and cannot link its LTO-IR (recipes "
                "without lto compile as usual); "
                f"{nvjitlink_install_advice(self.nvrtc_version)}",
            )
        for i, item in enumerate(recipe.link):
            if item.recipe is not None:
                self.check(item.recipe, side, f"{where}link[{i}].recipe.")

    def describe(self) -> dict[str, object]:
        """A JSON-able summary (what ``GET /v1/toolchains`` lists)."""
        return {
            "id": self.id,
            "nvrtc_version": self.nvrtc_version,
            "nvjitlink_version": self.nvjitlink_version,
            "targets": [f"sm_{sm}" for sm in self.supported_sms],
        }


def _release(version: str) -> tuple[int, ...]:
    """``"13.5"`` -> ``(13, 5)``, for comparing the versions the libraries report."""
    return tuple(int(part) for part in version.split("."))


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _library_hash(paths: list[Path], root: Path) -> str:
    """Hash of the libraries' bytes, memoised on disk by (path, size, mtime, inode)."""
    stamp_file = root / "library-hashes.json"
    try:
        stamps: dict[str, str] = json.loads(stamp_file.read_text())
    except (OSError, ValueError):
        stamps = {}
    combined = hashlib.sha256()
    changed = False
    for path in paths:
        st = path.stat()
        stamp = f"{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
        if stamp not in stamps:
            stamps[stamp] = _file_sha256(path)
            changed = True
        combined.update(f"{path.name}:{stamps[stamp]}\n".encode())
    if changed:
        from kcache.fsutil import atomic_write

        root.mkdir(parents=True, exist_ok=True)
        atomic_write(stamp_file, json.dumps(stamps, indent=0).encode())
    return combined.hexdigest()


def _tree_hash(root: Path) -> str:
    combined = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")):
        combined.update(f"{path.relative_to(root).as_posix()}:{_file_sha256(path)}\n".encode())
    return combined.hexdigest()


def nvrtc_install_advice() -> str:
    """The pip command that installs the NVRTC and nvJitLink this kcache compiles with.

    It names this kcache's own version, so pip adds the wheels of its ``nvrtc`` extra
    (upgrading an older NVRTC or cuda-bindings in place, keeping a CUDA 13 nvJitLink) and
    keeps the kcache that is installed. ``kcache-client[compile]`` is the same set of wheels.
    """
    from kcache._version import CORE_DISTRIBUTION, __version__

    return f"pip install '{CORE_DISTRIBUTION}[nvrtc]=={__version__}'"


def nvjitlink_install_advice(nvrtc_version: str) -> str:
    """The pip command that installs an nvJitLink able to link NVRTC ``nvrtc_version``'s LTO-IR.

    At least NVRTC's release, within its CUDA major (the libraries' soname). In an image
    whose torch pins an older nvJitLink, pip then says that torch asked for another one;
    nvJitLink reads what older releases wrote, so torch's own links keep working.
    """
    major = _release(nvrtc_version)[0]
    return f"pip install 'nvidia-nvjitlink>={nvrtc_version},<{major + 1}'"


def _check(result: tuple[object, ...], what: str) -> tuple[object, ...]:
    from cuda.bindings import nvrtc

    if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise ToolchainError(f"{what} failed: {result[0]!r}")
    return result


def _too_old_reason(nvrtc_version: str, found: str) -> str | None:
    """Why NVRTC ``nvrtc_version`` (``found`` names it and its library) cannot compile here,
    with the fix; None when it is new enough."""
    if _release(nvrtc_version) >= _release(_BUNDLED_HEADERS_SINCE):
        return None
    return (
        f"{found} is older than {_BUNDLED_HEADERS_SINCE}, the first NVRTC with the bundled "
        "headers kcache compiles with (cuda_fp16.h, cuda/std, cub); install NVRTC "
        f"{_BUNDLED_HEADERS_SINCE} or later: {nvrtc_install_advice()}"
    )


def _install_headers(dest: Path, found: str, nvrtc_version: str) -> str:
    """Extract NVRTC's bundled headers into ``dest`` once; return the tree hash.

    ``found`` names the NVRTC loaded (version and library), for the error when it has none.
    A tree already there is taken whatever the version (a header directory filled by
    hand for an older NVRTC); an NVRTC older than 13.3 has none to extract.
    """
    import filelock
    from cuda.bindings import nvrtc

    marker = dest / "tree.sha256"
    if marker.exists():
        return marker.read_text().strip()
    too_old = _too_old_reason(nvrtc_version, found)
    if too_old is not None:
        raise ToolchainError(too_old)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # The lock only saves duplicate extraction; the rename below is what makes it safe.
    with filelock.FileLock(str(dest) + ".lock", timeout=600):
        if marker.exists():
            return marker.read_text().strip()
        staging = dest.parent / f".staging-{dest.name}-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            result = nvrtc.nvrtcInstallBundledHeaders(str(staging / "include").encode(), 0)
        except Exception as exc:  # cuda-bindings raises its own type when the symbol is absent
            # Either this NVRTC predates the call or the installed cuda-bindings does.
            raise ToolchainError(
                f"{found} has no bundled headers (nvrtcInstallBundledHeaders needs NVRTC and "
                f"cuda-bindings >= {_BUNDLED_HEADERS_SINCE}), so kcache cannot compile with it; "
                f"install the NVRTC and nvJitLink wheels: {nvrtc_install_advice()}"
            ) from exc
        _check(result, "nvrtcInstallBundledHeaders")
        tree = _tree_hash(staging / "include")
        (staging / "tree.sha256").write_text(tree + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(staging, dest)
        return tree


@lru_cache(maxsize=4)
def load_toolchain(root: Path | None = None) -> Toolchain:
    """Find NVRTC and nvJitLink, hash them, extract the bundled headers; cached per root."""
    try:
        from cuda.bindings import nvjitlink, nvrtc
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError as exc:
        raise ToolchainAbsentError(
            f"compiling needs NVRTC and nvJitLink through cuda-bindings ({exc}): "
            f"{nvrtc_install_advice()}"
        ) from exc
    root = root or toolchain_dir()
    try:
        located = [load_nvidia_dynamic_lib("nvrtc"), load_nvidia_dynamic_lib("nvJitLink")]
    except Exception as exc:  # pathfinder raises several unrelated types
        raise ToolchainAbsentError(
            f"cannot locate the NVRTC/nvJitLink libraries ({exc}): {nvrtc_install_advice()}"
        ) from exc
    nvrtc_lib, jitlink_lib = (Path(lib.abs_path) for lib in located)
    builtins = sorted(nvrtc_lib.parent.glob("libnvrtc-builtins.so*"))
    libraries = [nvrtc_lib, jitlink_lib, *builtins[-1:]]
    stamped = toolchain_memo.stamp(libraries)  # before hashing: see kcache.toolchain_memo
    _, major, minor = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    nvrtc_version = f"{major}.{minor}"
    jl_major, jl_minor = nvjitlink.version()
    nvjitlink_version = f"{jl_major}.{jl_minor}"
    # An nvJitLink older than NVRTC is kept: it links no LTO-IR of this NVRTC, and
    # Toolchain.check refuses exactly the recipes that would need it (lto), by name.
    lib_hash = _library_hash(libraries, root)
    include_root = root / f"nvrtc{nvrtc_version}-{lib_hash[:16]}"
    tree = _install_headers(include_root, f"NVRTC {nvrtc_version} ({nvrtc_lib})", nvrtc_version)
    combined = hashlib.sha256(f"{lib_hash}\n{tree}\n".encode()).hexdigest()
    (_, archs) = _check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    toolchain = Toolchain(
        id=f"nvrtc{nvrtc_version}-nvjitlink{nvjitlink_version}-{combined[:16]}",
        nvrtc_version=nvrtc_version,
        nvjitlink_version=nvjitlink_version,
        include_dir=include_root / "include",
        supported_sms=tuple(int(a) for a in archs),  # type: ignore[attr-defined]
        libraries=tuple(libraries),
    )
    searched = all(
        lib.found_via in toolchain_memo.SEARCHED and not lib.was_already_loaded_from_elsewhere
        for lib in located
    )
    if searched and toolchain_memo.recall(root) != toolchain.id:
        toolchain_memo.remember(
            root, toolchain.id, libraries, stamped, include_root / "tree.sha256"
        )
    return toolchain


def probe_toolchain(root: Path | None = None) -> Toolchain:
    """:func:`load_toolchain`, or where it cannot load, a toolchain that compiles nothing.

    The one place a process learns that it cannot compile: an NVRTC older than 13.3, no
    NVRTC or nvJitLink at all, or one that fails to answer are the same outcome here,
    :meth:`Toolchain.absent` with :func:`load_toolchain`'s reason (which names the NVRTC
    found, the release needed and the pip command). For a server, which serves fetches
    without a compiler; a client compiling locally calls :func:`load_toolchain` and
    gets the error.
    """
    try:
        return load_toolchain(root)
    except ToolchainError as exc:
        return Toolchain.absent(str(exc), _nvrtc_version_or_empty())


def _nvrtc_version_or_empty() -> str:
    """The loadable NVRTC's ``major.minor``, or "" where there is none."""
    try:
        from cuda.bindings import nvrtc

        result, major, minor = nvrtc.nvrtcVersion()
    except Exception:  # no cuda-bindings, no library: whatever the bindings raise
        return ""
    return f"{major}.{minor}" if result == nvrtc.nvrtcResult.NVRTC_SUCCESS else ""


def toolchain_id(root: Path | None = None) -> str:
    """The id :func:`load_toolchain` gives in a fresh process, without loading when it can.

    Remembered by the last load that found the libraries by cuda-pathfinder's search
    (:mod:`kcache.toolchain_memo`); loaded (and so remembered) when there is no such
    memo or it no longer matches the installed libraries. For a process that has not
    loaded NVRTC some other way (``kcache key``): the memo cannot see a library that
    something else already mapped into the process.
    """
    root = root or toolchain_dir()
    return toolchain_memo.recall(root) or load_toolchain(root).id
