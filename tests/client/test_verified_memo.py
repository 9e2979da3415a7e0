"""Signatures a user verified, remembered for its later processes (kcache_client._verified).

A shared tier's entry is checked once per file in a process; a later process of the same
user (its pin file's directory) finds the triple that verified and checks nothing, imports
nothing. What the memo decides is only that the triple verified: which keys are trusted is
decided every time, a changed entry is a new triple, and a memo directory others could
write is never read (a planted file there would pass a forged signature: shown both ways).
Real tiers, a real key, real processes for "fresh".
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from client_harness import CountingVerifier, artifact_meta
from kcache_client._tier import NodeTier
from kcache_client._trust import KnownServers, Trust
from kcache_client._verified import VerifiedSignatures

from kcache import signing
from kcache.signing import Signature, SigningKey, TrustedKeys

RECIPE_KEY = "5e" * 32
DATA = b"\x7fELF a kernel from the team's tier " * 20


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> CountingVerifier:
    found = CountingVerifier(signing.verifier())
    monkeypatch.setattr(signing, "_verifier", found)
    return found


@pytest.fixture
def shared() -> Iterator[Path]:
    """A team's tier (sticky, writable by all) holding one entry signed by the fleet's key."""
    root = Path(tempfile.mkdtemp(prefix="kcache-memo-tier-"))
    os.chmod(root, 0o1777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def fleet(shared: Path, tmp_path: Path) -> SigningKey:
    key = SigningKey.generate()
    _publish(shared, tmp_path, key, key.sign(RECIPE_KEY, artifact_meta(DATA)))
    return key


def _publish(shared: Path, tmp_path: Path, key: SigningKey, signature: Signature) -> None:
    writer = NodeTier(
        shared, max_bytes=0, trust=_trust(tmp_path / "writer", TrustedKeys([key.public_key]))
    )
    assert writer.publish(RECIPE_KEY, None, artifact_meta(DATA), DATA, signature) is not None
    writer.flush()


def _trust(home: Path, keys: TrustedKeys) -> Trust:
    return Trust(keys, KnownServers(home / "known_servers.json"))


def _reader(shared: Path, home: Path, key: SigningKey) -> NodeTier:
    """A fresh process's view of the tier: its own objects, this user's home."""
    return NodeTier(shared, max_bytes=0, trust=_trust(home, TrustedKeys([key.public_key])))


def test_a_later_process_of_the_user_checks_nothing_another_home_checks_again(
    shared: Path, fleet: SigningKey, tmp_path: Path, counting: CountingVerifier
) -> None:
    home = tmp_path / "home"
    assert _reader(shared, home, fleet).lookup_signed(RECIPE_KEY) is not None
    assert counting.calls == 1
    assert len(os.listdir(home / "verified")) == 1
    assert os.stat(home / "verified").st_mode & 0o777 == 0o700

    later = _reader(shared, home, fleet).lookup_signed(RECIPE_KEY)
    assert later is not None and later[1] == DATA
    assert counting.calls == 1  # the memo answered

    assert _reader(shared, tmp_path / "other-home", fleet).lookup_signed(RECIPE_KEY) is not None
    assert counting.calls == 2  # its own home: nothing remembered there


_FRESH = """
import json, sys
from pathlib import Path
from kcache.signing import TrustedKeys
import kcache.signing as signing
from kcache_client._tier import NodeTier
from kcache_client._trust import KnownServers, Trust
cfg = json.loads(sys.argv[1])
trust = Trust(TrustedKeys([cfg["key"]]), KnownServers(Path(cfg["known"])))
found = NodeTier(cfg["tier"], max_bytes=0, trust=trust).lookup_signed(cfg["recipe_key"])
print(json.dumps({"found": found is not None, "verifier": signing._verifier is not None,
                  "ctypes": "ctypes" in sys.modules}))
