"""Signed artifact metadata: what ties a recipe key to the bytes a rank loads.

A digest check proves that a blob matches the digest its alias names; nothing in it
ties a *recipe key* to that digest, and anyone can compute a key. The server signs
what makes an artifact trustworthy for a key, :func:`signed_message`: the recipe key,
the digest, size, kind, target, toolchain, lowered names and dependency list, as
canonical JSON. Ed25519: small keys and signatures (32 and 64 bytes), deterministic,
about 50 us to sign and 60-110 us to verify.

Signing (the server) uses ``cryptography``. Checking (every client) needs no import of
it: a key is its 32 raw bytes (parsed with base64 and named with sha256), and a signature
is checked by :func:`verifier`, OpenSSL's own Ed25519 called through ``ctypes`` in the
``libcrypto`` that Python's ``hashlib`` already loaded (about 0.4 ms for the first check
of a process, against 7-9 ms to import ``cryptography`` and 0.9 ms for its first check:
bench/RESULTS.md, 2026-12-04), or ``cryptography`` where that library cannot be had (a
Python with OpenSSL linked in statically, a libcrypto without Ed25519). The OpenSSL path
proves itself at first use: a known signature with one bit flipped must be refused, and
a signature it refuses is refused only once ``cryptography`` agrees.

A key is named by its id, the first 16 hex digits of the sha256 of its raw public
bytes; a signature is ``{"key_id", "signature"}`` (base64url, no padding), or in one
HTTP header ``X-KCache-Signature: <key_id>.<signature>`` (:data:`HEADER`). Several
trusted keys at once allow rotation: sign with the new key while clients trust old
and new. A client that pinned a server's key on first contact follows a rotation
through an endorsement: the old key's signature over the new public key
(:meth:`SigningKey.endorse`, :meth:`TrustedKeys.verify_endorsement`), which the server
publishes beside the new key. Nothing else moves a pin.

A bundle (many artifacts in one answer, :mod:`kcache.bundle_format`) also carries one
signature over all of its entries' bindings in order (:class:`BundleDigest`): a node
that checks it has checked every entry with one verification, where one per entry was
most of a large prefetch's time on the client. Each entry keeps its own signature too,
for whoever later reads the entry alone.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kcache.artifact import ArtifactMeta
from kcache.errors import KCacheError
from kcache.foreign import ForeignBinding

__all__ = [
    "ALGORITHM",
    "HEADER",
    "BundleDigest",
    "DefaultToolchain",
    "Signature",
    "SignatureError",
    "SigningKey",
    "TrustedKeys",
    "VerifiedMemo",
    "key_id_of",
    "signed_message",
    "verifier",
]

ALGORITHM = "ed25519"
#: The response header that carries a signature (HTTP header names are case-insensitive).
HEADER = "X-KCache-Signature"
#: What an endorsement signs before the endorsed public key: never a valid artifact message.
_ENDORSEMENT = b"kcache-key-endorsement/v1:"
#: Bumped if the signed fields ever change; part of the message, so old and new never mix.
_MESSAGE_VERSION = 1
#: What a bundle's signature signs before its entries' digest: never another message.
_BUNDLE = b"kcache-bundle/v1:"
#: What a server's word on its default toolchain signs before it: never another message.
_DEFAULT_TOOLCHAIN = b"kcache-default-toolchain/v1:"


class SignatureError(KCacheError, ValueError):
    """An artifact's signature is missing, malformed, by an untrusted key, or does not verify."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str, what: str) -> bytes:
    if not isinstance(text, str) or len(text) > 200:
        raise SignatureError(f"{what} must be a short base64url string")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError) as exc:
        raise SignatureError(f"{what} is not base64url") from exc


class Ed25519Verifier:
    """Checks Ed25519 signatures by raw public keys (see :func:`verifier`)."""

    name = "none"

    def verify(self, public_raw: bytes, signature: bytes, message: bytes) -> bool:
        """Whether ``signature`` by the key ``public_raw`` (32 bytes) covers ``message``."""
        raise NotImplementedError


class _CryptographyVerifier(Ed25519Verifier):
    """``cryptography``'s Ed25519 (its import costs 7-9 ms)."""

    name = "cryptography"

    def __init__(self) -> None:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        self._invalid = InvalidSignature
        self._load = Ed25519PublicKey.from_public_bytes
        self._keys: dict[bytes, Any] = {}

    def verify(self, public_raw: bytes, signature: bytes, message: bytes) -> bool:
        key = self._keys.get(public_raw)
        if key is None:
            key = self._keys.setdefault(public_raw, self._load(public_raw))
        try:
            key.verify(signature, message)
        except self._invalid:
            return False
        return True


