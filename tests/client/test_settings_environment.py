"""Every client setting has an environment variable, and ``from_env`` reads each one.

Issue 31: retries and timeouts had none, so a job could not shorten a retry budget
without code. ``ENVIRONMENT`` is the one table of names (``kcache config`` prints it
with each value's source); these tests hold it to every field and to ``from_env``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
from kcache_client import ClientSettings, RetryPolicy
from kcache_client._settings import ENVIRONMENT

from kcache.errors import KCacheError
from kcache.signing import SigningKey


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [*ENVIRONMENT.values(), "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"]:
        monkeypatch.delenv(name, raising=False)


def _read(settings: ClientSettings, name: str) -> Any:
    head, _, part = name.partition(".")
    value = getattr(settings, head)
    return getattr(value, part) if part else value


def test_every_setting_has_a_variable() -> None:
    fields = {f.name for f in dataclasses.fields(ClientSettings)} - {"retry", "timeout"}
    fields |= {f"retry.{f.name}" for f in dataclasses.fields(RetryPolicy)}
    fields |= {"timeout.connect", "timeout.read"}
    assert fields == set(ENVIRONMENT), fields ^ set(ENVIRONMENT)
    assert len(set(ENVIRONMENT.values())) == len(ENVIRONMENT)  # one variable, one setting


#: A public key other than the one the suite's clients are given (tests/conftest.py).
_A_KEY = SigningKey.generate().public_key


def _samples(tmp_path: Path) -> dict[str, tuple[str, Any]]:
    (tmp_path / "set").mkdir()
    return {
        "url": ("http://env:1", "http://env:1"),
        "offline": ("1", True),
        "token": ("kc_t", "kc_t"),
        "cache_dir": (str(tmp_path / "tier"), tmp_path / "tier"),
        "cache_max_bytes": ("1MiB", 1 << 20),
        "local_compile": ("1", True),
        "include_sets": (f'{{"s": "{tmp_path / "set"}"}}', {"s": tmp_path / "set"}),
        "job_id": ("job-7", "job-7"),
        "client_id": ("me", "me"),
        "host": ("node-3", "node-3"),
        "auto_target": ("sm_80", "sm_80"),
        "device": ("2", 2),
        "send_events": ("0", False),
        "memory_entries": ("17", 17),
        "lock_timeout_s": ("12.5", 12.5),
        "withdrawal_check_s": ("5", 5.0),
        "retry.attempts": ("2", 2),
        "retry.base_s": ("0.05", 0.05),
        "retry.cap_s": ("1.5", 1.5),
        "retry.budget_s": ("7", 7.0),
        "retry.max_retry_after_s": ("3", 3.0),
        "retry.deadline_s": ("11", 11.0),
        "retry.compile_deadline_s": ("99", 99.0),
        "timeout.connect": ("1.25", 1.25),
        "timeout.read": ("42", 42.0),
        "max_artifact_bytes": ("2MiB", 2 << 20),
        "trusted_keys": (_A_KEY, _A_KEY),
        "known_servers": (str(tmp_path / "pins.json"), tmp_path / "pins.json"),
        "bypass": ("error", "error"),
        "after_warmup": ("error", "error"),
        "layers": (
            f"{tmp_path / 'a'}{os.pathsep}{tmp_path / 'b'}",
            (tmp_path / "a", tmp_path / "b"),
        ),
    }


@pytest.mark.parametrize("name", sorted(ENVIRONMENT))
def test_from_env_reads_each_variable(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    samples = _samples(tmp_path)
    assert name in samples, f"give the setting {name} a sample value in _samples()"
    raw, expected = samples[name]
    before = _read(ClientSettings.from_env(), name)
    monkeypatch.setenv(ENVIRONMENT[name], raw)
    after = _read(ClientSettings.from_env(), name)
    assert after == expected and after != before


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("retry.attempts", "0"),
        ("retry.attempts", "many"),
        ("retry.budget_s", "-1"),
        ("timeout.connect", "soon"),
        ("memory_entries", "0"),
        ("device", "-1"),
        ("send_events", "perhaps"),
        ("include_sets", "[1, 2]"),
        ("include_sets", "{not json"),
    ],
)
def test_a_bad_value_names_its_variable(
    name: str, raw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENVIRONMENT[name], raw)
    with pytest.raises(KCacheError, match=ENVIRONMENT[name]):
        ClientSettings.from_env()


def test_arguments_still_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KCACHE_MEMORY_ENTRIES", "17")
    monkeypatch.setenv("KCACHE_RETRY_ATTEMPTS", "2")
    given = RetryPolicy(attempts=9)
    settings = ClientSettings.from_env(memory_entries=5, retry=given, send_events=False)
    assert (settings.memory_entries, settings.retry, settings.send_events) == (5, given, False)
    assert os.environ["KCACHE_MEMORY_ENTRIES"] == "17"


def test_a_commands_own_defaults_give_way_to_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert RetryPolicy.from_env(attempts=4, budget_s=4.0).budget_s == 4.0
    monkeypatch.setenv("KCACHE_RETRY_BUDGET_S", "30")
    policy = RetryPolicy.from_env(attempts=4, budget_s=4.0)
    assert (policy.attempts, policy.budget_s) == (4, 30.0)
