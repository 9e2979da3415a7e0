"""OS confinement of compile workers with Landlock, and their scrubbed environment.

A compile worker runs NVRTC over untrusted recipes. Our own checks (attribution of
every file in the dependency trace, proven complete, see :mod:`kcache.deps`) refuse a
recipe that read a file outside its inputs, but NVRTC has already opened the file by
then. Landlock makes the kernel refuse the open itself: after :func:`confine`, the
process may read only the toolchain tree, the registered include-set roots and what the
interpreter imports, and may write only its scratch directory.
A host file outside those roots cannot be opened at all (``EACCES``), so NVRTC reports
"cannot open source file" exactly as for a file that does not exist: no content, and
no existence oracle through ``__has_include`` (NVRTC answers it by opening the file,
checked with strace). ``/proc`` is not granted, so ``/proc/self/environ`` and
``/proc/self/mem`` cannot be read either. Where the ABI allows, TCP bind/connect
(ABI 4), abstract unix sockets and signals to processes outside the domain (ABI 6)
are denied too: a compile needs none of them.

Why direct syscalls through ctypes and not a PyPI package: the kernel interface is
three system calls and two small structures; the packages that wrap it (``landlock``,
``landlockpy``, ``py-landlock``) are young, pre-1.0 or dev releases, and the core keeps
its dependencies to filelock and the NVIDIA wheels. A security control should be short
enough to audit in-tree and be exercised by our own tests against the real kernel.
The syscall numbers 444-446 are the same on every Linux architecture (they were
allocated after the tables were unified).

Landlock confines the calling thread and what it starts later, so :func:`confine` must
run while the process has a single thread; it checks ``/proc/self/task`` and says why
when it cannot confine. It is irreversible, and so only for a dedicated worker process.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kcache.include_sets import IncludeSets
from kcache.toolchain import Toolchain

__all__ = [
    "SandboxPolicy",
    "SandboxStatus",
    "compile_policy",
    "confine",
    "interpreter_paths",
    "landlock_abi",
    "probe",
    "scrubbed_environment",
]

_SYS_CREATE_RULESET = 444
_SYS_ADD_RULE = 445
_SYS_RESTRICT_SELF = 446
_PR_SET_NO_NEW_PRIVS = 38
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1

# Filesystem access rights, by the ABI that introduced them.
_EXECUTE = 1 << 0
_WRITE_FILE = 1 << 1
_READ_FILE = 1 << 2
_READ_DIR = 1 << 3
_REMOVE_DIR = 1 << 4
_REMOVE_FILE = 1 << 5
_MAKE_CHAR = 1 << 6
_MAKE_DIR = 1 << 7
_MAKE_REG = 1 << 8
_MAKE_SOCK = 1 << 9
_MAKE_FIFO = 1 << 10
_MAKE_BLOCK = 1 << 11
_MAKE_SYM = 1 << 12
_REFER = 1 << 13  # ABI 2
_TRUNCATE = 1 << 14  # ABI 3
_IOCTL_DEV = 1 << 15  # ABI 5
_ABI1_FS = (1 << 13) - 1
_NET_BIND_TCP = 1 << 0  # ABI 4
_NET_CONNECT_TCP = 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
_SCOPE_SIGNAL = 1 << 1

_FILE_RIGHTS = _EXECUTE | _WRITE_FILE | _READ_FILE | _TRUNCATE | _IOCTL_DEV
_READ_ONLY = _EXECUTE | _READ_FILE | _READ_DIR
_READ_WRITE = (
    _READ_ONLY
    | _WRITE_FILE
    | _REMOVE_DIR
    | _REMOVE_FILE
    | _MAKE_DIR
    | _MAKE_REG
    | _MAKE_SYM
    | _REFER
    | _TRUNCATE
)

#: Environment variables a worker keeps: the locale, and where the NVIDIA libraries may be
#: found (so the worker loads the toolchain the server loaded). None can carry a secret.
_KEPT_ENV = ("LANG", "LC_ALL", "LC_CTYPE", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # the kernel's struct is __attribute__((packed)): 12 bytes
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


@dataclass(frozen=True)
class SandboxStatus:
    """Whether a process is confined, the Landlock ABI, and a sentence saying which or why not."""

    active: bool
    abi: int
    detail: str

    def to_dict(self) -> dict[str, object]:
        """JSON form (what a worker reports to its parent)."""
        return {"active": self.active, "abi": self.abi, "detail": self.detail}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> SandboxStatus:
        """Inverse of :meth:`to_dict`."""
        abi = data.get("abi", 0)
        return cls(
            bool(data.get("active")), abi if isinstance(abi, int) else 0, str(data.get("detail"))
        )


@dataclass(frozen=True)
class SandboxPolicy:
    """What a confined process may touch: trees it may read, trees it may also write."""

    read_only: tuple[Path, ...] = ()
    read_write: tuple[Path, ...] = ()


def _libc() -> ctypes.CDLL:
    # The interpreter's own symbols include libc's syscall() and prctl(); no library search.
    return ctypes.CDLL(None, use_errno=True)


def _syscall(libc: ctypes.CDLL, number: int, *args: object) -> int:
    result = int(libc.syscall(ctypes.c_long(number), *args))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


def landlock_abi() -> tuple[int, str]:
    """The kernel's Landlock ABI version (0 when unusable) and, when 0, the reason."""
    if not sys.platform.startswith("linux"):
        return 0, f"Landlock is a Linux feature; this is {sys.platform}"
    try:
        libc = _libc()
        abi = _syscall(libc, _SYS_CREATE_RULESET, None, ctypes.c_size_t(0), _CREATE_RULESET_VERSION)
    except OSError as exc:
        reasons = {
            errno.ENOSYS: "the kernel has no Landlock system calls (Linux >= 5.13 is needed)",
            errno.EOPNOTSUPP: "Landlock is built but not enabled (add landlock to the lsm= boot list)",
            errno.EPERM: "the Landlock system calls are blocked here (a seccomp filter?)",
        }
        return 0, reasons.get(exc.errno or 0, f"Landlock is unavailable: {exc}")
    return abi, ""


