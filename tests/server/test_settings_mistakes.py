"""A server's settings mistakes are refused at start in one line naming what to fix.

Each was found by a tester (reproduced twice), and each is a class, tested as one:

- numbers that pass a field's own bounds but break the running server (``inf``,
  ``1e300``, ``1e12`` seconds: every compile a 500, the audit writer dead while the
  server reports ready) are refused for every number setting, the sections' included;
- operator mistakes that ended in "unexpected error ... please report it": signing key
  files holding no usable key, water marks in the wrong order, a MySQL URL, an unknown
  ``db upgrade`` revision, a token file whose value another token holds, a data
  directory that is a file;
- a database migrated by a newer release is said to be one, in ``serve`` and in
  ``db upgrade`` alike, never with advice to upgrade;
- errors about ``KCACHE_AUDIT_*`` and ``KCACHE_VERIFY_*`` name those variables, not
  the section's field under ``KCACHE_``;
- a variable set to the empty string is unset (``KCACHE_DATA_DIR=`` was the current
  directory);
- a ``KCACHE_*`` variable no one reads (a misspelt setting) is warned of at start.

Every command is a real ``kcache`` process in a clean environment (tests/cli_harness.py).
"""

from __future__ import annotations

import json
import math
import os
import socket
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.cli_harness import assert_user_error, error_lines, kcache, user_env
from tests.support import KCACHE, ServerProcess, free_port

#: What an operator's mistake must never read as.
_UNEXPECTED = ("unexpected error", "please report", "Traceback")


def _serve(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``kcache serve`` on a free port with its data directory under ``home``, to its refusal."""
    argv = ["serve", "--port", str(free_port()), *args]
    if "--data-dir" not in args and "KCACHE_DATA_DIR" not in env:
        argv += ["--data-dir", str(home / "data")]
    return kcache(*argv, env=user_env(home, **env), cwd=home, timeout=120)


def _refused(result: subprocess.CompletedProcess[str], *names: str) -> str:
    lines = assert_user_error(result, *names)
    text = "\n".join(lines)
    for word in _UNEXPECTED:
        assert word not in result.stderr, result.stderr
    return text


# ------------------------------------------------------------------ 1: unusable numbers


def _number_fields() -> list[tuple[Any, str, str, Any]]:
    """(model, field, its variable, its annotation) of every number setting, sections included."""
    from kcache_server.settings import AuditSettings, Settings, VerificationSettings

    found = []
    for model in (Settings, AuditSettings, VerificationSettings):
        prefix = model.model_config["env_prefix"]
        for name, info in model.model_fields.items():
            kind = info.annotation
            if kind in (int, float) or "ByteSize" in str(kind):
                found.append((model, name, f"{prefix}{name}".upper(), kind))
    return found


def test_every_number_setting_refuses_what_its_code_cannot_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Walk the fields: non-finite floats, durations past a year, days past 100 years, huge ints."""
    from kcache_server.settings import MAX_DAYS, MAX_INT, MAX_SECONDS, Settings
    from pydantic import ValidationError

    fields = _number_fields()
    assert len(fields) > 40
    names = {variable for _, _, variable, _ in fields}
    for expected in (
        "KCACHE_COMPILE_TIMEOUT_S",
        "KCACHE_AUDIT_FLUSH_S",
        "KCACHE_AUDIT_ROLLUP_INTERVAL_S",
        "KCACHE_VERIFY_PERIOD_S",
        "KCACHE_MAX_STORE_BYTES",
    ):
        assert expected in names
    for _, name, variable, kind in fields:
        bad = ["inf", "nan", "1e300"] if kind is float else [str(MAX_INT + 1)]
        if name.endswith("_s"):
            bad.append(str(MAX_SECONDS + 1))
        if name.endswith("_days"):
            bad.append(str(MAX_DAYS + 1))
        for value in bad:
            monkeypatch.setenv(variable, value)
            with pytest.raises(ValidationError):
                Settings()
            monkeypatch.delenv(variable)
    assert math.isfinite(Settings().compile_timeout_s)  # the defaults pass


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KCACHE_COMPILE_TIMEOUT_S", "inf"),
        ("KCACHE_COMPILE_TIMEOUT_S", "1e300"),
        ("KCACHE_AUDIT_FLUSH_S", "inf"),
        ("KCACHE_AUDIT_FLUSH_S", "1e12"),
        ("KCACHE_AUDIT_ROLLUP_INTERVAL_S", "inf"),
        ("KCACHE_AUDIT_RETENTION_DAYS", "1e300"),
        ("KCACHE_VERIFY_PERIOD_S", "nan"),
        ("KCACHE_LOCK_TIMEOUT_S", "1e12"),
        ("KCACHE_MAX_STORE_BYTES", "99999999999999999999999"),
    ],
)
def test_an_unusable_number_stops_the_start_naming_its_variable(
    tmp_path: Path, variable: str, value: str
) -> None:
    text = _refused(_serve(tmp_path, **{variable: value}), variable)
    assert "dashboard" not in text
    assert not (tmp_path / "data").exists()  # refused before anything was built


