"""Servers on one database sign with one key: recorded at start-up, another refused, rotations
and deliberate replacements (kcache_server.signing_keys, ``kcache db signing-keys``).

Real databases (SQLite files and fresh PostgreSQL databases), real keys, the real start-up
step (:func:`~kcache_server.signing_keys.record_at_start`, as ``create_app`` runs it) and the
real commands. Two starts at once with different keys are raced on real connections (one
of them must refuse), and once as two ``kcache serve`` processes on one PostgreSQL database.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from kcache_server.db import open_database
from kcache_server.errors import SigningKeyConflictError
from kcache_server.models import signing_keys_table as TABLE
from kcache_server.models import utcnow
from kcache_server.settings import Settings
from kcache_server.signer import ArtifactSigner
from kcache_server.signing_keys import record_at_start, recorded_keys

from kcache.signing import SigningKey
from tests.support import ServerProcess, pg_database, upgrade

#: Start-ups raced per database: each round two keys, a table emptied between rounds.
RACE_ROUNDS = 8


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database at the head revision, SQLite or a fresh PostgreSQL one."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'data' / 'kcache.db'}"
        (tmp_path / "data").mkdir()
        upgrade(url)
        yield url
    else:
        with pg_database("kcache_keys") as url:
            upgrade(url)
            yield url


@pytest.fixture
def keys(tmp_path: Path) -> Callable[[str], Path]:
    """A key file per name (made once, mode 0600)."""

    def key(name: str) -> Path:
        path = tmp_path / "keys" / f"{name}.pem"
        SigningKey.load_or_create(path)
        return path

    return key


def _start(
    url: str, tmp_path: Path, key: Path, previous: Path | None = None
) -> tuple[str, ArtifactSigner]:
    """What a server's start-up does with its key: load it, record it or be refused."""
    settings = Settings(
        data_dir=tmp_path / "data",
        db_url=url,
        signing_key_file=key,
        signing_previous_key_file=previous,
    )
    signer = ArtifactSigner.load(key, previous, create=False)
    engine = open_database(url)
    try:
        return record_at_start(engine, signer, settings), signer
    finally:
        engine.dispose()


def _states(url: str) -> dict[str, str]:
    engine = open_database(url)
    try:
        return {k.key_id: k.state for k in recorded_keys(engine)}
    finally:
        engine.dispose()


def _id(path: Path) -> str:
    return SigningKey.load(path).key_id


