"""Whose signatures this client accepts: keys it was given, or the keys it pinned per server.

The server signs every recipe key -> artifact it answers with (:mod:`kcache.signing`);
a client uses or stores an artifact only under a signature that verifies by a key it
trusts:

- **Given keys** (``ClientSettings.trusted_keys``, ``KCACHE_TRUSTED_KEYS``: public keys,
  comma- or space-separated, or ``@FILE``): exactly those, for every server and every
  node-tier entry. What a fleet's images should carry.
- **Pinned keys** otherwise, trust on first use as ``ssh`` does with host keys: the first
  time this user's client talks to a URL it asks ``GET /v1/keys`` and records the keys
  in ``KCACHE_KNOWN_SERVERS`` (default ``~/.config/kcache/known_servers.json``, mode
  0600). From then on an answer from that URL must be signed by a pinned key; a new
  key is accepted only when a pinned one endorses it (the server's rotation), else
  the answer is refused loudly, naming the file entry to remove if the change was
  intended. Whoever answers for a URL at its first contact is believed: give keys
  where that is not good enough.

Trust is per server: a key vouches only for the server it belongs to. A ``Trust`` is made
for the server its cache is configured with (``url``), and a node-tier, pack or layer entry
(:meth:`Trust.entry_problem`, what ``Artifact.check()`` runs too) is used only when it
verifies by one of that server's keys: the keys pinned for that URL (those a pinned key
endorsed included), or the given keys, which are the fleet's and vouch for whichever server
this client is configured with. A key pinned for another URL vouches for nothing here: a
second server this user once talked to could otherwise sign, under the first server's
recipe key, a kernel of its choosing into a shared tier. Without a server, only given keys
vouch (and a private tier's entries are used as they are: :mod:`kcache.standing`).

Which server vouched is decided by the key, checked against the keys of the server looked
up through now, never by anything an entry says of itself (whoever planted an entry would
write what it says); a refusal names the URL the key is pinned for when it is one, and the
setting or command that would trust it (``KCACHE_TRUSTED_KEYS``, ``kcache trust forget URL``).

An entry signed by a key not pinned for the configured server, met before this user ever
contacted it (a fresh home on a shared tier another user filled), makes the client ask the
server first (:attr:`Trust.contact`, ``GET /v1/keys``: its first contact, pinned as an
answer's would be); a refusal for want of a pin is a :class:`Verdict` that is not lasting,
so nothing keeps it past the pin. Checking a signature imports nothing until one is met
(:func:`kcache.signing.verifier`): a process that checks none (a private tier's hits) pays
nothing for Ed25519.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock

from kcache.artifact import ArtifactMeta
from kcache.errors import KCacheError
from kcache.foreign import ForeignBinding
from kcache.fsutil import atomic_write, make_private_dirs
from kcache.signing import BundleDigest, DefaultToolchain, Signature, SignatureError, TrustedKeys
from kcache_client._verified import VerifiedSignatures
from kcache_client.errors import UntrustedArtifactError

__all__ = ["ACCEPTED", "KnownServers", "Trust", "Verdict", "default_known_servers"]

_log = logging.getLogger("kcache_client")

#: Reread the pin file for an unknown key id at most this often (another process pinned).
_REREAD_S = 1.0
#: After a first contact that failed (the server unreachable), try again at most this often.
_CONTACT_AGAIN_S = 5.0
#: What a refusal tells the user to run to drop a URL's pins (the ``kcache trust`` command).
FORGET = "kcache trust forget"


@dataclass(frozen=True)
class Verdict:
    """Whether an entry may be used here (``problem`` None) or why not, and whether that holds
    for as long as the file judged stays the same (``lasting``): a signature that does not
    verify, or none, does; a key not trusted *yet* does not (a pin may come: a first contact,
    another process, a rotation), so such a refusal is never remembered."""

    problem: str | None
    lasting: bool = True

    @property
    def ok(self) -> bool:
        return self.problem is None


#: The verdict of an entry that may be used.
ACCEPTED = Verdict(None)


def default_known_servers() -> Path:
    """``$KCACHE_KNOWN_SERVERS``, else ``$XDG_CONFIG_HOME/kcache/known_servers.json``."""
    explicit = os.environ.get("KCACHE_KNOWN_SERVERS", "").strip()
    if explicit:
        return Path(explicit).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME", "").strip()
    config = config or os.path.join(os.path.expanduser("~"), ".config")
    return Path(os.path.join(config, "kcache", "known_servers.json"))  # one Path: per cache


def _given_keys(value: str) -> TrustedKeys:
    """``TrustedKeys.parse(value)`` (``~`` expanded in ``@FILE``); a key file that cannot be read is a
    KCacheError naming the setting and the file, not a bare OSError."""
    if value.startswith("@"):  # ~ expanded, as the other paths of the settings
        value = "@" + os.path.expanduser(value[1:])
    try:
        return TrustedKeys.parse(value)
    except (OSError, UnicodeDecodeError) as exc:
        path = os.path.abspath(value[1:])
        why = getattr(exc, "strerror", None) or str(exc)
        raise KCacheError(
            f"KCACHE_TRUSTED_KEYS (trusted_keys=) names the key file {path}, which cannot be "
            f"read ({why}): give a readable file of public keys, one a line, as @FILE, or the "
            "keys themselves, separated by commas or spaces"
        ) from None


class KnownServers:
    """The pin file: URL -> the keys it signed with when first contacted (and since endorsed)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, dict[str, Any]]:
        """Every pinned URL; an absent or unreadable file pins nothing (said once)."""
        try:
            data = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            _log.warning("kcache: ignoring the unreadable pin file %s (%s)", self.path, exc)
            return {}
        return data if isinstance(data, dict) else {}

    def keys(self, url: str) -> TrustedKeys | None:
        """The keys pinned for ``url``, or None when it was never contacted."""
        entry = self.load().get(url)
        if not isinstance(entry, dict) or not isinstance(entry.get("keys"), dict):
            return None
        try:
            return TrustedKeys(str(k) for k in entry["keys"].values())
        except SignatureError:
            return None

    def entries(self) -> dict[str, tuple[list[str], float | None]]:
        """URL -> (the ids of its pinned keys, when it was first pinned), for ``kcache trust list``."""
        listed: dict[str, tuple[list[str], float | None]] = {}
        for url, entry in sorted(self.load().items()):
            if not isinstance(entry, dict):
                continue
            at = entry.get("pinned_at")
            ids = sorted(_valid_keys(entry.get("keys")))
            listed[url] = (ids, float(at) if isinstance(at, (int, float)) else None)
        return listed

    def pinned_for(self, key_id: str) -> list[str]:
        """The URLs ``key_id`` is pinned for (what a refusal names; it vouches for nothing else)."""
        return sorted(
            url
            for url, entry in self.load().items()
            if isinstance(entry, dict)
            and isinstance(entry.get("keys"), dict)
            and key_id in entry["keys"]
        )

    def pin(self, url: str, keys: TrustedKeys) -> None:
        """Add ``keys`` to ``url``'s pins (atomically; the file private to this user)."""
        make_private_dirs(str(self.path.parent))
        with filelock.FileLock(f"{self.path}.lock", timeout=30):
            data = self.load()
            entry = data[url] if isinstance(data.get(url), dict) else {}
            pinned = _valid_keys(entry.get("keys"))
            pinned.update(keys.public_keys)
            data[url] = {"keys": pinned, "pinned_at": entry.get("pinned_at", time.time())}
            self._write(data)

    def forget(self, url: str) -> bool:
        """Drop ``url``'s pins (its next contact pins afresh); whether there were any."""
        with filelock.FileLock(f"{self.path}.lock", timeout=30):
            data = self.load()
            if data.pop(url, None) is None:
                return False
            self._write(data)
            return True

    def _write(self, data: dict[str, Any]) -> None:  # atomically, this user's only from creation
        atomic_write(self.path, json.dumps(data, indent=1, sort_keys=True).encode(), mode=0o600)


