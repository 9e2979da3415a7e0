"""Settings are checked, and their paths fixed, when they are made, not at the first request.

A relative cache directory followed every later ``os.chdir`` (a second tier, artifacts whose
``path`` named another file), and ``~`` was taken literally. A token that no header can carry,
a URL that is none, a rank that is no number, a key file that is missing, an auto target that is
none and a job id no server records surfaced as bare Python errors, some only at the first
request, one echoing the secret token. Each is now a KCacheError naming the setting and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kcache_client import ClientSettings, KernelCache
from kcache_client._settings import ENVIRONMENT

from kcache import Recipe
from kcache.dirs import cache_dir, toolchain_dir
from kcache.errors import KCacheError

#: Read by KernelCache() or the settings besides ENVIRONMENT's.
_MORE = ("RANK", "WORLD_SIZE", "KCACHE_TOOLCHAIN_DIR", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*ENVIRONMENT.values(), *_MORE):
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------------ paths: absolute, ~ expanded
def test_a_relative_cache_dir_is_fixed_when_the_settings_are_made(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    made = [
        ClientSettings.from_env(cache_dir="rel"),
        ClientSettings(cache_dir=Path("rel")),
        ClientSettings.from_env().located(cache_dir="rel"),
    ]
    monkeypatch.setenv("KCACHE_CACHE_DIR", "rel")
    made.append(ClientSettings.from_env())
    monkeypatch.chdir(tmp_path / "b")
    assert [s.cache_dir for s in made] == [tmp_path / "a" / "rel"] * 4


def test_an_absolute_cache_dir_is_kept_as_it_is(tmp_path: Path) -> None:
    given = tmp_path / "x" / ".." / "y"  # not resolved: the CLI and the client agree on it
    assert cache_dir(given) == given
    assert ClientSettings.from_env(cache_dir=given).cache_dir == given


def test_tilde_is_expanded_in_every_path_setting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    (home / "set").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    settings = ClientSettings.from_env(
        cache_dir="~/kc",
        include_sets={"s": "~/set"},
        known_servers="~/pins.json",
        layers=["~/layer.kcb", "relative-layer"],
    )
    assert settings.cache_dir == home / "kc"
    assert dict(settings.include_sets) == {"s": home / "set"}
    assert settings.known_servers == home / "pins.json"
    assert settings.layers == (home / "layer.kcb", tmp_path / "relative-layer")
    monkeypatch.setenv("KCACHE_CACHE_DIR", "~/env-kc")
    monkeypatch.setenv("KCACHE_CACHE_LAYERS", "~/l1")
    monkeypatch.setenv("KCACHE_CLIENT_INCLUDE_SETS", '{"s": "set"}')
    monkeypatch.chdir(home)
    env = ClientSettings.from_env()
    assert (env.cache_dir, env.layers, dict(env.include_sets)) == (
        home / "env-kc",
        (home / "l1",),
        {"s": home / "set"},
    )
    assert not (home / "~").exists() and not (tmp_path / "~").exists()


def test_the_toolchain_directory_is_absolute_with_tilde_expanded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KCACHE_TOOLCHAIN_DIR", "~/tc")
    assert toolchain_dir() == tmp_path / "tc"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KCACHE_TOOLCHAIN_DIR", "tc2")
    assert toolchain_dir() == tmp_path / "tc2"


def test_a_kernel_cache_keeps_its_tier_across_a_chdir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The tester's case: compiled into a/rel, then found there again after chdir(b)."""
    pytest.importorskip("cuda.bindings")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    src = 'extern "C" __global__ void k_chdir(float* x) { x[threadIdx.x] += 2.0f; }\n'
    recipe = Recipe(source=src, target="sm_80")
    with KernelCache(url="", cache_dir="rel") as cache:
        first = cache.get(recipe)
        assert first.origin == "local_compile"
        path = first.path
        assert os.path.isabs(path) and str(path).startswith(str(tmp_path / "a" / "rel"))
        monkeypatch.chdir(tmp_path / "b")
        cache.forget_memory()
        again = cache.get(recipe)
        assert again.origin == "node"
        assert Path(path).read_bytes() == again.data
    assert not (tmp_path / "b" / "rel").exists()


# ------------------------------------------------------------------ values checked when made
_SECRET = "s3cr3t"


@pytest.mark.parametrize(
    "token", [f"{_SECRET}\r\nX: y", f"{_SECRET}\n", f"{_SECRET}\u00e9", "\u2603"]
)
def test_a_token_no_header_can_carry_is_refused_by_name_and_never_shown(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, token: str
) -> None:
    with pytest.raises(KCacheError, match="token") as given:
        KernelCache(url="http://127.0.0.1:1", token=token, cache_dir=tmp_path)
    monkeypatch.setenv("KCACHE_TOKEN", token)
    with pytest.raises(KCacheError, match="KCACHE_TOKEN") as env:
        KernelCache(url="http://127.0.0.1:1", cache_dir=tmp_path)
    with pytest.raises(KCacheError, match="token"):
        ClientSettings(token=token)
    for raised in (given.value, env.value):
        assert _SECRET not in str(raised) and token not in str(raised)
        assert "\u2603" not in str(raised)