#: OpenSSL's EVP_PKEY_ED25519 (NID_ED25519), the same in 1.1.1 and 3.x.
_NID_ED25519 = 1087
#: RFC 8032, section 7.1, TEST 2: a public key, its signature of the one byte 0x72.
_KAT_KEY = bytes.fromhex("3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c")
_KAT_SIGNATURE = bytes.fromhex(
    "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da"
    "085ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00"
)


class _OpenSSLVerifier(Ed25519Verifier):
    """OpenSSL's Ed25519 through ``ctypes``, in the libcrypto this process already loaded."""

    name = "openssl"

    def __init__(self, lib: Any) -> None:
        import ctypes

        pointer, size = ctypes.c_void_p, ctypes.c_size_t
        new_key = lib.EVP_PKEY_new_raw_public_key
        new_key.restype, new_key.argtypes = pointer, [ctypes.c_int, pointer, ctypes.c_char_p, size]
        new_ctx = lib.EVP_MD_CTX_new
        new_ctx.restype, new_ctx.argtypes = pointer, []
        free_ctx = lib.EVP_MD_CTX_free
        free_ctx.restype, free_ctx.argtypes = None, [pointer]
        init = lib.EVP_DigestVerifyInit
        init.restype, init.argtypes = ctypes.c_int, [pointer, pointer, pointer, pointer, pointer]
        check = lib.EVP_DigestVerify
        check.restype = ctypes.c_int
        check.argtypes = [pointer, ctypes.c_char_p, size, ctypes.c_char_p, size]
        clear = lib.ERR_clear_error
        clear.restype, clear.argtypes = None, []
        self._new_key, self._new_ctx, self._free_ctx = new_key, new_ctx, free_ctx
        self._init, self._check, self._clear = init, check, clear
        # raw public key -> its EVP_PKEY, kept for the process (a fleet has a handful of keys).
        self._keys: dict[bytes, int] = {}
        self._lock = threading.Lock()

    def _key(self, public_raw: bytes) -> int:
        key = self._keys.get(public_raw)
        if key is None:
            with self._lock:
                key = self._keys.get(public_raw)
                if key is None:
                    key = self._new_key(_NID_ED25519, None, public_raw, len(public_raw))
                    if not key:
                        self._clear()
                        raise SignatureError("OpenSSL refused an Ed25519 public key")
                    self._keys[public_raw] = key
        return key

    def verify(self, public_raw: bytes, signature: bytes, message: bytes) -> bool:
        key = self._key(public_raw)
        ctx = self._new_ctx()
        if not ctx:
            raise MemoryError("EVP_MD_CTX_new")
        try:
            if self._init(ctx, None, None, None, key) != 1:
                self._clear()
                raise SignatureError("OpenSSL could not start an Ed25519 check")
            good = bool(self._check(ctx, signature, len(signature), message, len(message)) == 1)
        finally:
            self._free_ctx(ctx)
        if not good:
            self._clear()  # nothing left on this thread's error queue for the ssl module to find
        return good


def _openssl() -> _OpenSSLVerifier | None:
    """OpenSSL's verifier, if this process's libcrypto has one that refuses a forged signature."""
    try:
        import _hashlib
        import ctypes
    except ImportError:
        return None
    for name in (getattr(_hashlib, "__file__", None), "libcrypto.so.3", "libcrypto.so.1.1"):
        if not name:
            continue
        try:
            candidate = _OpenSSLVerifier(ctypes.CDLL(name))
            forged = bytes([_KAT_SIGNATURE[0] ^ 1]) + _KAT_SIGNATURE[1:]
            if candidate.verify(_KAT_KEY, forged, b"\x72"):
                continue  # a binding that accepts what it must refuse is never used
        except (OSError, AttributeError, SignatureError, MemoryError):
            continue
        return candidate
    return None


