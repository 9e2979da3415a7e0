"""The trust chain: the server signs key -> artifact, clients check it, the tier checks itself.

Real servers (threads with their own keys) behind a counting proxy whose URL stays
while the server behind it changes; a real other user (uid 65534, forked as root) for
the planted entry; FIFOs, links and devices for the tier's own checks. Trust is per
server (a key pinned for one URL vouches for nothing looked up through another), and a
verdict is kept with the file it judged (a pack replaced under its name is judged again).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
from client_harness import Proxy, artifact_meta, kernels
from kcache_client import (
    ClientSettings,
    KernelCache,
    UntrustedArtifactError,
)
from kcache_client._tier import NodeTier
from kcache_client._trust import KnownServers, Trust
from kcache_server.settings import Settings

from kcache.artifact import ArtifactMeta
from kcache.errors import KCacheError
from kcache.index.file import FileIndex
from kcache.keys import sha256_hex
from kcache.signing import SigningKey, TrustedKeys
from kcache.store.local import LocalArtifactStore
from tests.support import FAST, ServerThread

NOBODY = 65534


def _server(data: Path, key: Path | None, previous: Path | None = None) -> ServerThread:
    return ServerThread(
        Settings(
            data_dir=data,
            compile_workers=1,
            signing_key_file=key,
            signing_previous_key_file=previous,
            audit={"flush_s": 0.05},
        )
    )


def _kcache(argv: list[str], env: dict[str, str]) -> str:
    """The real ``kcache`` command, as a user runs it; its standard output."""
    done = subprocess.run(
        [sys.executable, "-m", "kcache.cli", *argv], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _key(path: Path) -> SigningKey:
    return SigningKey.load_or_create(path)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    home = tmp_path_factory.mktemp("keys")
    for name in ("a", "b", "old", "new"):
        _key(home / f"{name}.pem")
    return {name: home / f"{name}.pem" for name in ("a", "b", "old", "new")}


@pytest.fixture(scope="module")
def server_a(
    tmp_path_factory: pytest.TempPathFactory, keys: dict[str, Path]
) -> Iterator[ServerThread]:
    server = _server(tmp_path_factory.mktemp("a"), keys["a"])
    yield server
    server.stop()


def _cache(url: str, tier: Path, *, trusted: str | None, known: Path) -> KernelCache:
    settings = dataclasses.replace(
        ClientSettings.from_env(auto_target="sm_80", retry=FAST, send_events=False),
        trusted_keys=trusted,
        known_servers=known,
    )
    return KernelCache(url, cache_dir=tier, settings=settings)


def test_a_key_is_made_at_first_start_private_and_kept(tmp_path: Path) -> None:
    server = _server(tmp_path / "data", None)
    try:
        published = server.client().get("/v1/keys").json()
    finally:
        server.stop()
    made = tmp_path / "data" / "signing-key.pem"
    assert stat.S_IMODE(made.stat().st_mode) == 0o600
    assert published["signing_key_id"] == SigningKey.load(made).key_id
    assert [k["key_id"] for k in published["keys"]] == [published["signing_key_id"]]
    again = _server(tmp_path / "data", None)
    try:
        assert again.client().get("/v1/keys").json() == published  # the same key after a restart
    finally:
        again.stop()


def test_first_contact_pins_the_key_and_another_server_on_the_url_is_refused(
    tmp_path: Path, server_a: ServerThread, keys: dict[str, Path]
) -> None:
    known = tmp_path / "known.json"
    proxy = Proxy(server_a.url)
    server_b = _server(tmp_path / "b", keys["b"])
    try:
        first, second, third = kernels(3, "pin", target="sm_80")
        with _cache(proxy.url, tmp_path / "t1", trusted=None, known=known) as cache:
            assert cache.get(first).origin == "compiled"
        assert proxy.count("GET", "/v1/keys") == 1
        pinned = KnownServers(known).keys(proxy.url)
        assert pinned is not None and pinned.key_ids == [_key(keys["a"]).key_id]
        assert stat.S_IMODE(known.stat().st_mode) == 0o600
        with _cache(proxy.url, tmp_path / "t2", trusted=None, known=known) as cache:
            assert cache.get(second).origin == "compiled"
        assert proxy.count("GET", "/v1/keys") == 1  # a later process reads the pin, asks nothing

        proxy.retarget(server_b.url)  # another server (another key) now answers for the URL
        with _cache(proxy.url, tmp_path / "t3", trusted=None, known=known) as cache:
            with pytest.raises(UntrustedArtifactError) as refused:
                cache.get(third)
            assert cache.tier.lookup(cache.key(third)) is None  # nothing stored
        message = str(refused.value)
        assert _key(keys["b"]).key_id in message and str(known) in message
        assert "Another server may be answering" in message
        # The key was replaced on purpose (a server restarted with a new data directory on
        # the same port): the refusal says what to run, and running it is enough.
        command = f"kcache trust forget {proxy.url}"
        assert command in message
        env = {**os.environ, "KCACHE_KNOWN_SERVERS": str(known)}
        listed = _kcache(["trust", "list", "--json"], env)
        assert [s["url"] for s in json.loads(listed)["servers"]] == [proxy.url]
        _kcache(command.split()[1:], env)
        assert stat.S_IMODE(known.stat().st_mode) == 0o600  # rewritten, still this user's only
        with _cache(proxy.url, tmp_path / "t3", trusted=None, known=known) as cache:
            assert cache.get(third).origin in ("server", "compiled")  # B's key, pinned now
        repinned = KnownServers(known).keys(proxy.url)
        assert repinned is not None and repinned.key_ids == [_key(keys["b"]).key_id]
    finally:
        proxy.close()
        server_b.stop()


def test_a_rotation_is_followed_through_the_old_keys_endorsement(
    tmp_path: Path, keys: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    known = tmp_path / "known.json"
    old_id, new_id = _key(keys["old"]).key_id, _key(keys["new"]).key_id
    before = _server(tmp_path / "before", keys["old"])
    after = _server(tmp_path / "after", keys["new"], previous=keys["old"])
    unendorsed = _server(tmp_path / "unendorsed", keys["new"])
    proxy = Proxy(before.url)
    given = f"{_key(keys['old']).public_key},{_key(keys['new']).public_key}"
    try:
        first, second, third, fourth = kernels(4, "rotate", target="sm_80")
        with _cache(proxy.url, tmp_path / "t1", trusted=None, known=known) as cache:
            cache.get(first)
        published = after.client().get("/v1/keys").json()
        assert published["signing_key_id"] == new_id
        assert published["keys"][0]["endorsements"][0]["key_id"] == old_id

        proxy.retarget(unendorsed.url)  # the new key without the old one's word: refused
        with (
            _cache(proxy.url, tmp_path / "t2", trusted=None, known=known) as cache,
            pytest.raises(UntrustedArtifactError, match="no pinned key endorses it"),
        ):
            cache.get(second)

        proxy.retarget(after.url)
        with (
            caplog.at_level(logging.WARNING, "kcache_client"),
            _cache(proxy.url, tmp_path / "t3", trusted=None, known=known) as cache,
        ):
            assert cache.get(third).origin == "compiled"
        assert f"now signs with key {new_id}, endorsed by pinned key {old_id}" in caplog.text
        pinned = KnownServers(known).keys(proxy.url)
        assert pinned is not None and set(pinned.key_ids) == {old_id, new_id}

        # Given keys instead of pins: old and new both trusted for a while, either server served.
        for server, recipe in ((before, fourth), (after, fourth)):
            with _cache(
                server.url, tmp_path / f"g{server.port}", trusted=given, known=known
            ) as cache:
                cache.get(recipe)
    finally:
        proxy.close()
        for server in (before, after, unendorsed):
            server.stop()


def _rewrite_signature(change: str) -> object:
    """A proxy rewrite that strips the fetch's signature, or flips one of its characters."""

    def rewrite(_: object, headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
        headers = dict(headers)
        value = headers.pop("x-kcache-signature", None)
        if value is not None and change == "flip":
            key_id, sig = value.split(".")
            flipped = "B" if sig[5] != "B" else "C"
            headers["x-kcache-signature"] = f"{key_id}.{sig[:5]}{flipped}{sig[6:]}"
        return headers, body

    return rewrite


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ("strip", "carries no signature"),
        ("flip", "does not verify"),
        ("foreign", "not trusted here"),
    ],
)
def test_a_stripped_tampered_or_foreign_signature_is_refused_and_nothing_is_stored(
    tmp_path: Path, server_a: ServerThread, keys: dict[str, Path], change: str, said: str
) -> None:
    proxy = Proxy(server_a.url)
    (recipe,) = kernels(1, f"sig{change}", target="sm_80")
    trusted = _key(keys["b"] if change == "foreign" else keys["a"]).public_key
    try:
        mine = _key(keys["a"]).public_key
        with _cache(server_a.url, tmp_path / "warm", trusted=mine, known=tmp_path / "k0") as warm:
            warm.get(recipe)  # compiled and stored on the server: the fetch by key answers next
        if change != "foreign":
            proxy.faults.rewrite = _rewrite_signature(change)  # type: ignore[assignment]
        with _cache(
            proxy.url, tmp_path / "tier", trusted=trusted, known=tmp_path / "k.json"
        ) as cache:
            with pytest.raises(UntrustedArtifactError, match=said):
                cache.get(recipe)
            assert cache.tier.lookup(cache.key(recipe)) is None
            assert list(cache.tier.store.digests()) == []
    finally:
        proxy.close()


