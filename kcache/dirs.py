"""Where kcache keeps things by default, each overridable by one environment variable.

    cache directory     $KCACHE_CACHE_DIR      else <user cache>/kcache/client   (client commands)
    server data dir     $KCACHE_DATA_DIR       else ./.kcache                    (server commands)
    toolchains          $KCACHE_TOOLCHAIN_DIR  else <user cache>/kcache/toolchains

``<user cache>`` is ``$XDG_CACHE_HOME``, else ``~/.cache``.

The two kinds of directory never mix. The *cache directory* is the user's (and a
node's) own: the client's node tier and what ``kcache compile`` builds without a
server, indexed by JSON files under ``index/``. A *server data directory* belongs to
``kcache serve``: its blobs are indexed by a SQL database (``kcache.db`` beside them,
or PostgreSQL), and only server commands (``serve``, ``db``, ``token``) write it.
:func:`directory_kind` tells them apart, so maintenance commands can do the right
thing with whichever they are given.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path
from typing import Literal

from kcache.errors import KCacheError, StoreFullError

__all__ = [
    "CACHE_TAG_FILE",
    "LAYOUT_FILE",
    "SERVER_DATABASE_FILE",
    "absolute_path",
    "cache_dir",
    "cache_layout",
    "damaged_cache_dir_message",
    "data_dir",
    "directory_kind",
    "file_in_the_way",
    "full_cache_dir_message",
    "is_kcache_cache_dir",
    "mark_cache_dir",
    "toolchain_dir",
    "unusable_cache_dir_message",
    "user_cache_dir",
]

#: The SQLite database a server keeps in its data directory (its index, unless PostgreSQL).
SERVER_DATABASE_FILE = "kcache.db"

DirectoryKind = Literal["cache", "server", "absent"]
#: How a cache directory lays out its files (:func:`cache_layout`).
CacheLayout = Literal["flat", "fanout"]

#: Names a cache directory's layout; written when this release creates the directory.
LAYOUT_FILE = "LAYOUT"
_LAYOUTS: tuple[CacheLayout, ...] = ("flat", "fanout")
#: The way out of a cache directory that cannot be used as it is.
_OTHER_DIRECTORY = (
    "remove or repair it (the directory is a cache: its kernels are fetched or compiled again), "
    "or use another directory: --cache-dir DIR or KCACHE_CACHE_DIR (cache_dir= in Python)"
)
#: What a layout name looks like (a newer release's among them): anything else in the
#: file is damage (a crash, an editor), not a release this one does not know.
_LAYOUT_NAME = re.compile(r"[a-z][a-z0-9_.-]{0,31}")

#: Marks a cache directory (https://bford.info/cachedir/: backup tools skip it too).
CACHE_TAG_FILE = "CACHEDIR.TAG"
_CACHE_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file marks a kcache cache directory (the node tier and local compiles).\n"
)


def absolute_path(path: str | os.PathLike[str]) -> Path:
    """``path`` with ``~`` expanded, joined to the working directory if relative: fixed once,
    so a later ``os.chdir`` moves nothing. An absolute path is kept as it is (no ``..``
    resolved, no symlink followed)."""
    # Strings, one Path at the end: this runs in every process's KernelCache().
    text = os.path.expanduser(os.fspath(path))
    if not os.path.isabs(text):
        text = os.path.join(os.getcwd(), text)
    return Path(text)


def user_cache_dir(name: str, override_env: str | None = None) -> Path:
    """``$override_env`` if set, else ``<user cache>/kcache/<name>``; absolute, ``~`` expanded."""
    explicit = os.environ.get(override_env) if override_env else None
    if explicit:
        return absolute_path(explicit)
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return absolute_path(os.path.join(cache_home, "kcache", name))


def toolchain_dir() -> Path:
    """Where NVRTC's bundled headers are extracted, once per toolchain."""
    return user_cache_dir("toolchains", "KCACHE_TOOLCHAIN_DIR")


def cache_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The user's cache directory: ``explicit``, else ``$KCACHE_CACHE_DIR``, else ``~/.cache/kcache/client``.

    The client's node tier and local compiles share it, so what one command put there
    every other command (and every process of the node) finds. Absolute, ``~`` expanded
    (:func:`absolute_path`): a relative one is taken from the working directory now.
    """
    if explicit:
        return absolute_path(explicit)
    return user_cache_dir("client", "KCACHE_CACHE_DIR")


def data_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """A server's data directory: ``explicit``, else ``$KCACHE_DATA_DIR``, else ``./.kcache``."""
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("KCACHE_DATA_DIR") or ".kcache")


