"""``X-KCache-Meta``: the artifact metadata of a fetch by key, encoded once, decoded as hostile."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from kcache.artifact import ArtifactMeta
from kcache.artifact_header import (
    MAX_CHARS,
    decode_meta,
    encode_meta,
    encode_withdrawals_through,
    parse_meta,
    parse_withdrawals_through,
)
from kcache.deps import DEPENDENCY_CHECK, Dependency

META = ArtifactMeta(
    digest="ab" * 32,
    size=3588,
    kind="cubin",
    target="sm_90a",
    toolchain="nvrtc-13.0-abc",
    lowered_names={"add<float, 256>": "_Z3addIfLi256EEvPT_"},
    compile_seconds=0.25,
    log="kernel.cu(3): warning: something long",
    dependencies=(Dependency("a.h", "cd" * 32), Dependency("lib:x/y.h", "ef" * 32)),
    dependencies_exact=True,
    kernel="add",
    created_at=1_790_000_000.5,
    dependency_check=DEPENDENCY_CHECK,
)


def _encode(data: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def _fields() -> dict[str, Any]:
    return META.to_dict()


def test_round_trip_keeps_everything_the_log_included() -> None:
    value = encode_meta(META)
    assert value is not None and value.isascii() and "=" not in value and "\n" not in value
    assert decode_meta(value) == META  # a kernel fetched by key keeps its compile's warnings
    padded = value + "=" * (-len(value) % 4)
    assert json.loads(base64.urlsafe_b64decode(padded)) == _fields()  # plain JSON, nothing else


def test_an_older_servers_header_without_a_log_reads_as_an_empty_log() -> None:
    fields = _fields()
    del fields["log"]
    assert decode_meta(_encode(fields)) == ArtifactMeta(**{**vars(META), "log": ""})


def test_a_log_too_long_for_a_header_sends_none_so_the_metadata_route_is_read() -> None:
    long_log = ArtifactMeta(**{**vars(META), "log": "kernel.cu(3): warning: w\n" * 2000})
    assert encode_meta(long_log) is None


def test_metadata_too_long_for_a_header_is_not_sent() -> None:
    many = tuple(Dependency(f"lib:dir/header_{i:05d}.h", "0" * 64) for i in range(400))
    big = ArtifactMeta(**{**vars(META), "dependencies": many})
    assert encode_meta(big) is None
    with pytest.raises(ValueError, match="over the limit"):
        decode_meta("A" * (MAX_CHARS + 1))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"digest": "AB" * 32}, "digest"),
        ({"digest": "ab" * 31}, "digest"),
        ({"size": -1}, "size"),
        ({"size": True}, "size"),
        ({"size": "3588"}, "size"),
        ({"kind": "elf"}, "kind"),
        ({"target": 90}, "target"),
        ({"toolchain": None}, "toolchain"),
        ({"kernel": "k" * 5000}, "kernel"),
        ({"lowered_names": {"a": 1}}, "lowered_names"),
        ({"lowered_names": []}, "lowered_names"),
        ({"dependencies": [{"name": "a.h"}]}, "dependencies[0]"),
        ({"dependencies": [{"name": 1, "sha256": "0" * 64}]}, "dependencies[0]"),
        ({"dependencies": {"a.h": "0" * 64}}, "dependencies"),
        ({"dependencies_exact": 1}, "dependencies_exact"),
        ({"compile_seconds": "fast"}, "compile_seconds"),
        ({"compile_seconds": float("nan")}, "compile_seconds"),
        ({"created_at": float("inf")}, "created_at"),
        ({"log": 7}, "log"),
        ({"dependency_check": -1}, "dependency_check"),
        ({"dependency_check": True}, "dependency_check"),
        ({"dependency_check": "1"}, "dependency_check"),
    ],
)
def test_every_malformed_field_is_refused_by_name(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as info:
        decode_meta(_encode({**_fields(), **change}))
    assert field in str(info.value)


@pytest.mark.parametrize("missing", sorted(set(_fields()) - {"dependency_check", "log"}))
def test_every_field_but_the_log_is_required(missing: str) -> None:
    fields = _fields()
    del fields[missing]
    with pytest.raises(ValueError, match=missing):
        decode_meta(_encode(fields))


def test_metadata_of_an_older_server_says_its_dependencies_are_unproven() -> None:
    fields = _fields()
    assert fields["dependency_check"] >= 1  # what this release records
    del fields["dependency_check"]
    assert decode_meta(_encode(fields)).dependency_check == 0


@pytest.mark.parametrize("value", ["%%%", "eyJ", _encode([1, 2]), _encode("x"), ""])
def test_what_is_not_a_base64url_json_object_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="X-KCache-Meta"):
        decode_meta(value)


def test_json_bodies_are_checked_the_same_way_with_their_log() -> None:
    assert parse_meta(META.to_dict()) == META
    with pytest.raises(ValueError, match="resolve: kind"):
        parse_meta({**META.to_dict(), "kind": "exe"}, "resolve")


@pytest.mark.parametrize(
    ("value", "read"),
    [
        ("0", 0),
        ("42", 42),
        ("9" * 18, int("9" * 18)),
        (None, None),
        ("", None),
        ("-1", None),
        ("+1", None),
        (" 1", None),
        ("1.0", None),
        ("0x10", None),
        ("\u0661", None),  # an Arabic-Indic one: a digit to str.isdigit, not a decimal here
        ("9" * 19, None),
    ],
)
def test_the_withdrawals_position_is_a_plain_decimal_or_nothing(
    value: str | None, read: int | None
) -> None:
    assert parse_withdrawals_through(value) == read


def test_the_withdrawals_position_is_sent_as_it_is_read_and_not_at_all_when_unknown() -> None:
    assert encode_withdrawals_through(None) == {}
    for through in (0, 7, 10**17):
        ((name, value),) = encode_withdrawals_through(through).items()
        assert name == "X-KCache-Withdrawals-Through"
        assert parse_withdrawals_through(value) == through