def test_the_compile_timeout_flag_and_variable_agree(tmp_path: Path) -> None:
    for value in ("inf", "nan"):
        flag = _serve(tmp_path, "--compile-timeout", value)
        assert flag.returncode != 0 and "finite" in flag.stderr, flag.stderr
        variable = _serve(tmp_path, KCACHE_COMPILE_TIMEOUT_S=value)
        assert variable.returncode != 0 and "KCACHE_COMPILE_TIMEOUT_S" in variable.stderr
    _refused(_serve(tmp_path, "--compile-timeout", "1e300"), "--compile-timeout", "a year")


# ------------------------------------------------------------- 2: operator mistakes


def _key_files(home: Path) -> dict[str, Path]:
    """Files that hold no key a server can use, by what they are."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    contents = {
        "garbage": b"not a key at all\n",
        "empty": b"",
        "der": private.private_bytes(
            serialization.Encoding.DER,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        "public": private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
        "encrypted": private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        ),
    }
    files = {}
    for name, data in contents.items():
        path = home / f"{name}.pem"
        path.write_bytes(data)
        path.chmod(0o600)
        files[name] = path
    return files


@pytest.mark.parametrize(
    "variable", ["KCACHE_SIGNING_KEY_FILE", "KCACHE_SIGNING_PREVIOUS_KEY_FILE"]
)
def test_a_key_file_holding_no_usable_key_names_its_variable(tmp_path: Path, variable: str) -> None:
    for kind, path in _key_files(tmp_path).items():
        text = _refused(_serve(tmp_path, **{variable: str(path)}), variable, path.name)
        if kind == "encrypted":
            assert "passphrase" in text, text
    missing = _refused(_serve(tmp_path, **{variable: "/no/such"}), variable, "/no/such")
    assert "does not exist" in missing


def test_signing_key_public_of_an_encrypted_key_is_one_line(tmp_path: Path) -> None:
    encrypted = _key_files(tmp_path)["encrypted"]
    result = kcache("signing-key", "public", str(encrypted), env=user_env(tmp_path))
    assert "passphrase" in _refused(result, encrypted.name)


@pytest.mark.parametrize(
    "env",
    [{"KCACHE_STORE_LOW_WATER": "0.95"}, {"KCACHE_STORE_HIGH_WATER": "0.5"}],
)
def test_water_marks_out_of_order_name_both_variables(tmp_path: Path, env: dict[str, str]) -> None:
    _refused(_serve(tmp_path, **env), "KCACHE_STORE_LOW_WATER", "KCACHE_STORE_HIGH_WATER")


def test_a_bad_max_store_bytes_flag_is_named_as_the_flag(tmp_path: Path) -> None:
    """It named KCACHE_MAX_STORE_BYTES, a variable the user never set."""
    text = _refused(_serve(tmp_path, "--max-store-bytes", "5XB"), "--max-store-bytes")
    assert "KCACHE_MAX_STORE_BYTES" not in text and "fix the flag" in text


def test_a_mysql_url_says_which_databases_kcache_uses(tmp_path: Path) -> None:
    text = _refused(_serve(tmp_path, "--db-url", "mysql://u@localhost/d"), "--db-url", "mysql")
    assert "sqlite" in text and "postgresql+psycopg" in text


def test_an_include_set_that_names_no_directory_stops_the_start(tmp_path: Path) -> None:
    """It was an "unexpected error" (a ValueError from deep in the start)."""
    missing = json.dumps({"cutlass": str(tmp_path / "no" / "such")})
    text = _refused(_serve(tmp_path, KCACHE_INCLUDE_SETS=missing), "KCACHE_INCLUDE_SETS")
    assert "include set 'cutlass'" in text and "does not exist" in text


def test_a_data_dir_that_is_a_file_says_so(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    text = _refused(_serve(tmp_path, "--data-dir", str(tmp_path / "afile")), "--data-dir")
    assert "not a directory" in text
    under = _refused(
        _serve(tmp_path, KCACHE_DATA_DIR=str(tmp_path / "afile" / "sub")), "KCACHE_DATA_DIR"
    )
    assert "not a directory" in under


def test_db_upgrade_to_an_unknown_revision_lists_the_known_ones(tmp_path: Path) -> None:
    env = user_env(tmp_path)
    data = str(tmp_path / "data")
    assert kcache("db", "upgrade", "--data-dir", data, env=env).returncode == 0
    for revision in ("17", "nonsense"):
        result = kcache("db", "upgrade", revision, "--data-dir", data, env=env)
        assert "head" in _refused(result, repr(revision), "0001")


def test_a_token_file_whose_value_another_token_holds_names_that_token(tmp_path: Path) -> None:
    env = user_env(tmp_path)
    data = str(tmp_path / "data")
    secret = tmp_path / "token"
    secret.write_text("kc_" + "s" * 40 + "\n")
    assert kcache("db", "upgrade", "--data-dir", data, env=env).returncode == 0
    first = kcache(
        "token", "create", "first", "--token-file", str(secret), "--data-dir", data, env=env
    )
    assert first.returncode == 0, first.stderr
    second = kcache(
        "token", "create", "second", "--token-file", str(secret), "--data-dir", data, env=env
    )
    _refused(second, "--token-file", "'first'", str(secret))


# ------------------------------------------------------------------ 3: a newer database


def test_a_database_of_a_newer_release_is_said_to_be_one(tmp_path: Path) -> None:
    from kcache_server.migrate import script_head

    head = script_head()
    assert head is not None
    newer = f"{int(head) + 1:04d}"
    env = user_env(tmp_path)
    data = tmp_path / "data"
    assert kcache("db", "upgrade", "--data-dir", str(data), env=env).returncode == 0
    with sqlite3.connect(data / "kcache.db") as db:
        db.execute("UPDATE alembic_version SET version_num = ?", (newer,))
    for result in (
        _serve(tmp_path, "--data-dir", str(data)),
        kcache("db", "upgrade", "--data-dir", str(data), env=env),
        kcache("db", "upgrade", head, "--data-dir", str(data), env=env),
    ):
        text = _refused(result, "newer release", f"{newer} > {head}")
        assert "run `kcache db upgrade`" not in text, text


# ------------------------------------------------------------------ 4: section prefixes


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KCACHE_VERIFY_ENABLED", "maybe"),
        ("KCACHE_VERIFY_SAMPLE_RATE", "2"),
        ("KCACHE_VERIFY_CPU_SHARE", "0"),
        ("KCACHE_AUDIT_RETENTION_DAYS", "-1"),
        ("KCACHE_AUDIT_FLUSH_S", "0"),
        ("KCACHE_AUDIT_MAX_EVENTS_PER_BATCH", "0"),
    ],
)
def test_a_section_setting_is_named_by_its_own_variable(
    tmp_path: Path, variable: str, value: str
) -> None:
    text = _refused(_serve(tmp_path, **{variable: value}), f"{variable}=")
    field = variable.split("_", 2)[2]  # ENABLED, SAMPLE_RATE, ...
    assert f"KCACHE_{field}=" not in text, text


# ------------------------------------------------------------------ 5: empty is unset


def test_an_empty_variable_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every setting's variable set to '' reads as its default (one setting or section at a time)."""
    from kcache_server.settings import Settings, settings_variables

    for name in [n for n in os.environ if n.upper().startswith("KCACHE_")]:
        monkeypatch.delenv(name)
    defaults = Settings()
    for variable, _, _ in settings_variables():
        monkeypatch.setenv(variable, "")
        assert Settings() == defaults, variable
        monkeypatch.delenv(variable)