def full_cache_dir_message(path: str | os.PathLike[str], code: int, doing: str) -> str:
    """What to say when a write into the cache directory ``path`` failed with ``code``
    (``ENOSPC``, or ``EDQUOT`` for a spent quota) while ``doing`` something: the directory
    (absolute) and every way out."""
    what = "the disk quota is spent" if code == errno.EDQUOT else "its filesystem has no space left"
    return (
        f"cannot write into the cache directory {os.path.abspath(path)}: {what} ({doing}). Free "
        "space there, remove entries with `kcache cache clear` (or `kcache cache rm KEY`), cap "
        "its size with KCACHE_CACHE_MAX_BYTES, or use another directory: --cache-dir DIR or "
        "KCACHE_CACHE_DIR (cache_dir= in Python)"
    )


def is_kcache_cache_dir(path: Path) -> bool:
    """Whether ``path`` is a kcache cache directory (its ``CACHEDIR.TAG`` is kcache's).

    Such a directory is never part of an include set (kcache.include_sets): a node tier or
    local cache kept under a project's directory changes with every lookup (lock files,
    statistics, spooled events) and holds no header anyone includes.
    """
    try:
        with open(path / CACHE_TAG_FILE, "rb") as tag:
            return tag.read(len(_CACHE_TAG) + 1) == _CACHE_TAG.encode()
    except OSError:
        return False


def mark_cache_dir(root: Path) -> None:
    """Create ``root`` as a cache directory: the tag is written before any blob can be, so
    :func:`directory_kind` never mistakes a cache that is being filled for a server's."""
    if os.path.exists(f"{root}/{CACHE_TAG_FILE}"):
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as exc:
        raise unusable_cache_dir(root, exc, "creating it") from None
    _write_marker(root, CACHE_TAG_FILE, _CACHE_TAG)


def unusable_cache_dir_message(path: str | os.PathLike[str], problem: str) -> str:
    """What to say when the cache directory ``path`` cannot be used because of ``problem``:
    the directory and the ways out (another directory, or a read-only copy as a layer)."""
    return (
        f"cannot use the cache directory {path}: {problem}. Use a directory this user can "
        "write: --cache-dir DIR or KCACHE_CACHE_DIR (cache_dir= in Python); a read-only copy of "
        "a cache can still be read, named in KCACHE_CACHE_LAYERS above a writable cache directory"
    )