@pytest.mark.parametrize(
    ("name", "value"), [("RANK", "abc"), ("WORLD_SIZE", "4x"), ("WORLD_SIZE", "0")]
)
def test_a_rank_that_is_no_number_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(KCacheError, match=f"{name}={value!r}"):
        KernelCache(url="", cache_dir=tmp_path)


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("127.0.0.1:18800", ["no http:// or https://", "http://127.0.0.1:18800?"]),
        ("localhost", ["no http:// or https://", "http://localhost?"]),
        ("http://127.0.0.1:80800", ["Port out of range"]),
        ("http://host:port", ["Port could not be cast"]),
        ("ftp://kcache.example", ["'ftp' is not http or https"]),
        ("http://", ["no host"]),
        ("http://127.0.0.1:8470/v1", ["ends in /v1", "the server's root"]),
        ("https://kcache.example/prefix/v1/", ["ends in /v1"]),
        (18800, ["int"]),
    ],
)
def test_a_url_that_is_none_is_refused_when_the_settings_are_made(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, url: object, words: list[str]
) -> None:
    with pytest.raises(KCacheError) as raised:
        KernelCache(url=url, cache_dir=tmp_path)  # type: ignore[arg-type]
    text = str(raised.value)
    assert text.startswith("url=")
    assert all(w in text for w in [*words, "KCACHE_URL", "--server", "http://kcache.example:8080"])
    if isinstance(url, str):
        monkeypatch.setenv("KCACHE_URL", url)
        with pytest.raises(KCacheError, match=r"^KCACHE_URL="):
            ClientSettings.from_env()


def test_a_bad_url_is_shown_without_its_credentials() -> None:
    with pytest.raises(KCacheError) as raised:
        ClientSettings.from_env(url="http://me:hunter2@kcache.example:99999/p")
    assert "hunter2" not in str(raised.value) and "***@kcache.example:99999" in str(raised.value)


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:18800", "https://kcache.example/prefix/", "http://[::1]:8080"]
)
def test_good_urls_are_kept(url: str) -> None:
    assert ClientSettings.from_env(url=f" {url} ").url == url


def test_a_missing_trusted_keys_file_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "missing" / "keys"
    monkeypatch.setenv("KCACHE_TRUSTED_KEYS", f"@{missing}")
    with pytest.raises(KCacheError, match="KCACHE_TRUSTED_KEYS") as raised:
        KernelCache(url="", cache_dir=tmp_path / "tier")
    assert str(missing) in str(raised.value)


def test_size_messages_offer_zero_only_where_it_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KCACHE_CLIENT_MAX_ARTIFACT_BYTES", "big")
    with pytest.raises(KCacheError, match="KCACHE_CLIENT_MAX_ARTIFACT_BYTES") as raised:
        ClientSettings.from_env()
    assert "0 for" not in str(raised.value)
    monkeypatch.setenv("KCACHE_CLIENT_MAX_ARTIFACT_BYTES", "0")
    with pytest.raises(KCacheError, match="at least 1 byte"):
        ClientSettings.from_env()
    monkeypatch.delenv("KCACHE_CLIENT_MAX_ARTIFACT_BYTES")
    monkeypatch.setenv("KCACHE_CACHE_MAX_BYTES", "big")
    with pytest.raises(KCacheError, match="or 0 for no cap"):
        ClientSettings.from_env()
    monkeypatch.setenv("KCACHE_CACHE_MAX_BYTES", "0")  # as offered
    assert ClientSettings.from_env().cache_max_bytes == 0


def test_an_auto_target_that_is_none_is_refused_by_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KCACHE_AUTO_TARGET", "sm90")
    with pytest.raises(KCacheError, match="KCACHE_AUTO_TARGET: 'sm90' is not a target"):
        ClientSettings.from_env()
    with pytest.raises(KCacheError, match="auto_target: 'auto' is not a target"):
        ClientSettings.from_env(auto_target="auto")
    monkeypatch.setenv("KCACHE_AUTO_TARGET", "sm_90")
    assert ClientSettings.from_env().auto_target == "sm_90"


@pytest.mark.parametrize(
    "name", ["KCACHE_JOB_ID", "KCACHE_CLIENT_ID", "SLURM_JOB_ID", "KCACHE_CLIENT_HOST"]
)
def test_a_label_no_server_records_is_refused_by_its_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str
) -> None:
    monkeypatch.setenv(name, "j" * 100_000)
    with pytest.raises(KCacheError, match=f"^{name} is 100000 characters long"):
        KernelCache(url="http://127.0.0.1:1", cache_dir=tmp_path)
    monkeypatch.setenv(name, "job\n7")
    with pytest.raises(KCacheError, match=f"^{name}=.*control character"):
        ClientSettings.from_env()
    monkeypatch.setenv(name, "j" * 256)  # the longest the server records
    ClientSettings.from_env()
