"""Validation of cubins before they are published: ELF, EM_CUDA, and the target's SM."""

from __future__ import annotations

import struct

from kcache.errors import InvalidArtifactError
from kcache.targets import Target

__all__ = ["EM_CUDA", "cubin_sm", "validate_cubin"]

EM_CUDA = 190
_ELF_MAGIC = b"\x7fELF"
_ELFCLASS64 = 2
_MIN_HEADER = 64


def cubin_sm(data: bytes) -> int:
    """Return the SM a cubin was built for, or raise :class:`InvalidArtifactError`."""
    if len(data) < _MIN_HEADER or data[:4] != _ELF_MAGIC:
        raise InvalidArtifactError("not an ELF file (bad magic or shorter than an ELF header)")
    if data[4] != _ELFCLASS64:
        raise InvalidArtifactError(f"ELF class {data[4]} is not ELFCLASS64")
    (machine,) = struct.unpack_from("<H", data, 18)
    if machine != EM_CUDA:
        raise InvalidArtifactError(f"e_machine is {machine}, not EM_CUDA ({EM_CUDA})")
    flags: int = struct.unpack_from("<I", data, 48)[0]
    abi_version = data[8]
    # CUDA ABI version 8 moved the SM to bits 8-15; older cubins keep it in bits 0-7.
    return (flags >> 8) & 0xFF if abi_version >= 8 else flags & 0xFF


def validate_cubin(data: bytes, target: Target) -> None:
    """Raise :class:`InvalidArtifactError` unless ``data`` is a cubin for ``target``'s SM.

    ``sm_90a`` and ``sm_90`` share ``e_flags``' SM field, so both check against 90.
    """
    sm = cubin_sm(data)
    if sm != target.sm:
        raise InvalidArtifactError(f"cubin is for sm_{sm}, but the target is {target.text}")