def test_an_empty_data_dir_serves_the_default_not_the_current_directory(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    env = user_env(tmp_path, KCACHE_DATA_DIR="", KCACHE_DB_URL="", KCACHE_SIGNING_KEY_FILE="")
    server = ServerProcess(
        work / ".kcache",
        env=env,
        cwd=work,
        log=tmp_path / "serve.log",
        command=lambda port: [KCACHE, "serve", "--port", str(port)],
    )
    with server.start(ready="/readyz"):
        pass
    assert sorted(p.name for p in work.iterdir()) == [".kcache"]
    assert (work / ".kcache" / "kcache.db").exists()
    assert (work / ".kcache" / "signing-key.pem").exists()


# ------------------------------------------------------------- 6: unknown variables


def test_a_misspelt_variable_is_warned_of_naming_the_setting_meant(tmp_path: Path) -> None:
    with socket.socket() as busy:  # serve stops at the busy port, after its warnings
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = user_env(
            tmp_path,
            KCACHE_MAX_STORE_BYTE="1GiB",
            KCACHE_COMPILE_WORKER="9",
            KCACHE_ZZZ_QQQ="1",
            KCACHE_URL="http://elsewhere:8470",  # the client's, known
            KCACHE_DEBUG="",  # the core's, known
        )
        result = kcache(
            "serve", "--port", str(port), "--data-dir", str(tmp_path / "d"), env=env, cwd=tmp_path
        )
    lines = error_lines(result)
    assert result.returncode == 1 and "in use" in lines[-1], result.stderr
    warnings = [line for line in lines if "is not a kcache setting" in line]
    assert len(warnings) == 3, lines
    by_name = {line.split()[0]: line for line in warnings}
    assert "did you mean KCACHE_MAX_STORE_BYTES?" in by_name["KCACHE_MAX_STORE_BYTE"]
    assert "did you mean KCACHE_COMPILE_WORKERS?" in by_name["KCACHE_COMPILE_WORKER"]
    assert "did you mean" not in by_name["KCACHE_ZZZ_QQQ"]
    assert "Traceback" not in result.stderr


def test_the_server_knows_every_client_variable() -> None:
    """The server keeps its own list (it never imports the client): it must hold the client's."""
    from kcache_client._settings import ENVIRONMENT
    from kcache_server.settings import KNOWN_OTHER_VARIABLES, unknown_variables

    missing = set(ENVIRONMENT.values()) - KNOWN_OTHER_VARIABLES
    assert not missing, f"add to KNOWN_OTHER_VARIABLES: {sorted(missing)}"
    assert unknown_variables(dict.fromkeys(ENVIRONMENT.values(), "x")) == []