def _kcache(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kcache.cli", "db", "signing-keys", *args, "--db-url", url],
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_first_key_is_recorded_and_another_key_refused_in_one_line(
    db_url: str, tmp_path: Path, keys: Callable[[str], Path]
) -> None:
    fleet, other = keys("fleet"), keys("other")
    assert _start(db_url, tmp_path, fleet)[0] == "recorded"
    assert _start(db_url, tmp_path, fleet)[0] == "in use"  # every replica, every restart
    with pytest.raises(SigningKeyConflictError) as refused:
        _start(db_url, tmp_path, other)
    message = str(refused.value)
    assert "\n" not in message
    assert f"names key {_id(fleet)} as the signing key" in message
    assert f"this server signs with key {_id(other)} (KCACHE_SIGNING_KEY_FILE={other})" in message
    assert f"`kcache db signing-keys retire {_id(fleet)}`" in message
    assert _states(db_url) == {_id(fleet): "in use"}  # the refused key left nothing behind


def test_a_server_that_made_its_own_key_is_told_to_set_the_key_file(
    tmp_path: Path, keys: Callable[[str], Path]
) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    upgrade(url)
    _start(url, tmp_path, keys("fleet"))
    # A replica on its embedded default: the key made in its data directory.
    settings = Settings(data_dir=tmp_path / "replica", db_url=url, signing_key_file=None)
    signer = ArtifactSigner.load(settings.signing_key_path, None, create=True)
    engine = open_database(url)
    try:
        with pytest.raises(SigningKeyConflictError) as refused:
            record_at_start(engine, signer, settings)
    finally:
        engine.dispose()
    assert (
        f"KCACHE_SIGNING_KEY_FILE is unset, so it was made as {tmp_path / 'replica' / 'signing-key.pem'}"
        in str(refused.value)
    )


def _race(url: str, tmp_path: Path, paths: list[Path]) -> tuple[list[str], list[str]]:
    """Start with each key at once, each on its own connection: (outcomes, refusals)."""
    barrier = threading.Barrier(len(paths))
    outcomes: list[str] = []
    refusals: list[str] = []
    errors: list[BaseException] = []

    def start(path: Path) -> None:
        settings = Settings(data_dir=tmp_path / "data", db_url=url, signing_key_file=path)
        signer = ArtifactSigner.load(path, None, create=False)
        engine = open_database(url)
        try:
            with engine.connect():  # connected before the race, as a starting server is
                pass
            barrier.wait()
            outcomes.append(record_at_start(engine, signer, settings))
        except SigningKeyConflictError as exc:
            refusals.append(str(exc))
        except BaseException as exc:
            errors.append(exc)
        finally:
            engine.dispose()

    threads = [threading.Thread(target=start, args=(p,)) for p in paths]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return outcomes, refusals


def test_two_starts_at_once_with_different_keys_one_refused(
    db_url: str, tmp_path: Path, keys: Callable[[str], Path]
) -> None:
    for round_ in range(RACE_ROUNDS):
        paths = [keys(f"a{round_}"), keys(f"b{round_}")]
        outcomes, refusals = _race(db_url, tmp_path, paths)
        assert outcomes == ["recorded"] and len(refusals) == 1, (outcomes, refusals)
        states = _states(db_url)
        assert list(states.values()) == ["in use"] and set(states) < {_id(p) for p in paths}
        (winner,) = states
        assert f"names key {winner} as the signing key" in refusals[0]
        engine = sa.create_engine(db_url)
        with engine.begin() as conn:
            conn.execute(sa.delete(TABLE))
        engine.dispose()


def test_the_database_itself_holds_one_key_in_use(db_url: str) -> None:
    engine = sa.create_engine(db_url)
    row = {"public_key": "x" * 43, "recorded_at": utcnow()}
    try:
        with engine.begin() as conn:
            conn.execute(sa.insert(TABLE).values(key_id="a" * 16, active=True, **row))
            conn.execute(sa.insert(TABLE).values(key_id="b" * 16, active=None, **row))
            conn.execute(sa.insert(TABLE).values(key_id="d" * 16, active=None, **row))
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(sa.insert(TABLE).values(key_id="c" * 16, active=True, **row))
    finally:
        engine.dispose()


def test_a_rotation_records_the_new_key_and_supersedes_the_old(
    db_url: str, tmp_path: Path, keys: Callable[[str], Path]
) -> None:
    old, new = keys("old"), keys("new")
    _start(db_url, tmp_path, old)
    assert _start(db_url, tmp_path, new, previous=old)[0] == "rotated"
    assert _states(db_url) == {_id(new): "in use", _id(old): "superseded"}
    assert _start(db_url, tmp_path, new, previous=old)[0] == "in use"  # the other replicas
    assert _start(db_url, tmp_path, new)[0] == "in use"  # the previous key dropped later
    # A server started with the old key alone would sign beside the new one: refused.
    with pytest.raises(SigningKeyConflictError) as refused:
        _start(db_url, tmp_path, old)
    assert "superseded by it on" in str(refused.value)
    assert f"names key {_id(new)} as the signing key" in str(refused.value)
    # Undone: the new key retired, the old one signs again.
    assert _kcache(db_url, "retire", _id(new), "--reason", "rolled back").returncode == 0
    assert _start(db_url, tmp_path, old)[0] == "restored"
    assert _states(db_url) == {_id(old): "in use", _id(new): "retired"}


def test_a_database_upgraded_mid_rotation_records_both_keys(
    db_url: str, tmp_path: Path, keys: Callable[[str], Path]
) -> None:
    old, new = keys("old"), keys("new")
    assert _start(db_url, tmp_path, new, previous=old)[0] == "recorded"
    assert _states(db_url) == {_id(new): "in use", _id(old): "superseded"}


def test_a_lost_key_is_replaced_by_retiring_it(
    db_url: str, tmp_path: Path, keys: Callable[[str], Path]
) -> None:
    lost, replacement = keys("lost"), keys("replacement")
    _start(db_url, tmp_path, lost)
    with pytest.raises(SigningKeyConflictError):
        _start(db_url, tmp_path, replacement)

    listed = _kcache(db_url, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert row["key_id"] == _id(lost) and row["state"] == "in use"
    assert row["public_key"] == SigningKey.load(lost).public_key

    retired = _kcache(db_url, "retire", _id(lost), "--reason", "the node was stolen")
    assert retired.returncode == 0, retired.stderr
    assert retired.stdout.strip() == f"retired {_id(lost)}"
    assert "KCACHE_TRUSTED_KEYS" in retired.stderr  # clients must drop it too
    assert _start(db_url, tmp_path, replacement)[0] == "recorded"

    # The retired key never signs again, even with nothing else in use.
    _kcache(db_url, "retire", _id(replacement))
    with pytest.raises(SigningKeyConflictError) as refused:
        _start(db_url, tmp_path, lost)
    message = str(refused.value)
    assert "\n" not in message and "retired for good" in message
    assert "the node was stolen" in message and "KCACHE_SIGNING_KEY_FILE" in message

    text = _kcache(db_url)  # the default action lists, one line a key
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert len(lines) == 2 and all("\tretired\t" in line for line in lines)
    assert any("(the node was stolen)" in line for line in lines)
    again = _kcache(db_url, "retire", _id(lost))
    assert again.returncode == 0 and "already retired" in again.stderr
    unknown = _kcache(db_url, "retire", "0" * 16)
    assert unknown.returncode != 0 and "no signing key 0000000000000000" in unknown.stderr
    bad = _kcache(db_url, "retire", "nothex")
    assert bad.returncode == 2 and "16 hex digits" in bad.stderr


@pytest.mark.postgres
def test_two_replicas_starting_at_once_with_different_keys_one_serves(
    tmp_path: Path, keys: Callable[[str], Path]
) -> None:
    with pg_database("kcache_keys") as url:
        upgrade(url)
        replicas = [
            ServerProcess(
                tmp_path / name,
                db_url=url,
                env={
                    **os.environ,
                    "KCACHE_COMPILE_WORKERS": "1",
                    "KCACHE_SIGNING_KEY_FILE": str(keys(name)),
                },
            )
            for name in ("a", "b")
        ]
        try:
            for replica in replicas:
                replica.launch()
            served, refused = [], []
            for replica in replicas:
                try:
                    replica.wait_ready()
                    served.append(replica)
                except RuntimeError:
                    refused.append(replica)
            assert len(served) == 1 and len(refused) == 1, [r.log_tail() for r in replicas]
            (loser,) = refused
            assert loser.proc is not None and loser.proc.returncode == 2
            lines = [
                line for line in loser.log.read_text().splitlines() if line.startswith("kcache:")
            ]
            assert len(lines) == 1 and "refusing to start" in lines[0], loser.log_tail()
            assert "KCACHE_SIGNING_KEY_FILE" in lines[0]
            assert "Traceback" not in loser.log.read_text()
        finally:
            for replica in replicas:
                replica.stop()


def test_public_halves_never_replace_a_private_key_or_another_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``signing-key create --public`` and ``signing-key public --out`` write a public key file,
    replacing only such a file: a private key named by mistake (or the key itself) is kept."""
    from kcache.cli import main

    first, second = tmp_path / "a.pem", tmp_path / "b.pem"
    assert main(["signing-key", "create", str(first)]) == 0
    assert main(["signing-key", "create", str(second)]) == 0
    keys = {path: path.read_bytes() for path in (first, second)}
    source = tmp_path / "add.cu"
    source.write_text("// a source\n")
    capsys.readouterr()
    for argv in (
        ["signing-key", "public", str(second), "--out", str(first)],
        ["signing-key", "public", str(second), "--out", str(second)],
        ["signing-key", "public", str(second), "--out", str(source)],
        ["signing-key", "create", str(tmp_path / "c.pem"), "--public", str(first)],
    ):
        assert main(argv) == 2, argv
        assert "not a public key file" in capsys.readouterr().err
    assert {path: path.read_bytes() for path in keys} == keys
    assert source.read_text() == "// a source\n"
    assert not (tmp_path / "c.pem").exists()  # refused before a key was made
    # A public key file is written, and written again (the same command run twice).
    public = tmp_path / "fleet-key.pub"
    for _ in range(2):
        assert main(["signing-key", "public", str(second), "--out", str(public)]) == 0
    assert SigningKey.load(second).public_key in public.read_text()