class _Confirmed(Ed25519Verifier):
    """The fast verifier, whose refusals ``cryptography`` confirms (a refusal is rare: an
    attack or a misconfiguration; a binding that refused good signatures would show here)."""

    def __init__(self, fast: Ed25519Verifier) -> None:
        self.fast = fast
        self.name = fast.name
        self._slow: Ed25519Verifier | None = None

    def verify(self, public_raw: bytes, signature: bytes, message: bytes) -> bool:
        if self.fast.verify(public_raw, signature, message):
            return True
        if self._slow is None:
            try:
                self._slow = _CryptographyVerifier()
            except ImportError:
                return False
        return self._slow.verify(public_raw, signature, message)


_verifier: Ed25519Verifier | None = None
_verifier_lock = threading.Lock()


def verifier(name: str | None = None) -> Ed25519Verifier:
    """The process's Ed25519 verifier (module docstring): OpenSSL's through ``ctypes`` where
    it proves itself, else ``cryptography``'s. ``name`` (``openssl``, ``cryptography``) asks
    for one of them (tests, benchmarks); ValueError when it cannot be had."""
    global _verifier
    if name == "cryptography":
        return _CryptographyVerifier()
    if name == "openssl":
        found = _openssl()
        if found is None:
            raise ValueError("no usable libcrypto with Ed25519 in this process")
        return found
    if _verifier is None:
        with _verifier_lock:
            if _verifier is None:
                fast = _openssl()
                _verifier = _Confirmed(fast) if fast is not None else _CryptographyVerifier()
    return _verifier


def key_id_of(public_raw: bytes) -> str:
    """The id of a public key: 16 hex digits of the sha256 of its 32 raw bytes."""
    return hashlib.sha256(public_raw).hexdigest()[:16]