def probe() -> SandboxStatus:
    """Whether a worker started now could be confined (nothing is restricted by asking)."""
    abi, why = landlock_abi()
    if abi <= 0:
        return SandboxStatus(False, 0, why)
    return SandboxStatus(False, abi, f"Landlock ABI {abi} is available")


def interpreter_paths() -> list[Path]:
    """What this interpreter reads after start-up: its stdlib and the packages it has imported.

    Only the top-level directories of imported packages are listed (not every
    ``sys.path`` entry: an editable install puts a whole checkout there), plus the
    stdlib and its extension modules, which are loaded lazily.
    """
    # The base interpreter's stdlib (lib-dynload is below it), not the venv's lib
    # directory, which sysconfig's "platstdlib" names and which holds site-packages.
    paths: set[Path] = {Path(os.__file__).parent}
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        if not isinstance(name, str) or "." in name:
            continue  # a submodule lives under its top-level package
        package_path = getattr(module, "__path__", None)
        origin = getattr(module, "__file__", None)
        if package_path is not None:  # namespace packages (cuda, nvidia) have no __file__
            paths.update(Path(p) for p in package_path)
        elif origin:
            paths.add(Path(origin))  # a top-level single-file module or extension
    return sorted(paths)


def compile_policy(toolchain: Toolchain, include_sets: IncludeSets, scratch: Path) -> SandboxPolicy:
    """What a compile worker may touch once it has loaded and warmed up its toolchain.

    Read: the bundled headers, the NVIDIA library directories (for a library loaded
    late), every registered include-set root (a recipe names its sets per request) and
    :func:`interpreter_paths`. Read and write: ``scratch``. Nothing else: not ``/etc``,
    not ``/proc`` (no ``/proc/self/environ``), not ``/dev``, not the system library
    directories. That is the minimal set found with the real worker: the shared
    libraries are mapped before confinement, and Landlock does not revoke open files or
    mappings. The data directory, the database and the server's configuration are out
    of reach.
    """
    read_only = [
        toolchain.include_dir,
        *dict.fromkeys(library.parent for library in toolchain.libraries),
        *(Path(root) for root in include_sets.as_mapping().values()),
        *interpreter_paths(),
    ]
    return SandboxPolicy(read_only=tuple(read_only), read_write=(scratch,))