def test_two_replicas_with_one_key_are_both_trusted(
    tmp_path: Path, server_a: ServerThread, keys: dict[str, Path]
) -> None:
    replica = _server(tmp_path / "replica", keys["a"])
    try:
        assert replica.client().get("/v1/keys").json() == server_a.client().get("/v1/keys").json()
        given = _key(keys["a"]).public_key
        for server in (server_a, replica):
            (recipe,) = kernels(1, "replica", target="sm_80")
            with _cache(
                server.url, tmp_path / f"t{server.port}", trusted=given, known=tmp_path / "k"
            ) as cache:
                assert cache.get(recipe).origin == "compiled"
    finally:
        replica.stop()


def test_an_artifact_altered_after_it_was_found_is_not_loaded(
    tmp_path: Path, server_a: ServerThread, keys: dict[str, Path]
) -> None:
    (recipe,) = kernels(1, "alter", target="sm_80")
    with _cache(
        server_a.url, tmp_path / "t", trusted=_key(keys["a"]).public_key, known=tmp_path / "k"
    ) as cache:
        art = cache.get(recipe)
    art.check()
    renamed = dataclasses.replace(
        art, metadata=dataclasses.replace(art.metadata, lowered_names={"x": "y"})
    )
    with pytest.raises(UntrustedArtifactError, match="does not verify"):
        renamed.check()
    with pytest.raises(UntrustedArtifactError, match="does not verify"):
        renamed.load_module()  # refused before cuda.core is even imported