def signed_message(recipe_key: str, meta: ArtifactMeta) -> bytes:
    """The bytes a signature covers for ``recipe_key`` -> ``meta`` (canonical JSON)."""
    body = {
        "v": _MESSAGE_VERSION,
        "recipe_key": recipe_key,
        "digest": meta.digest,
        "size": meta.size,
        "kind": meta.kind,
        "target": meta.target,
        "toolchain": meta.toolchain,
        "lowered_names": dict(sorted(meta.lowered_names.items())),
        "dependencies": sorted([d.name, d.sha256] for d in meta.dependencies),
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


class BundleDigest:
    """What a bundle's signature covers: the (recipe key -> metadata) binding of each of its
    entries (:func:`signed_message`), in stream order, and how many there are."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.count = 0

    def add(self, recipe_key: str, meta: ArtifactMeta) -> None:
        """The next entry."""
        self._hash.update(hashlib.sha256(signed_message(recipe_key, meta)).digest())
        self.count += 1

    def message(self) -> bytes:
        """The bytes signed for the entries added so far."""
        return _BUNDLE + self.count.to_bytes(8, "big") + self._hash.copy().digest()


@dataclass(frozen=True)
class DefaultToolchain:
    """A server's word that recipes without a toolchain are compiled with ``toolchain``, as
    of ``issued_at`` (its clock, epoch seconds): what ``GET /v1/toolchains`` signs, so a node
    tier can keep it for the processes that start after (``kcache_client`` keys recipes
    with it without asking, while it is young: ``KernelCache.default_toolchain``)."""

    toolchain: str
    issued_at: int

    def message(self) -> bytes:
        """The bytes the server's signature covers."""
        body = {"default_toolchain": self.toolchain, "issued_at": self.issued_at}
        return _DEFAULT_TOOLCHAIN + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Signature:
    """A signature and the id of the key that made it."""

    key_id: str
    signature: str

    def to_dict(self) -> dict[str, str]:
        """JSON form."""
        return {"key_id": self.key_id, "signature": self.signature}

    @classmethod
    def from_dict(cls, data: Any) -> Signature:
        """Inverse of :meth:`to_dict`, every field checked (SignatureError)."""
        if not isinstance(data, dict):
            raise SignatureError("the signature must be an object {key_id, signature}")
        key_id, value = data.get("key_id"), data.get("signature")
        if not isinstance(key_id, str) or len(key_id) != 16 or not _is_hex(key_id):
            raise SignatureError("the signature's key_id must be 16 hex digits")
        if not isinstance(value, str) or len(_unb64(value, "the signature")) != 64:
            raise SignatureError("the signature must be 64 bytes, base64url")
        return cls(key_id, value)

    def header_value(self) -> str:
        """The :data:`HEADER` form: ``<key_id>.<signature>``."""
        return f"{self.key_id}.{self.signature}"

    @classmethod
    def from_header(cls, value: str) -> Signature:
        """Inverse of :meth:`header_value`, every part checked (SignatureError)."""
        key_id, dot, signature = value.strip().partition(".")
        if not dot:
            raise SignatureError(f"the {HEADER} header must be <key_id>.<signature>")
        return cls.from_dict({"key_id": key_id, "signature": signature})


_HEX = re.compile(r"[0-9a-f]*")


def _is_hex(text: str) -> bool:
    return _HEX.fullmatch(text) is not None


class SigningKey:
    """An Ed25519 private key that signs artifact metadata."""

    def __init__(self, private: Any) -> None:
        from cryptography.hazmat.primitives import serialization

        self._private = private
        self.public_raw: bytes = private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.key_id = key_id_of(self.public_raw)

    @classmethod
    def generate(cls) -> SigningKey:
        """A new random key."""
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: Path) -> SigningKey:
        """The key in ``path`` (PEM, PKCS8), refusing a file others may read."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        mode = path.stat().st_mode
        if mode & 0o077:
            raise SignatureError(
                f"the signing key {path} may be read by others (mode {mode & 0o777:o}); "
                f"chmod 600 {path}"
            )
        private = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(private, Ed25519PrivateKey):
            raise SignatureError(f"{path} is not an Ed25519 private key")
        return cls(private)

    @classmethod
    def load_or_create(cls, path: Path) -> SigningKey:
        """The key in ``path``, made there (mode 0600, atomically) when there is none."""
        if path.exists():
            return cls.load(path)
        from cryptography.hazmat.primitives import serialization

        key = cls.generate()
        pem = key._private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, pem)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(partial, path)  # never replaces a key another process made meanwhile
        except FileExistsError:
            pass
        finally:
            partial.unlink(missing_ok=True)
        return cls.load(path)

    @property
    def public_key(self) -> str:
        """The public key, base64url of its 32 raw bytes (what clients are given to trust)."""
        return _b64(self.public_raw)

    def sign(self, recipe_key: str, meta: ArtifactMeta) -> Signature:
        """Sign ``recipe_key`` -> ``meta``."""
        return Signature(self.key_id, _b64(self._private.sign(signed_message(recipe_key, meta))))

    def sign_bundle(self, entries: BundleDigest) -> Signature:
        """Sign a bundle's entries (:class:`BundleDigest`)."""
        return Signature(self.key_id, _b64(self._private.sign(entries.message())))

    def sign_default_toolchain(self, word: DefaultToolchain) -> Signature:
        """Sign the server's default toolchain as of a moment (:class:`DefaultToolchain`)."""
        return Signature(self.key_id, _b64(self._private.sign(word.message())))

    def sign_foreign(self, binding: ForeignBinding) -> Signature:
        """Sign a foreign binding: "published by <writer>" (:meth:`ForeignBinding.message`)."""
        return Signature(self.key_id, _b64(self._private.sign(binding.message())))

    def endorse(self, public_key: str) -> Signature:
        """This key's endorsement of ``public_key`` (base64url): "sign with it after me"."""
        raw = _unb64(public_key, "the endorsed public key")
        return Signature(self.key_id, _b64(self._private.sign(_ENDORSEMENT + raw)))


class VerifiedMemo(Protocol):
    """Signatures known to have verified: (public key, signature, message) triples that
    :func:`verifier` accepted once (kcache_client._verified keeps them for a user)."""

    def holds(self, public_raw: bytes, signature: bytes, message: bytes) -> bool:
        """Whether this triple verified before."""
        ...

    def add(self, public_raw: bytes, signature: bytes, message: bytes) -> None:
        """Remember that this triple verified just now."""
        ...