class Trust:
    """The keys answers and tier entries are checked against; see the module docstring."""

    def __init__(self, given: TrustedKeys, known: KnownServers, url: str | None = None) -> None:
        self.given = given
        self.known = known
        #: The server this client looks up through (its configured URL, as the transport
        #: spells it); tier entries must be signed by its keys. None: no server.
        self.url = url.rstrip("/") if url else None
        self._lock = threading.Lock()
        self._pinned: dict[str, TrustedKeys] = {}
        # The pins of ``url`` as tier entries are checked against, and when last read.
        self._entry_keys: TrustedKeys | None = None
        self._entry_keys_read = float("-inf")
        #: How to ask ``url``'s ``GET /v1/keys`` when an entry signed by a key not pinned yet
        #: is met before this user ever contacted it (set by the cache; None: never asked).
        self.contact: Callable[[], Any] | None = None
        self._contact_failed: tuple[float, str] | None = None  # when, and why
        #: Stored entries' signatures that verified, kept for this user's later processes
        #: beside its pin file (kcache_client._verified).
        self.memo = VerifiedSignatures(os.path.join(os.path.dirname(known.path), "verified"))

    @classmethod
    def from_settings(
        cls, trusted_keys: str | None, known_servers: Path, url: str | None = None
    ) -> Trust:
        """Given keys parsed from a setting (SignatureError names a bad one), the pin file,
        and the server entries are checked for (``url``; None: no server, given keys only)."""
        given = _given_keys(trusted_keys) if trusted_keys else TrustedKeys()
        return cls(given, KnownServers(known_servers), url)

    # ------------------------------------------------------------ server answers
    def check_answer(
        self,
        url: str,
        recipe_key: str,
        meta: ArtifactMeta,
        signature: Signature | None,
        fetch_keys: Callable[[], Any],
        where: str,
    ) -> Signature:
        """``signature``, if a trusted key made it over ``recipe_key`` -> ``meta``; else
        :class:`UntrustedArtifactError`.

        ``fetch_keys`` asks the server's ``GET /v1/keys`` (first contact, a rotation).
        """
        if signature is None:
            raise UntrustedArtifactError(
                where,
                "it carries no signature (X-KCache-Signature, or the resolve's signature): "
                "the server predates signed artifacts, or something between strips it",
            )
        self._check(
            url, signature, fetch_keys, where, lambda k: k.verify(recipe_key, meta, signature)
        )
        return signature

    def check_bundle(
        self,
        url: str,
        entries: BundleDigest,
        signature: Signature,
        fetch_keys: Callable[[], Any],
        where: str,
    ) -> None:
        """Refuse (:class:`UntrustedArtifactError`) a bundle answer unless a key trusted for
        ``url`` signed its ``entries``, as :meth:`check_answer` checks one answer."""
        self._check(
            url, signature, fetch_keys, where, lambda k: k.verify_bundle(entries, signature)
        )

    def check_foreign(
        self,
        url: str,
        binding: ForeignBinding,
        signature: Signature,
        fetch_keys: Callable[[], Any],
        where: str,
    ) -> None:
        """Refuse (:class:`UntrustedArtifactError`) a foreign binding ("published by
        <writer>", docs/design.md section 10) unless a key trusted for ``url`` signed it, as
        :meth:`check_answer` checks a recipe's answer."""
        self._check(
            url, signature, fetch_keys, where, lambda k: k.verify_foreign(binding, signature)
        )

    def _check(
        self,
        url: str,
        signature: Signature,
        fetch_keys: Callable[[], Any],
        where: str,
        verify: Callable[[TrustedKeys], None],
    ) -> None:
        """``verify`` an answer of ``url`` signed by ``signature.key_id`` by the keys it is
        checked against (the given ones, else the pins, a rotation followed): a failure is
        :class:`UntrustedArtifactError`."""
        keys = self.given or self._server_keys(url, fetch_keys)
        if signature.key_id not in keys and not self.given:
            keys = self._follow_rotation(url, keys, signature.key_id, fetch_keys, where)
        try:
            verify(keys)
        except SignatureError as exc:
            pins = f"the keys pinned for {url} in {self.known.path}"
            against = "the given keys (KCACHE_TRUSTED_KEYS)" if self.given else pins
            raise UntrustedArtifactError(where, f"{exc}; checked against {against}") from None

    def _server_keys(self, url: str, fetch_keys: Callable[[], Any]) -> TrustedKeys:
        with self._lock:
            known = self._pinned.get(url)
        if known is not None:
            return known
        known = self.known.keys(url)
        if known is None:
            known = _published(fetch_keys(), url)
            self.known.pin(url, known)
            _log.warning(
                "kcache: pinned the signing key %s of %s in %s (first contact); answers signed by "
                "another key are refused unless this one endorses it",
                ", ".join(known.key_ids),
                url,
                self.known.path,
            )
        with self._lock:
            self._pinned[url] = known
        return known

    def _follow_rotation(
        self, url: str, pinned: TrustedKeys, key_id: str, fetch_keys: Callable[[], Any], where: str
    ) -> TrustedKeys:
        """The pins plus ``key_id``, if the server publishes it endorsed by a pinned key."""
        body = fetch_keys()
        for entry in body.get("keys", []) if isinstance(body, dict) else []:
            if not isinstance(entry, dict) or entry.get("key_id") != key_id:
                continue
            public = entry.get("public_key")
            for endorsement in entry.get("endorsements") or []:
                try:
                    pinned.verify_endorsement(str(public), Signature.from_dict(endorsement))
                    new = TrustedKeys([str(public)])
                except SignatureError:
                    continue
                if key_id not in new:
                    continue  # a published id that is not its key's
                self.known.pin(url, new)
                extended = pinned | new
                with self._lock:
                    self._pinned[url] = extended
                _log.warning(
                    "kcache: %s now signs with key %s, endorsed by pinned key %s; pinned it too",
                    url,
                    key_id,
                    endorsement.get("key_id"),
                )
                return extended
        raise UntrustedArtifactError(
            where,
            f"it is signed by key {key_id}, not by a key pinned for {url} "
            f"({', '.join(pinned.key_ids)} in {self.known.path}), and no pinned key endorses it. "
            f"Another server may be answering for {url}. If its key was replaced on purpose "
            f"(a server started with a new data directory or signing key), run: {FORGET} {url} "
            "(the next contact pins the key it signs with now), or give the fleet's key in "
            "KCACHE_TRUSTED_KEYS",
        )

    # ------------------------------------------------------------ node-tier entries
    def entry_problem(
        self, recipe_key: str, meta: ArtifactMeta, signature: Signature | None
    ) -> str | None:
        """Why a tier, pack or layer entry (or an artifact being checked) may not be used for
        this client's server, or None when it may (:meth:`entry_verdict`'s problem)."""
        return self.entry_verdict(recipe_key, meta, signature).problem

    def entry_verdict(
        self, recipe_key: str, meta: ArtifactMeta, signature: Signature | None
    ) -> Verdict:
        """Whether a tier, pack or layer entry (or an artifact being checked) may be used for
        this client's server: it must verify by one of that server's keys (the module
        docstring), never by a key that belongs to another server.

        A key not pinned for the server yet, met before this user ever contacted it, is
        looked up there first (``GET /v1/keys``, pinned on first contact, as an answer
        would be); a refusal for want of a pin is not :attr:`Verdict.lasting`.
        """
        if signature is None:
            return Verdict("it is not signed")
        return self._judge(signature, lambda keys: keys.verify(recipe_key, meta, signature))

    def bundle_verdict(
        self, bindings: list[tuple[str, ArtifactMeta]], signature: Signature
    ) -> Verdict:
        """:meth:`entry_verdict` for many entries at once: ``signature`` must be a trusted
        key's over all of their bindings, in order (:class:`~kcache.signing.BundleDigest`,
        what a bundle's trailer signs and a prefetched pack keeps)."""
        entries = BundleDigest()
        for recipe_key, meta in bindings:
            entries.add(recipe_key, meta)
        return self._judge(signature, lambda keys: keys.verify_bundle(entries, signature))

    def default_toolchain_verdict(self, word: DefaultToolchain, signature: Signature) -> Verdict:
        """Whether ``signature`` is this client's server's word on its default toolchain (a
        key given, or pinned for the server: never a first contact, which would be a
        request anyway; the caller asks the server instead)."""
        return self._judge(
            signature, lambda keys: keys.verify_default_toolchain(word, signature), contact=False
        )

    def _judge(
        self, signature: Signature, verify: Callable[[TrustedKeys], None], *, contact: bool = True
    ) -> Verdict:
        """``verify`` by the keys of this client's server (the given ones, else its pins, and
        with ``contact`` its keys asked for if it was never contacted) as a :class:`Verdict`."""
        keys = self.given or self._entry_keys_of(signature.key_id)
        if contact and signature.key_id not in keys and not self.given:
            keys = self._first_contact() or keys
        if signature.key_id not in keys:
            return Verdict(self.foreign_key(signature.key_id), lasting=False)
        try:
            verify(keys.remembering(self.memo))
        except SignatureError as exc:
            return Verdict(str(exc))
        return ACCEPTED

    def _first_contact(self) -> TrustedKeys | None:
        """The keys of this client's server, pinned now if it was never contacted (and can
        be reached: a failure is tried again after :data:`_CONTACT_AGAIN_S`); else None."""
        url, contact = self.url, self.contact
        if url is None or contact is None:
            return None
        with self._lock:
            if url in self._pinned or self._entry_keys:
                return None  # contacted, or pinned when the pin file was last read
            failed = self._contact_failed
        if failed is not None and time.monotonic() - failed[0] < _CONTACT_AGAIN_S:
            return None
        if self.known.keys(url) is not None:
            return None  # pinned (by another process meanwhile): _entry_keys_of rereads it
        try:
            keys = self._server_keys(url, contact)
        except KCacheError as exc:  # unreachable, refused, a malformed answer
            with self._lock:
                self._contact_failed = (time.monotonic(), str(exc))
            return None
        with self._lock:
            self._entry_keys, self._entry_keys_read = keys, time.monotonic()
        return keys

    def foreign_key(self, key_id: str) -> str:
        """Why an entry signed by ``key_id``, not a key of this client's server, is refused,
        and which setting would trust it."""
        elsewhere = [u for u in self.known.pinned_for(key_id) if u != self.url]
        whose = "a key this client does not know"
        if elsewhere:
            whose = f"pinned for {', '.join(elsewhere)} in {self.known.path}"
        if self.given:
            why = (
                "it is not one of the given keys (KCACHE_TRUSTED_KEYS); if it is your fleet's "
                "signing key, add its public key there"
            )
        elif self.url is None:
            why = (
                "no server is configured (KCACHE_URL), and without one only given keys vouch "
                "for entries: give the fleet's public key in KCACHE_TRUSTED_KEYS (what "
                "`kcache trust list` shows pinned, or the server's GET /v1/keys)"
            )
        elif self.known.keys(self.url) is None:
            failed = self._contact_failed
            cause = f" ({failed[1]})" if failed else ""
            why = (
                f"this user has not pinned the keys of {self.url} yet ({self.known.path}) and it "
                f"could not be asked for them{cause}: reach it once (its first contact pins its "
                "key), or give the fleet's public key in KCACHE_TRUSTED_KEYS"
            )
        else:
            why = (
                f"it is not one of the keys pinned for {self.url} ({self.known.path}); if that "
                f"server's key was replaced on purpose, run: {FORGET} {self.url} (its next "
                "contact pins the new key), or give the fleet's public key in KCACHE_TRUSTED_KEYS"
            )
        return (
            f"it is signed by key {key_id} ({whose}), which is not trusted here: {why}; a key "
            "vouches only for the server it belongs to"
        )

    def _entry_keys_of(self, key_id: str) -> TrustedKeys:
        """The keys pinned for this client's server (none without one), read again from the
        pin file for an unknown ``key_id`` at most every :data:`_REREAD_S` (another process
        may have pinned it, or followed a rotation)."""
        if self.url is None:
            return TrustedKeys()
        with self._lock:
            keys, read = self._entry_keys, self._entry_keys_read
            answered = self._pinned.get(self.url)  # what this process pinned or followed
        if answered is not None and key_id in answered:
            return answered
        if keys is None or (key_id not in keys and time.monotonic() - read >= _REREAD_S):
            keys = self.known.keys(self.url) or TrustedKeys()
            with self._lock:
                self._entry_keys, self._entry_keys_read = keys, time.monotonic()
        return keys


def _valid_keys(found: Any) -> dict[str, str]:
    """The well-formed keys of a pin entry, by id (a damaged one is dropped, not kept)."""
    valid: dict[str, str] = {}
    for text in found.values() if isinstance(found, dict) else ():
        with contextlib.suppress(SignatureError, AttributeError):
            valid.update(TrustedKeys([str(text)]).public_keys)
    return valid


def _published(body: Any, url: str) -> TrustedKeys:
    """The keys a ``GET /v1/keys`` answer lists (UntrustedArtifactError when malformed)."""
    keys = body.get("keys") if isinstance(body, dict) else None
    if not isinstance(keys, list) or not keys:
        raise UntrustedArtifactError(f"{url}/v1/keys", "the answer lists no keys")
    try:
        found = TrustedKeys(str(k.get("public_key")) for k in keys if isinstance(k, dict))
    except SignatureError as exc:
        raise UntrustedArtifactError(f"{url}/v1/keys", str(exc)) from None
    for entry in keys:
        if isinstance(entry, dict) and entry.get("key_id") not in found:
            raise UntrustedArtifactError(
                f"{url}/v1/keys", f"key id {entry.get('key_id')!r} is not the id of its key"
            )
    return found
