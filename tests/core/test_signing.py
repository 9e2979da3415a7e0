"""Signed artifact metadata: a key -> digest binding nobody else can make."""

from __future__ import annotations

import dataclasses
import multiprocessing
from pathlib import Path

import pytest

from kcache.artifact import ArtifactMeta
from kcache.deps import Dependency
from kcache.signing import Signature, SignatureError, SigningKey, TrustedKeys

KEY = "ab" * 32
META = ArtifactMeta(
    digest="cd" * 32,
    size=100,
    kind="cubin",
    target="sm_90",
    toolchain="nvrtc13.5-x",
    lowered_names={"k<float>": "_Z1kIfEvv"},
    dependencies=(Dependency("a.cuh", "ef" * 32),),
)


def test_a_signature_verifies_only_for_what_it_signed() -> None:
    key = SigningKey.generate()
    trusted = TrustedKeys([key.public_key])
    signature = key.sign(KEY, META)
    trusted.verify(KEY, META, signature)
    trusted.verify(KEY, dataclasses.replace(META, log="logs are not signed"), signature)
    for other_key, other in (
        ("ba" * 32, META),  # another recipe key: the binding itself
        (KEY, dataclasses.replace(META, digest="dc" * 32)),
        (KEY, dataclasses.replace(META, size=101)),
        (KEY, dataclasses.replace(META, target="sm_80")),
        (KEY, dataclasses.replace(META, lowered_names={})),
        (KEY, dataclasses.replace(META, dependencies=())),
    ):
        with pytest.raises(SignatureError, match="does not verify"):
            trusted.verify(other_key, other, signature)


def test_an_untrusted_key_a_tampered_or_missing_signature_is_refused() -> None:
    mine, theirs = SigningKey.generate(), SigningKey.generate()
    trusted = TrustedKeys([mine.public_key])
    with pytest.raises(SignatureError, match=f"key {theirs.key_id}, which is not trusted"):
        trusted.verify(KEY, META, theirs.sign(KEY, META))
    good = mine.sign(KEY, META)
    flipped = good.signature[:-2] + ("AA" if good.signature[-2:] != "AA" else "BB")
    with pytest.raises(SignatureError):
        trusted.verify(KEY, META, Signature(good.key_id, flipped))
    with pytest.raises(SignatureError, match="carries no signature"):
        trusted.verify(KEY, META, None)
    for bad in (
        None,
        {},
        {"key_id": "x", "signature": good.signature},
        {"key_id": good.key_id, "signature": "!!"},
    ):
        with pytest.raises(SignatureError):
            Signature.from_dict(bad)
    assert Signature.from_dict(good.to_dict()) == good


def test_rotation_trusts_old_and_new_keys_at_once(tmp_path: Path) -> None:
    old, new = SigningKey.generate(), SigningKey.generate()
    keys = tmp_path / "trusted"
    keys.write_text(f"# rotation\n{old.public_key}\n{new.public_key}  # since December\n")
    trusted = TrustedKeys.parse(f"@{keys}")
    assert trusted.key_ids == sorted([old.key_id, new.key_id])
    trusted.verify(KEY, META, old.sign(KEY, META))
    trusted.verify(KEY, META, new.sign(KEY, META))
    assert TrustedKeys.parse(f"{old.public_key},{new.public_key}").key_ids == trusted.key_ids
    with pytest.raises(SignatureError, match="32 bytes"):
        TrustedKeys(["c2hvcnQ"])


def _make(path: str) -> str:
    return SigningKey.load_or_create(Path(path)).key_id


def test_the_key_is_made_once_private_and_shared_by_concurrent_starts(tmp_path: Path) -> None:
    path = tmp_path / "data" / "signing.key"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        ids = pool.map(_make, [str(path)] * 8)
    assert len(set(ids)) == 1  # one key, whoever made it
    assert path.stat().st_mode & 0o777 == 0o600
    assert SigningKey.load(path).key_id == ids[0]
    path.chmod(0o644)
    with pytest.raises(SignatureError, match="chmod 600"):
        SigningKey.load(path)