# ------------------------------------------------------------------ the tier's own standing
def _plant(tier_root: Path, recipe_key: str, data: bytes, signature: dict[str, str] | None) -> None:
    """As another user: a blob and an alias under the victim's recipe key."""
    meta = ArtifactMeta(
        digest=sha256_hex(data), size=len(data), kind="cubin", target="sm_80", toolchain="x"
    )
    LocalArtifactStore(tier_root, durable=False, flat=True).put(data)
    FileIndex(tier_root, durable=False, flat=True).write_alias(recipe_key, meta, signature)


def _as_nobody(target: object, *args: object) -> None:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            target(*args)  # type: ignore[operator]
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the other user's process failed"


@pytest.mark.skipif(os.geteuid() != 0, reason="another uid needs root to fork as (CI runs as root)")
@pytest.mark.parametrize("signed_by", [None, "attacker"])
def test_an_entry_another_user_planted_in_a_shared_tier_is_never_used(
    tmp_path: Path,
    server_a: ServerThread,
    keys: dict[str, Path],
    caplog: pytest.LogCaptureFixture,
    signed_by: str | None,
) -> None:
    # Where the other user can reach it (pytest's own temporary directories are 0700).
    shared = Path(tempfile.mkdtemp(prefix="kcache-shared-tier-"))
    try:
        os.chmod(shared, 0o1777)  # what a team shares
        given = _key(keys["a"]).public_key
        (recipe,) = kernels(1, f"plant{signed_by}", target="sm_80")
        with _cache(server_a.url, shared, trusted=given, known=tmp_path / "k") as victim:
            assert victim.tier.standing.kind == "shared"
            key = victim.key(recipe)
            foreign = b"\x7fELF another kernel entirely" * 10
            signature = None
            if signed_by == "attacker":
                meta = ArtifactMeta(
                    digest=sha256_hex(foreign),
                    size=len(foreign),
                    kind="cubin",
                    target="sm_80",
                    toolchain="x",
                )
                signature = SigningKey.generate().sign(key, meta).to_dict()
            _as_nobody(_plant, shared, key, foreign, signature)
            alias = Path(victim.tier.index.alias_path(key))
            assert alias.stat().st_uid == NOBODY  # really planted by the other user
            with caplog.at_level(logging.WARNING, "kcache_client"):
                art = victim.get(recipe)
            assert art.data != foreign and art.origin in ("server", "compiled")
            assert f"not using the entry {alias}" in caplog.text
            assert ("not signed" if signed_by is None else "not trusted") in caplog.text
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_an_untrusted_tier_is_read_for_signed_entries_only_and_never_written(
    tmp_path: Path, server_a: ServerThread, keys: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    open_tier = tmp_path / "open"
    open_tier.mkdir()
    os.chmod(open_tier, 0o777)  # writable by everyone, no sticky bit
    (recipe,) = kernels(1, "untrusted", target="sm_80")
    with (
        caplog.at_level(logging.WARNING, "kcache_client"),
        _cache(
            server_a.url, open_tier, trusted=_key(keys["a"]).public_key, known=tmp_path / "k"
        ) as cache,
    ):
        assert cache.tier.standing.kind == "untrusted"
        assert cache.get(recipe).origin == "compiled"
        assert list(cache.tier.store.digests()) == []  # nothing published into it
        with pytest.raises(KCacheError, match="nothing removed"):
            cache.tier.clear()
    assert "writable by others without the sticky bit" in caplog.text
    assert f"chmod go-w {open_tier}" in caplog.text


def _published_tier(root: Path) -> tuple[NodeTier, str, ArtifactMeta]:
    tier = NodeTier(root, max_bytes=0)
    data = b"kernel" * 100
    meta = ArtifactMeta(
        digest=sha256_hex(data), size=len(data), kind="cubin", target="sm_80", toolchain="x"
    )
    key = "ab" * 32
    tier.publish(key, "cd" * 32, meta, data)
    return tier, key, meta


def _bounded(call: object) -> object:
    """``call()``, which must return within 10 s (a FIFO opened for reading blocks forever)."""
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(call()), daemon=True)  # type: ignore[operator]
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the read hung"
    return result[0]


