"""Signatures this user's processes verified, remembered for its later processes.

Whether an Ed25519 signature verifies is a fact about three byte strings, the public key,
the signature and the message, and stays true. A process that reads a shared tier, a
prefetched pack or a layer checks the signature of each entry it uses once per file
(``kcache_client._tier_reads``); a fresh process pays for its first check ~0.5 ms more
than for the others (libcrypto's Ed25519 set up and proved on a forged signature:
``kcache.signing.verifier``), most of a first launch from a shared tier (B7). Here a
triple that verified is kept as one empty file, named by the sha256 of the public key,
the signature and the sha256 of the message, so a later process of this user finds it
with one ``stat`` and checks nothing, imports nothing.

What it decides is only that: whether the key is trusted for this client's server now,
whether the binding was withdrawn, and whether the bytes match the digest the signed
metadata names are decided every time, as before (``Trust._judge``,
``kcache_client._withdrawals``, the digest check). Only signatures of stored entries
are remembered (a tier's, a pack's, a layer's, a kept default toolchain), not each answer
of the server: those are checked where they arrive, and a later reader of the tier they
went into remembers them.

The directory is ``verified/`` beside the pin file (``known_servers``: this user's word
on which keys it trusts), and must be this user's alone (:mod:`kcache.standing`:
``private``): whoever could write a file there could make a forged signature pass. Where
it is not (or cannot be made), nothing is read from it or written there. It holds at most
:data:`MAX_ENTRIES` files; past that, now and then, the oldest are removed (they are
checked again when next met).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
import threading
from pathlib import Path

from kcache.fsutil import make_private_dirs
from kcache.standing import directory_standing

__all__ = ["MAX_ENTRIES", "VerifiedSignatures"]

_log = logging.getLogger("kcache_client")

#: The most triples kept: empty files, one inode each.
MAX_ENTRIES = 100_000
#: One in this many additions counts the files (a listing), and prunes past the cap.
_PRUNE_EVERY = 1024
#: What the names hash before the triple: a version, so another scheme never matches.
_DOMAIN = b"kcache-verified/v1:"


class VerifiedSignatures:
    """The memo in ``directory`` (:class:`kcache.signing.VerifiedMemo`); checked for its
    standing when first used, then trusted or ignored for the life of the process."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.fspath(directory)
        self._state = "unchecked"  # then "usable", "absent" (made by the first addition), "refused"
        self._lock = threading.Lock()

    def holds(self, public_raw: bytes, signature: bytes, message: bytes) -> bool:
        """Whether this triple verified in an earlier check of this user's."""
        if not self._ready(make=False):
            return False
        return os.path.exists(self._path(public_raw, signature, message))

    def add(self, public_raw: bytes, signature: bytes, message: bytes) -> None:
        """Keep this triple, which verified just now (a failure to write costs only a later check)."""
        if not self._ready(make=True):
            return
        path = self._path(public_raw, signature, message)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            os.close(os.open(path, flags, 0o600))
        except FileExistsError:
            return
        except OSError as exc:
            _log.debug("kcache: could not remember a verified signature in %s: %s", path, exc)
            return
        if random.randrange(_PRUNE_EVERY) == 0:
            self.prune()

    def prune(self, keep: int = MAX_ENTRIES) -> int:
        """Remove the oldest files past ``keep`` (down to three quarters of it); how many went."""
        with contextlib.suppress(OSError):
            with os.scandir(self.directory) as listing:
                found = [
                    (entry.stat(follow_symlinks=False).st_mtime_ns, entry.path)
                    for entry in listing
                    if entry.is_file(follow_symlinks=False)
                ]
            if len(found) <= keep:
                return 0
            found.sort()
            gone = 0
            for _, path in found[: len(found) - keep * 3 // 4]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    gone += 1
            return gone
        return 0

    def _path(self, public_raw: bytes, signature: bytes, message: bytes) -> str:
        # The key (32 bytes) and the message's digest (32) have fixed sizes, so the
        # signature between them is delimited: no two triples give one string to hash.
        name = hashlib.sha256(
            _DOMAIN + public_raw + signature + hashlib.sha256(message).digest()
        ).hexdigest()
        return f"{self.directory}/{name}"

    def _ready(self, *, make: bool) -> bool:
        """Whether the directory may be used: this user's alone (made so when ``make``)."""
        state = self._state
        if state == "usable" or state == "refused" or (state == "absent" and not make):
            return state == "usable"
        with self._lock:
            if self._state == "unchecked" or (self._state == "absent" and make):
                self._state = self._check(make)
            return self._state == "usable"

    def _check(self, make: bool) -> str:
        if make:
            try:
                make_private_dirs(self.directory)
            except OSError as exc:
                _log.debug("kcache: cannot make %s: %s", self.directory, exc)
                return "refused"
        elif not os.path.isdir(self.directory):
            return "absent"
        standing = directory_standing(Path(self.directory))
        if standing.kind != "private":
            # Only speed is lost (every signature is checked), so INFO, not a warning in every
            # process of every rank.
            _log.info(
                "kcache: not remembering verified signatures in %s: %s (it must be this user's "
                "alone)",
                self.directory,
                standing.reason,
            )
            return "refused"
        return "usable"