def unusable_cache_dir(
    root: str | os.PathLike[str], exc: OSError | ValueError, doing: str
) -> KCacheError:
    """The :class:`KCacheError` for an ``exc`` met while ``doing`` something in the cache
    directory ``root``; a full disk (``ENOSPC``, ``EDQUOT``) stays a :class:`StoreFullError`."""
    code = getattr(exc, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        full = StoreFullError(full_cache_dir_message(root, code, doing))
        full.errno = code  # one argument: the message alone, without "[Errno 28]"
        return full
    path = os.fspath(root)
    if isinstance(exc, ValueError):  # the only one os calls raise for a path: a NUL in it
        problem = "its path holds a NUL character"
    elif code in (errno.EEXIST, errno.ENOTDIR):
        problem = _not_a_directory(path)
    elif code == errno.EROFS:
        problem = f"it is on a read-only filesystem ({doing})"
    elif code in (errno.EACCES, errno.EPERM):
        problem = f"this user may not write there ({doing}: {exc.strerror or exc})"
    elif code == errno.ENAMETOOLONG:
        problem = "its path is too long"
    else:
        problem = f"{doing}: {exc.strerror or exc}"
    return KCacheError(unusable_cache_dir_message(path, problem))


def _not_a_directory(path: str) -> str:
    """Which part of ``path`` is a file rather than a directory, in words."""
    culprit = file_in_the_way(path)
    if culprit == path:
        return "it is a file, not a directory"
    if culprit is not None:
        return f"{culprit} is a file, not a directory"
    return "a part of its path is a file, not a directory"


def file_in_the_way(path: str) -> str | None:
    """``path``, or the first directory above it, that is something other than a directory
    (what an ``ENOTDIR`` or ``EEXIST`` met there stands for); None when there is none."""
    place = path
    while place and place != os.path.dirname(place):
        if os.path.lexists(place) and not os.path.isdir(place):
            return place
        place = os.path.dirname(place)
    return None


def damaged_cache_dir_message(root: str | os.PathLike[str], failed: str) -> str:
    """What to say of the cache directory ``root`` with a file where it keeps a directory
    (``failed``, or a directory above it, met as ``ENOTDIR``): which file, and the ways out."""
    culprit = file_in_the_way(failed) or failed
    return (
        f"cannot use the cache directory {root}: {culprit} is a file where the cache keeps a "
        "directory (damaged): remove that file, or the whole directory (a cache: its kernels "
        "are fetched or compiled again), or use another one: --cache-dir DIR or "
        "KCACHE_CACHE_DIR (cache_dir= in Python)"
    )


def _write_marker(root: Path, name: str, text: str) -> None:
    """Write ``root/name`` (concurrent creators write the same bytes); a full disk is a
    :class:`StoreFullError` naming the directory and the fix, not a bare ``ENOSPC``, and
    any other failure (a read-only filesystem, no permission) a :class:`KCacheError` saying
    the same (:func:`unusable_cache_dir`)."""
    staging = root / f".{name}.{os.getpid()}"
    try:
        staging.write_text(text)
        os.replace(staging, root / name)
    except (OSError, ValueError) as exc:
        with contextlib.suppress(OSError, ValueError):
            staging.unlink(missing_ok=True)
        raise unusable_cache_dir(root, exc, f"creating its {name}") from None


def directory_kind(root: Path) -> DirectoryKind:
    """``server`` for a server's data directory, ``cache`` for a cache directory, ``absent``.

    A server's directory has its SQLite index (``kcache.db``) or, with PostgreSQL,
    blobs and neither a cache tag nor a JSON index beside them; anything else that
    exists is a cache directory (possibly still empty). The tag matters while a new
    cache is being filled: its first blob lands before its first index file.
    """
    if not root.is_dir():
        return "absent"
    if (root / SERVER_DATABASE_FILE).exists():
        return "server"
    if (root / CACHE_TAG_FILE).exists() or (root / "index").is_dir():
        return "cache"
    if (root / "blobs").is_dir():
        return "server"
    return "cache"


def cache_layout(root: Path) -> CacheLayout:
    """How the cache directory ``root`` lays out its blobs and index files.

    ``flat`` (``blobs/<digest>``, ``index/recipes/<key>.json``, ...) for a directory this
    release created, named by its :data:`LAYOUT_FILE`; ``fanout`` (``blobs/ab/cd/<digest>``,
    ``index/recipes/ab/<key>.json``) for one an earlier release filled, which has
    blobs or an index and no such file. A new (or empty) directory gets the file
    before anything else is written there, so a process that sees its blobs or index
    also sees the file. Why flat: a cold node tier created a fan-out directory for
    almost every file it published, and on the benchmark machine's ext4 creating an
    inode (a file or a directory) cost 0.1-0.7 ms of CPU; hashed directories (ext4,
    XFS, btrfs) look a name up as fast among 100k entries as among 100.

    A directory written by several releases at once stays correct: each reads and
    writes its own layout (an older release does not see the flat files, and fetches
    or compiles again), so at worst a kernel is stored twice, and each release's
    eviction counts only its own files against the cap.
    """
    marker = root / LAYOUT_FILE
    named = _read_marker(marker)
    if named is None:
        # A creator writes the file before blobs or an index, so blobs or an index seen
        # without it are an earlier release's: read again after looking (a creator may
        # have written both since the first read).
        filled = (root / "blobs").is_dir() or (root / "index").is_dir()
        named = _read_marker(marker)
        if named is None and filled:
            return "fanout"
    if named is None:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except (OSError, ValueError) as exc:
            raise unusable_cache_dir(root, exc, "creating it") from None
        _write_marker(root, LAYOUT_FILE, "flat\n")
        return "flat"
    if named not in _LAYOUTS:
        if not _LAYOUT_NAME.fullmatch(named):
            raise KCacheError(
                f"{marker} is damaged: it holds {named[:40]!r}, not the name of a layout (a "
                "crash while it was written, or an edit). The directory is a cache: remove it "
                "(its kernels are fetched or compiled again), or write flat into the file if "
                "this release made the directory, or use another directory: --cache-dir DIR or "
                "KCACHE_CACHE_DIR (cache_dir= in Python)"
            )
        raise KCacheError(
            f"{marker} names the layout {named[:40]!r}, which this kcache release does not know: "
            "a newer release made this cache directory; upgrade kcache, or use another "
            "directory (KCACHE_CACHE_DIR)"
        )
    return "flat" if named == "flat" else "fanout"


def _read_marker(path: Path) -> str | None:
    """A marker file's text, or None where there is none: one open and one read (every
    process's ``KernelCache()`` reads the layout; ``read_text`` costs twice the calls)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except NotADirectoryError as exc:  # the directory itself is a file, or under one
        raise unusable_cache_dir(path.parent, exc, f"reading its {path.name}") from None
    except (OSError, ValueError) as exc:
        raise KCacheError(
            f"cannot read {path} ({getattr(exc, 'strerror', None) or exc}): " + _OTHER_DIRECTORY
        ) from None
    try:
        return os.read(fd, 64).decode(errors="replace").strip()
    except OSError as exc:  # a directory by the marker's name, an I/O error
        raise KCacheError(
            f"cannot read {path} ({exc.strerror or exc}): " + _OTHER_DIRECTORY
        ) from None
    finally:
        os.close(fd)