def _open_path(path: Path) -> int | None:
    try:
        return os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None  # a path that does not exist here needs no rule


def confine(policy: SandboxPolicy) -> SandboxStatus:
    """Restrict this process to ``policy`` with Landlock, irreversibly.

    Returns the status; never raises for an unavailable Landlock (the caller decides
    whether running unconfined is acceptable). Refuses (inactive status) when the
    process has more than one thread, since the others would stay unconfined.
    """
    abi, why = landlock_abi()
    if abi <= 0:
        return SandboxStatus(False, 0, why)
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        threads = 1
    if threads != 1:
        return SandboxStatus(
            False, abi, f"not confined: the process has {threads} threads and Landlock binds one"
        )
    handled_fs = _ABI1_FS
    if abi >= 2:
        handled_fs |= _REFER
    if abi >= 3:
        handled_fs |= _TRUNCATE
    if abi >= 5:
        handled_fs |= _IOCTL_DEV
    attr = _RulesetAttr(
        handled_access_fs=handled_fs,
        handled_access_net=(_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0,
        scoped=(_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL) if abi >= 6 else 0,
    )
    # Older kernels reject a struct larger than they know: pass only the fields of this ABI.
    size = 8 if abi < 4 else (16 if abi < 6 else ctypes.sizeof(_RulesetAttr))
    libc = _libc()
    try:
        ruleset = _syscall(libc, _SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0)
    except OSError as exc:
        return SandboxStatus(False, abi, f"not confined: landlock_create_ruleset failed: {exc}")
    try:
        grants = [(p, _READ_ONLY) for p in policy.read_only]
        grants += [(p, _READ_WRITE) for p in policy.read_write]
        for path, access in grants:
            fd = _open_path(path)
            if fd is None:
                continue
            try:
                allowed = access & handled_fs
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    allowed &= _FILE_RIGHTS  # a rule on a file takes file rights only
                rule = _PathBeneathAttr(allowed_access=allowed, parent_fd=fd)
                _syscall(libc, _SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0)
            finally:
                os.close(fd)
        if int(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) != 0:
            code = ctypes.get_errno()
            return SandboxStatus(
                False, abi, f"not confined: PR_SET_NO_NEW_PRIVS failed: {os.strerror(code)}"
            )
        _syscall(libc, _SYS_RESTRICT_SELF, ruleset, 0)
    except OSError as exc:
        return SandboxStatus(False, abi, f"not confined: {exc}")
    finally:
        os.close(ruleset)
    return SandboxStatus(True, abi, f"confined by Landlock ABI {abi}")


def scrubbed_environment(scratch: Path, keep: Iterable[str] = _KEPT_ENV) -> dict[str, str]:
    """The environment a compile worker is started with: locale, a fixed PATH, TMPDIR=scratch.

    Everything else (``KCACHE_*``, database URLs, tokens, cloud credentials, ``HOME``)
    is left out, so neither ``os.environ`` nor ``/proc/self/environ`` of the worker holds it.
    """
    env = {name: os.environ[name] for name in keep if name in os.environ}
    env.update(PATH="/usr/bin:/bin", TMPDIR=str(scratch), PYTHONNOUSERSITE="1")
    return env