class TrustedKeys:
    """The public keys a client accepts signatures by, by key id.

    A key is kept as its 32 raw bytes: parsing and naming keys need base64 and sha256
    only, and nothing is imported for Ed25519 until a signature is checked (:func:`verifier`).
    """

    #: Where signatures that verified are remembered and looked up first (:meth:`remembering`);
    #: None: every signature is verified.
    memo: VerifiedMemo | None = None

    def __init__(self, public_keys: Iterable[str] = ()) -> None:
        self._keys: dict[str, bytes] = {}
        #: key id -> the public key as given (base64url of its 32 raw bytes).
        self.public_keys: dict[str, str] = {}
        for text in public_keys:
            raw = _unb64(text.strip(), "a trusted public key")
            if len(raw) != 32:
                raise SignatureError(
                    f"a trusted public key must be 32 bytes of Ed25519, base64url: {text[:60]!r}"
                )
            key_id = key_id_of(raw)
            self._keys[key_id] = raw
            self.public_keys[key_id] = _b64(raw)

    @classmethod
    def parse(cls, value: str) -> TrustedKeys:
        """Keys from a setting: comma- or space-separated keys, or ``@FILE`` (one key a line, # comments)."""
        if value.startswith("@"):
            lines = Path(value[1:]).read_text().splitlines()
            items = [line.split("#", 1)[0].strip() for line in lines]
        else:
            items = value.replace(",", " ").split()
        return cls(item for item in items if item)

    def remembering(self, memo: VerifiedMemo | None) -> TrustedKeys:
        """These keys, their checks looked up in ``memo`` first and the signatures that verify
        remembered there (whether a key is trusted is decided here every time, as before)."""
        if memo is None:
            return self
        view = object.__new__(TrustedKeys)
        view._keys, view.public_keys, view.memo = self._keys, self.public_keys, memo
        return view

    def __or__(self, other: TrustedKeys) -> TrustedKeys:
        return TrustedKeys([*self.public_keys.values(), *other.public_keys.values()])

    def __bool__(self) -> bool:
        return bool(self._keys)

    @property
    def key_ids(self) -> list[str]:
        """Ids of the trusted keys."""
        return sorted(self._keys)

    def __contains__(self, key_id: object) -> bool:
        return key_id in self._keys

    def verify_endorsement(self, public_key: str, endorsement: Signature) -> None:
        """Raise :class:`SignatureError` unless a trusted key endorsed ``public_key``."""
        endorser = self._keys.get(endorsement.key_id)
        if endorser is None:
            raise SignatureError(
                f"the endorsement of key {key_id_of(_unb64(public_key, 'a public key'))} is by key "
                f"{endorsement.key_id}, which is not trusted here"
            )
        if not verifier().verify(
            endorser,
            _unb64(endorsement.signature, "the endorsement"),
            _ENDORSEMENT + _unb64(public_key, "the endorsed public key"),
        ):
            raise SignatureError(f"the endorsement by key {endorsement.key_id} does not verify")

    def verify(self, recipe_key: str, meta: ArtifactMeta, signature: Signature | None) -> None:
        """Raise :class:`SignatureError` unless ``signature`` by a trusted key covers ``recipe_key`` -> ``meta``."""
        what = f"the artifact for recipe {recipe_key}"
        if signature is None:
            raise SignatureError(f"{what} carries no signature")
        self._verify(signature, signed_message(recipe_key, meta), what)

    def verify_foreign(self, binding: ForeignBinding, signature: Signature | None) -> None:
        """Raise :class:`SignatureError` unless ``signature`` by a trusted key covers the
        foreign ``binding`` (its name, files and writer)."""
        what = f"the {binding.name.library} entry {binding.name.key} published by {binding.writer}"
        if signature is None:
            raise SignatureError(f"{what} carries no signature")
        self._verify(signature, binding.message(), what)

    def verify_default_toolchain(self, word: DefaultToolchain, signature: Signature) -> None:
        """Raise :class:`SignatureError` unless ``signature`` by a trusted key covers ``word``."""
        self._verify(signature, word.message(), f"the default toolchain {word.toolchain}")

    def verify_bundle(self, entries: BundleDigest, signature: Signature) -> None:
        """Raise :class:`SignatureError` unless ``signature`` by a trusted key covers the
        bundle's ``entries``."""
        self._verify(signature, entries.message(), f"the bundle of {entries.count} entries")

    def _verify(self, signature: Signature, message: bytes, what: str) -> None:
        public = self._keys.get(signature.key_id)
        if public is None:
            raise SignatureError(
                f"{what} is signed by key {signature.key_id}, which is not trusted here "
                f"(trusted: {', '.join(self.key_ids) or 'none'})"
            )
        raw = _unb64(signature.signature, "the signature")
        memo = self.memo
        if memo is not None and memo.holds(public, raw, message):
            return
        if not verifier().verify(public, raw, message):
            raise SignatureError(
                f"the signature of {what} by key {signature.key_id} does not verify: the "
                "metadata or the key-to-digest binding was changed"
            )
        if memo is not None:
            memo.add(public, raw, message)
