"""The bounds on every call (issue 30) in ``ClientSettings``/``RetryPolicy`` and the environment."""

from __future__ import annotations

import pytest
from kcache_client import ClientSettings, RetryPolicy
from kcache_client._settings import DEFAULT_MAX_ARTIFACT_BYTES, max_artifact_bytes_from_env

from kcache.errors import KCacheError

VARIABLES = (
    "KCACHE_REQUEST_DEADLINE_S",
    "KCACHE_COMPILE_DEADLINE_S",
    "KCACHE_RETRY_BUDGET_S",
    "KCACHE_CLIENT_MAX_ARTIFACT_BYTES",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*VARIABLES, "KCACHE_URL", "KCACHE_TOKEN", "KCACHE_LOCAL_COMPILE"):
        monkeypatch.delenv(name, raising=False)


def test_the_defaults_are_documented_ones_a_training_job_can_live_with() -> None:
    policy = RetryPolicy()
    assert (policy.deadline_s, policy.compile_deadline_s, policy.budget_s) == (60.0, 900.0, 60.0)
    assert policy.call_bound(compiles=False) == 60.0  # a fetch: a minute, retries included
    assert policy.call_bound(compiles=True) == 900.0  # a resolve may wait for compiles
    settings = ClientSettings.from_env()
    assert settings.retry == policy and settings.max_artifact_bytes == 256 << 20
    assert max_artifact_bytes_from_env() == DEFAULT_MAX_ARTIFACT_BYTES


def test_the_environment_sets_the_bounds_and_arguments_override_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KCACHE_REQUEST_DEADLINE_S", "7.5")
    monkeypatch.setenv("KCACHE_COMPILE_DEADLINE_S", "120")
    monkeypatch.setenv("KCACHE_RETRY_BUDGET_S", " 20 ")
    monkeypatch.setenv("KCACHE_CLIENT_MAX_ARTIFACT_BYTES", "64MiB")
    env = ClientSettings.from_env()
    assert (env.retry.deadline_s, env.retry.compile_deadline_s, env.retry.budget_s) == (
        7.5,
        120.0,
        20.0,
    )
    assert env.retry.attempts == RetryPolicy().attempts  # the rest stays the default
    assert env.max_artifact_bytes == 64 << 20 == max_artifact_bytes_from_env()
    given = ClientSettings.from_env(retry=RetryPolicy(deadline_s=3.0), max_artifact_bytes=4096)
    assert given.retry.deadline_s == 3.0 and given.retry.budget_s == 60.0  # used as it is
    assert given.max_artifact_bytes == 4096
    assert ClientSettings(max_artifact_bytes=1).max_artifact_bytes == 1  # built directly


@pytest.mark.parametrize("variable", VARIABLES)
@pytest.mark.parametrize("value", ["soon", "0", "-1", "nan", "inf"])
def test_a_bad_value_in_the_environment_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    if variable.endswith("_BYTES") and value in ("nan", "inf"):
        value = "lots"
    monkeypatch.setenv(variable, value)
    with pytest.raises(KCacheError, match=variable):
        ClientSettings.from_env()


@pytest.mark.parametrize(
    ("fields", "word"),
    [
        ({"deadline_s": 0.0}, "deadline_s"),
        ({"compile_deadline_s": -1.0}, "compile_deadline_s"),
        ({"deadline_s": float("inf")}, "deadline_s"),
        ({"budget_s": -0.1}, "budget_s"),
        ({"attempts": 0}, "attempts"),
    ],
)
def test_impossible_bounds_are_refused_by_name(fields: dict[str, float], word: str) -> None:
    with pytest.raises(KCacheError, match=word):
        RetryPolicy(**fields)  # type: ignore[arg-type]


def test_impossible_artifact_caps_are_refused_by_name() -> None:
    with pytest.raises(KCacheError, match="max_artifact_bytes"):
        ClientSettings(max_artifact_bytes=0)
    with pytest.raises(KCacheError, match="max_artifact_bytes"):
        ClientSettings.from_env(max_artifact_bytes="0")


def test_a_budget_shorter_than_a_try_only_forbids_retries() -> None:
    policy = RetryPolicy(deadline_s=30.0, compile_deadline_s=600.0, budget_s=4.0)
    assert policy.try_deadline(compiles=False) == 30.0
    assert policy.call_bound(compiles=False) == 30.0  # one try keeps its whole deadline
    assert RetryPolicy(deadline_s=1.0, budget_s=15.0).call_bound(compiles=False) == 15.0