@pytest.mark.parametrize("what", ["alias", "blob"])
@pytest.mark.parametrize("planted", ["fifo", "dev-zero", "link-to-file"])
def test_a_fifo_device_or_link_in_the_tier_costs_a_refused_entry_not_a_hang(
    tmp_path: Path, what: str, planted: str
) -> None:
    tier, key, meta = _published_tier(tmp_path / "tier")
    path = Path(tier.index.alias_path(key) if what == "alias" else tier.location(meta.digest))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(path.read_bytes())
    path.unlink()
    if planted == "fifo":
        os.mkfifo(path)
    elif planted == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        path.symlink_to(elsewhere)  # the same bytes, but through a link: still refused
    fresh = NodeTier(tmp_path / "tier", max_bytes=0)  # another process: nothing remembered
    assert _bounded(lambda: fresh.lookup(key)) is None
    assert elsewhere.exists()


def test_a_character_device_in_the_tier_is_not_read(tmp_path: Path) -> None:
    tier, key, meta = _published_tier(tmp_path / "tier")
    blob = Path(tier.location(meta.digest))
    blob.unlink()
    try:
        os.mknod(blob, 0o644 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
    except PermissionError:
        pytest.skip("this process may not make device nodes")
    assert _bounded(lambda: NodeTier(tmp_path / "tier", max_bytes=0).lookup(key)) is None


def test_a_linked_blobs_directory_makes_clear_delete_nothing_outside(tmp_path: Path) -> None:
    tier, _, meta = _published_tier(tmp_path / "tier")
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / meta.digest  # a digest-named file of the user's, outside the tier
    victim.write_bytes(b"precious")
    blobs = tmp_path / "tier" / "blobs"
    for entry in blobs.iterdir():
        entry.unlink()
    blobs.rmdir()
    blobs.symlink_to(outside)
    assert tier.check_standing().kind == "untrusted"
    with pytest.raises(KCacheError, match="is a symbolic link"):
        tier.clear()
    reopened = NodeTier(tmp_path / "tier", max_bytes=0)
    assert reopened.standing.kind == "untrusted"
    with pytest.raises(KCacheError, match="nothing removed"):
        reopened.clear()
    assert victim.read_bytes() == b"precious"


def test_a_linked_recipes_directory_makes_publish_write_nothing_outside(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    NodeTier(root, max_bytes=0)
    outside = tmp_path / "outside"
    outside.mkdir()
    recipes = root / "index" / "recipes"
    recipes.rmdir()
    recipes.symlink_to(outside)
    tier = NodeTier(root, max_bytes=0)
    assert tier.standing.kind == "untrusted" and "is a symbolic link" in tier.standing.reason
    data = b"k" * 10
    meta = ArtifactMeta(
        digest=sha256_hex(data), size=len(data), kind="cubin", target="sm_80", toolchain="x"
    )
    assert tier.publish("ef" * 32, "cd" * 32, meta, data) is None
    assert list(outside.iterdir()) == []


def test_a_private_tier_keeps_using_unsigned_local_entries(tmp_path: Path) -> None:
    tier, key, meta = _published_tier(tmp_path / "tier")
    assert tier.standing.kind == "private"
    found = NodeTier(tmp_path / "tier", max_bytes=0).lookup(key)
    assert found is not None and found[0] == meta
    raw = json.loads(Path(tier.index.alias_path(key)).read_bytes())
    assert "signature" not in raw


def test_a_hostile_keys_answer_or_pin_file_pins_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What GET /v1/keys answers and what the pin file holds are input like any other."""
    from kcache_client._trust import _published

    good = SigningKey.generate()
    for body, said in (
        ([], "lists no keys"),
        ({"keys": []}, "lists no keys"),
        ({"keys": [{"key_id": "0" * 16, "public_key": "not base64!"}]}, "base64url"),
        ({"keys": [{"key_id": "0" * 16, "public_key": "AAAA"}]}, "32 bytes"),
        ({"keys": [{"key_id": "0" * 16, "public_key": good.public_key}]}, "not the id of its key"),
    ):
        with pytest.raises(UntrustedArtifactError, match=said):
            _published(body, "http://x")
    known = KnownServers(tmp_path / "known.json")
    for garbage in (b"\x00\xff not json", b"[1, 2]", b'{"http://x": {"keys": {"a": "short"}}}'):
        known.path.write_bytes(garbage)
        with caplog.at_level(logging.WARNING, "kcache_client"):
            assert known.keys("http://x") is None  # as never contacted: pinned afresh
        assert known.pinned_for(good.key_id) == []
    known.pin(
        "http://x",
        _published({"keys": [{"key_id": good.key_id, "public_key": good.public_key}]}, "http://x"),
    )
    pinned = known.keys("http://x")
    assert pinned is not None and pinned.key_ids == [good.key_id]


# ------------------------------------------------------------------ trust per server, verdicts per file
X_URL, Y_URL = "http://x.invalid:1", "http://y.invalid:2"
PLANTED_KEY = "5e" * 32


def _shared_dir() -> Path:
    """A tier directory as a team shares it (sticky, writable by all)."""
    shared = Path(tempfile.mkdtemp(prefix="kcache-shared-tier-"))
    os.chmod(shared, 0o1777)
    return shared


def _pinned_two(path: Path) -> tuple[SigningKey, SigningKey, KnownServers]:
    """Server X's key and server Y's, each pinned for its own URL (this user talked to both)."""
    x, y = SigningKey.generate(), SigningKey.generate()
    known = KnownServers(path)
    known.pin(X_URL, TrustedKeys([x.public_key]))
    known.pin(Y_URL, TrustedKeys([y.public_key]))
    return x, y, known


def test_a_shared_tier_entry_signed_by_another_servers_key_is_refused_for_this_server(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    x, y, known = _pinned_two(tmp_path / "known.json")
    shared = _shared_dir()
    try:
        # Y's operator plants, under a recipe key of X's, a kernel of their choosing signed by Y.
        foreign = b"\x7fELF a kernel of Y's choosing" * 10
        meta = artifact_meta(foreign)
        signed_by_y = y.sign(PLANTED_KEY, meta)
        planter = NodeTier(shared, max_bytes=0, trust=Trust(TrustedKeys(), known, Y_URL))
        assert planter.standing.kind == "shared"
        assert planter.publish(PLANTED_KEY, None, meta, foreign, signed_by_y) is not None

        def through(url: str | None, *given: str) -> object:
            trust = Trust(TrustedKeys(given), known, url)
            return NodeTier(shared, max_bytes=0, trust=trust).lookup(PLANTED_KEY)

        with caplog.at_level(logging.WARNING, "kcache_client"):
            assert through(X_URL) is None  # Y's key vouches for nothing looked up through X
            assert through(None) is None  # without a server, only given keys vouch
        assert (
            f"signed by key {y.key_id} (pinned for {Y_URL} in {known.path}), which is not "
            f"trusted here: it is not one of the keys pinned for {X_URL}"
        ) in caplog.text
        assert "no server is configured" in caplog.text
        assert through(Y_URL) == (meta, foreign)  # the entry is sound, for the server it is Y's
        # Given keys are the fleet's: they vouch for whichever server this client uses.
        assert through(X_URL, y.public_key) == (meta, foreign)
        assert through(X_URL, x.public_key) is None

        # What Artifact.check() runs: the same rule.
        for_x = Trust(TrustedKeys(), known, X_URL + "/")  # spelled with a slash, as a user may
        problem = for_x.entry_problem(PLANTED_KEY, meta, signed_by_y)
        assert problem is not None and "not trusted here" in problem
        assert for_x.entry_problem(PLANTED_KEY, meta, x.sign(PLANTED_KEY, meta)) is None
        # A key X rotates to, pinned by another process since: read from the pin file.
        rotated = SigningKey.generate()
        known.pin(X_URL, TrustedKeys([rotated.public_key]))
        for_x._entry_keys_read = float("-inf")  # as after the reread interval
        assert for_x.entry_problem(PLANTED_KEY, meta, rotated.sign(PLANTED_KEY, meta)) is None
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_second_servers_answer_in_a_shared_tier_is_not_served_through_the_first(
    tmp_path: Path,
    server_a: ServerThread,
    keys: dict[str, Path],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))  # this user's own files
    known = tmp_path / "known.json"
    server_b = _server(tmp_path / "b", keys["b"])
    shared = _shared_dir()
    given = f"{_key(keys['a']).public_key},{_key(keys['b']).public_key}"
    try:
        (recipe,) = kernels(1, "scoped", target="sm_80")
        with _cache(server_b.url, shared, trusted=None, known=known) as via_b:
            planted = via_b.get(recipe)  # B's answer, signed by B's key (pinned for B's URL)
        assert planted.origin == "compiled" and planted.signature is not None
        assert planted.signature.key_id == _key(keys["b"]).key_id

        # Given keys vouch for the configured server: B's entry serves a lookup through A.
        with _cache(server_a.url, shared, trusted=given, known=known) as fleet:
            assert fleet.key(recipe) == planted.recipe_key
            assert fleet.get(recipe).origin == "node"

        # Pinned keys do not: through A, B's entry is refused, and A answers.
        with (
            caplog.at_level(logging.WARNING, "kcache_client"),
            _cache(server_a.url, shared, trusted=None, known=known) as via_a,
        ):
            art = via_a.get(recipe)
            assert art.origin in ("server", "compiled")
            assert art.signature is not None
            assert art.signature.key_id == _key(keys["a"]).key_id
            art.check()
            with pytest.raises(UntrustedArtifactError, match="not trusted here") as refused:
                dataclasses.replace(planted, trust=via_a.trust).check()
            assert str(refused.value).startswith(
                f"refused the artifact of recipe {planted.recipe_key}: it is signed by key"
            )
            # A path is a file of the checked bytes that only this user can write, never
            # the shared tier's own file (its owner could rewrite it after the check).
            assert shared not in art.path.parents and art.path.read_bytes() == art.data
            assert (tmp_path / "user-cache") in art.path.parents
        assert f"(pinned for {server_b.url} in {known})" in caplog.text
    finally:
        server_b.stop()
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.parametrize("how", ["deleted-then-written", "renamed-over"])
def test_a_pack_replaced_under_its_name_while_a_process_runs_is_judged_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    x, _, known = _pinned_two(tmp_path / "known.json")
    shared = _shared_dir()
    try:
        tier = NodeTier(shared, max_bytes=0, trust=Trust(TrustedKeys(), known, X_URL))
        good, foreign = b"\x7fELF X's kernel" * 10, b"\x7fELF another kernel" * 10
        good_meta, foreign_meta = artifact_meta(good), artifact_meta(foreign)
        with tier.packs.writer() as first:
            first.add(PLANTED_KEY, good_meta, good, x.sign(PLANTED_KEY, good_meta))
        pack = Path(first.path)
        absent = "6f" * 32
        assert tier.lookup(absent) is None  # a miss lists the packs: this one indexed
        assert tier.lookup(PLANTED_KEY) == (good_meta, good)  # judged (and remembered)

        # The pack's owner puts another file under its name: the key -> another kernel.
        with tier.packs.writer() as second:
            second.add(
                PLANTED_KEY,
                foreign_meta,
                foreign,
                SigningKey.generate().sign(PLANTED_KEY, foreign_meta),
            )
        if how == "deleted-then-written":
            pack.unlink()
            assert tier.lookup(absent) is None  # this process sees it gone
        os.rename(second.path, pack)
        with caplog.at_level(logging.WARNING, "kcache_client"):
            assert tier.lookup(absent) is None  # ... and then the new file under the name
            assert tier.lookup(PLANTED_KEY) is None  # judged again: refused
            assert tier.held_digest(PLANTED_KEY) is None  # no foreign digest either
        assert f"the entry of recipe {PLANTED_KEY} in pack {pack.stem}" in caplog.text
        assert "which is not trusted here" in caplog.text
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_path_is_a_file_of_the_checked_bytes(tmp_path: Path) -> None:
    """``NodeTier.checked_file``: a private tier's blob when it still holds the checked bytes,
    rewritten from them when not; from a shared tier, nothing (the caller writes its own)."""
    tier, _, meta = _published_tier(tmp_path / "tier")
    data = b"kernel" * 100
    blob = Path(tier.location(meta.digest))
    assert tier.checked_file(meta.digest, data) == str(blob)
    blob.chmod(0o644)
    blob.write_bytes(b"X" * len(data))  # written in place after the check
    assert tier.checked_file(meta.digest, data) == str(blob)
    assert blob.read_bytes() == data
    blob.unlink()
    blob.symlink_to(tmp_path / "elsewhere")
    assert tier.checked_file(meta.digest, data) == str(blob)
    assert not blob.is_symlink() and blob.read_bytes() == data
    shared = _shared_dir()
    try:
        assert NodeTier(shared, max_bytes=0).checked_file(meta.digest, data) is None
    finally:
        shutil.rmtree(shared, ignore_errors=True)
