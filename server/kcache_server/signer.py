"""The server's signatures: every answer that names an artifact for a recipe key carries one.

A digest proves that bytes match the metadata that names them; only a signature ties
a *recipe key* to that metadata (:mod:`kcache.signing`). The server signs every
key -> artifact it answers with: the fetch by key and the metadata route in the
``X-KCache-Signature`` header, resolves and batch results in their body's
``signature``. Clients check it against keys they were given, or pinned on first
contact (``GET /v1/keys``), before they use or store an artifact.

The key is read at start-up from ``signing_key_file``, or made at first start as
``<data_dir>/signing-key.pem`` (mode 0600). Replicas behind one URL must share one key:
give them the same secret file (a server refuses to start beside another key its database
names: :mod:`kcache_server.signing_keys`). A rotation: start with the new key as
``signing_key_file`` and the old one as ``signing_previous_key_file``; the old key's
endorsement of the new one is published with it, so clients that pinned the old key
follow (they check the endorsement); clients given keys explicitly need the new one
added first.

Signing costs about 50 us; a signature is memoised per recipe key for the metadata
it was made from, so a warm fetch or resolve hit pays a dictionary lookup.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kcache.artifact import ArtifactMeta
from kcache.lru import LruCache
from kcache.signing import (
    ALGORITHM,
    HEADER,
    BundleDigest,
    DefaultToolchain,
    Signature,
    SignatureError,
    SigningKey,
)

__all__ = ["HEADER", "ArtifactSigner", "load_signing_key"]

#: Recipe keys whose signature is remembered (the resolver keeps as many keys' metadata).
_MEMO_KEYS = 100_000


class ArtifactSigner:
    """Signs ``recipe key -> artifact metadata`` with the server's key; see the module docstring."""

    def __init__(self, key: SigningKey, previous: SigningKey | None = None) -> None:
        self.key = key
        self.previous = previous
        self._memo: LruCache[str, tuple[ArtifactMeta, Signature, bytes]] = LruCache(
            max_entries=_MEMO_KEYS
        )

    @classmethod
    def load(cls, path: Path, previous_path: Path | None = None, *, create: bool) -> ArtifactSigner:
        """The signer of the key in ``key_path`` (made there when ``create`` and absent).

        A key given explicitly (a secret file) is never made: its absence is a
        configuration error, said with the setting to fix. So is a file that holds no
        unencrypted Ed25519 private key in PEM (garbage, DER, a public key, a passphrase).
        """
        setting = (
            f"KCACHE_SIGNING_KEY_FILE={path}"
            if not create
            else f"the signing key {path} (KCACHE_SIGNING_KEY_FILE is unset: the data directory's)"
        )
        key = load_signing_key(path, setting, create=create, unset=not create)
        previous = None
        if previous_path is not None:
            previous = load_signing_key(
                previous_path, f"KCACHE_SIGNING_PREVIOUS_KEY_FILE={previous_path}", unset=True
            )
            if previous.key_id == key.key_id:
                raise SignatureError(
                    "KCACHE_SIGNING_PREVIOUS_KEY_FILE holds the current signing key: give the key "
                    "signed with before the rotation"
                )
        return cls(key, previous)

    def sign(self, recipe_key: str, meta: ArtifactMeta) -> Signature:
        """The signature of ``recipe_key`` -> ``meta`` (memoised)."""
        return self._signed(recipe_key, meta)[1]

    def sign_bundle(self, entries: BundleDigest) -> Signature:
        """The signature of a bundle's entries (:class:`~kcache.signing.BundleDigest`)."""
        return self.key.sign_bundle(entries)

    def sign_default_toolchain(self, toolchain: str) -> tuple[int, Signature]:
        """The time now and the signature of ``toolchain`` as the default as of then."""
        issued_at = int(time.time())
        return issued_at, self.key.sign_default_toolchain(DefaultToolchain(toolchain, issued_at))

    def header_pair(self, recipe_key: str, meta: ArtifactMeta) -> bytes:
        """``HEADER: value`` ready for the HTTP protocol's answer (memoised), without CRLF."""
        return self._signed(recipe_key, meta)[2]

    def _signed(self, recipe_key: str, meta: ArtifactMeta) -> tuple[ArtifactMeta, Signature, bytes]:
        known = self._memo.get(recipe_key)
        if known is not None and (known[0] is meta or known[0] == meta):
            return known
        signature = self.key.sign(recipe_key, meta)
        made = (meta, signature, signature.header_value().encode("ascii"))
        self._memo.put(recipe_key, made)
        return made

    def published(self) -> dict[str, Any]:
        """What ``GET /v1/keys`` answers: the signing key, and the one before it (endorsing it)."""
        current: dict[str, Any] = {
            "key_id": self.key.key_id,
            "public_key": self.key.public_key,
            "endorsements": [],
        }
        keys = [current]
        if self.previous is not None:
            current["endorsements"].append(self.previous.endorse(self.key.public_key).to_dict())
            keys.append(
                {
                    "key_id": self.previous.key_id,
                    "public_key": self.previous.public_key,
                    "endorsements": [],
                }
            )
        return {"algorithm": ALGORITHM, "signing_key_id": self.key.key_id, "keys": keys}


#: How a usable key file is made, for the errors about one that is not.
_MAKE_KEY = (
    "give the path of an unencrypted Ed25519 private key in PEM (`kcache signing-key create "
    "FILE` makes one)"
)


def load_signing_key(
    path: Path, setting: str, *, create: bool = False, unset: bool = False
) -> SigningKey:
    """The key in ``path`` (made there when ``create`` and absent).

    A :class:`SignatureError` naming ``setting`` (the variable and file, or the file)
    when there is none to use: missing, a directory, unreadable, readable by others,
    encrypted, or no private key in PEM; ``unset``: a setting, which may be unset instead.
    """
    fix = _MAKE_KEY + (", or unset it" if unset else "")
    if path.is_dir():
        raise SignatureError(f"{setting} is a directory: {fix}")
    try:
        return SigningKey.load_or_create(path) if create else SigningKey.load(path)
    except FileNotFoundError:
        raise SignatureError(f"{setting} does not exist: {fix}") from None
    except OSError as exc:
        raise SignatureError(f"{setting} cannot be read ({exc.strerror or exc}): {fix}") from None
    except SignatureError as exc:
        raise SignatureError(f"{setting}: {exc}") from None
    except TypeError:  # cryptography: "Password was not given but private key is encrypted"
        raise SignatureError(
            f"{setting} is encrypted with a passphrase, which a server cannot be given: "
            "write it unencrypted (mode 0600), e.g. `openssl pkey -in FILE -out NEW && chmod 600 NEW`"
        ) from None
    except ValueError:  # cryptography: empty, not PEM (DER), a public key, another format
        raise SignatureError(
            f"{setting} holds no private key in PEM (is it empty, DER, or a public key?): {fix}"
        ) from None