"""


def test_a_fresh_process_finds_the_memo_and_makes_no_verifier(
    shared: Path, fleet: SigningKey, tmp_path: Path
) -> None:
    cfg = {
        "key": fleet.public_key,
        "known": str(tmp_path / "home" / "known_servers.json"),
        "tier": str(shared),
        "recipe_key": RECIPE_KEY,
    }

    def fresh() -> dict[str, bool]:
        done = subprocess.run(
            [sys.executable, "-c", _FRESH, json.dumps(cfg)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        found: dict[str, bool] = json.loads(done.stdout.strip().splitlines()[-1])
        return found

    assert fresh() == {"found": True, "verifier": True, "ctypes": True}
    # The next process: no Ed25519 set up, not even ctypes imported for it.
    assert fresh() == {"found": True, "verifier": False, "ctypes": False}


def test_the_memo_decides_no_trust_and_a_changed_entry_is_checked_again(
    shared: Path, fleet: SigningKey, tmp_path: Path, counting: CountingVerifier
) -> None:
    home = tmp_path / "home"
    assert _reader(shared, home, fleet).lookup_signed(RECIPE_KEY) is not None  # remembered
    # A key the fleet no longer trusts: refused, memo or not.
    stranger = SigningKey.generate()
    assert _reader(shared, home, stranger).lookup_signed(RECIPE_KEY) is None

    # The same signature over other metadata (its target changed in the alias): a new
    # message, not in the memo, and it does not verify.
    alias = shared / "index" / "recipes" / f"{RECIPE_KEY}.json"
    body = json.loads(alias.read_text())
    assert body["artifact"]["target"] == "sm_90"
    body["artifact"]["target"] = "sm_80"
    alias.write_text(json.dumps(body))
    calls = counting.calls
    assert _reader(shared, home, fleet).lookup_signed(RECIPE_KEY) is None
    assert counting.calls == calls + 1


def _forged(shared: Path, tmp_path: Path, key: SigningKey) -> tuple[bytes, bytes]:
    """Publish an entry whose signature is 64 bytes of nothing, naming ``key``; (the signature,
    the message it claims to sign)."""
    raw = bytes(64)
    text = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
    _publish(shared, tmp_path, key, Signature(signing.key_id_of(_public_raw(key)), text))
    return raw, signing.signed_message(RECIPE_KEY, artifact_meta(DATA))


def _public_raw(key: SigningKey) -> bytes:
    text = key.public_key
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@pytest.mark.parametrize("mode", [0o700, 0o777])
def test_a_memo_directory_others_can_write_is_never_read(
    shared: Path,
    tmp_path: Path,
    counting: CountingVerifier,
    mode: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = SigningKey.generate()
    raw, message = _forged(shared, tmp_path, key)
    home = tmp_path / "home"
    memo = home / "verified"
    memo.mkdir(parents=True)
    os.chmod(memo, mode)
    # A file planted for the forged triple, as anyone who could write the directory could.
    planted = VerifiedSignatures(memo)._path(_public_raw(key), raw, message)
    Path(planted).touch()
    with caplog.at_level(logging.INFO, "kcache_client"):
        found = _reader(shared, home, key).lookup_signed(RECIPE_KEY)
    if mode == 0o700:
        # This user's own directory is believed (which is why it must be this user's alone).
        assert found is not None and counting.calls == 0
    else:
        assert found is None and counting.calls == 1  # checked, and refused
        assert f"not remembering verified signatures in {memo}" in caplog.text
        assert "writable by others without the sticky bit" in caplog.text


def test_the_oldest_are_pruned_past_the_cap(tmp_path: Path) -> None:
    memo = VerifiedSignatures(tmp_path / "verified")
    key = bytes(32)
    for i in range(10):
        memo.add(key, bytes([i]) * 64, b"message")
        path = Path(memo._path(key, bytes([i]) * 64, b"message"))
        os.utime(path, ns=(i * 10**9, i * 10**9))  # added in order
    assert memo.prune(keep=4) == 7  # down to three quarters of the cap
    kept = [i for i in range(10) if memo.holds(key, bytes([i]) * 64, b"message")]
    assert kept == [7, 8, 9]
    assert memo.prune(keep=4) == 0


def _remember_a_signature(directory: Path) -> None:
    memo = VerifiedSignatures(directory)
    memo.add(bytes(32), bytes(64), b"message")
    assert VerifiedSignatures(directory).holds(bytes(32), bytes(64), b"message")


def _pin_a_server(directory: Path) -> None:
    key = SigningKey.generate()
    known = KnownServers(directory / "known_servers.json")
    known.pin("http://kcache:1777", TrustedKeys([key.public_key]))
    assert known.pinned_for(key.key_id) == ["http://kcache:1777"]


@pytest.mark.parametrize("make", [_remember_a_signature, _pin_a_server])
def test_this_users_directories_and_their_missing_parents_are_made_private(
    tmp_path: Path, make: Callable[[Path], None]
) -> None:
    """Under a umask that leaves directories writable by the group (002), the directories the
    memo and the pin file live in, and the parents made for them, are not: a parent others can
    write lets them swap what is below it (and the memo's own standing check would refuse it
    in every process)."""
    directory = tmp_path / "config" / "kcache" / "private"
    old = os.umask(0o002)
    try:
        make(directory)
    finally:
        os.umask(old)
    for path in (tmp_path / "config", tmp_path / "config" / "kcache", directory):
        assert os.stat(path).st_mode & 0o777 == 0o700, path
