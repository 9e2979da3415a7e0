"""Conventions every ``kcache`` command keeps.

- ``--header FILE`` names the header by its file name, as ``--header NAME=FILE`` would
  (the help said NAME=FILE and ``--header mytile.h`` was refused, "must look like
  NAME=VALUE").
- Exit status 1 when what was asked could not be done (a server out of reach), 2 when
  what was asked is wrong: ``cache info --server`` exited 1 and ``get``/``compile``/
  ``stats`` 2 for the same unreachable server.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.cli_harness import assert_user_error, kcache, user_env

SOURCE = '#include "mytile.h"\n__global__ void k(float* x) { x[0] = TILE; }\n'


def _key(home: Path, *header: str) -> str:
    result = kcache("key", "k.cu", "--target", "sm_90", *header, env=user_env(home), cwd=home)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_a_header_given_as_a_file_is_named_by_its_file_name(tmp_path: Path) -> None:
    (tmp_path / "k.cu").write_text(SOURCE)
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "mytile.h").write_text("#define TILE 8\n")
    by_file = _key(tmp_path, "--header", "inc/mytile.h")
    assert by_file == _key(tmp_path, "--header", "mytile.h=inc/mytile.h")
    assert by_file != _key(tmp_path, "--header", "other.h=inc/mytile.h")
    assert re.fullmatch("[0-9a-f]{64}", by_file), by_file


def test_a_spec_without_a_value_names_its_own_form(tmp_path: Path) -> None:
    (tmp_path / "k.cu").write_text(SOURCE)
    result = kcache(
        "key", "k.cu", "--target", "sm_90", "--spec", "dtype", env=user_env(tmp_path), cwd=tmp_path
    )
    assert_user_error(result, "--spec", "KEY=JSON")


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("headers", ["a.h"], "must be an object"),
        ("headers", "a.h", "must be an object"),
        ("specialization", [1], "must be an object"),
        ("flags", "-lineinfo", "must be a list"),  # was taken apart: '-', 'l', ...
        ("name_expressions", "add", "must be a list"),
        ("include_sets", "cutlass", "must be a list"),
    ],
)
def test_a_recipe_file_field_of_the_wrong_type_is_named(
    tmp_path: Path, field: str, value: object, said: str
) -> None:
    """A recipe file's field that the command line adds to is checked before it is: a string
    was taken apart into characters (flags '-', 'l', ...), a list into pairs (a traceback)."""
    recipe = {"source": SOURCE, "target": "sm_90", field: value}
    (tmp_path / "r.json").write_text(json.dumps(recipe))
    result = kcache("key", "r.json", env=user_env(tmp_path), cwd=tmp_path)
    assert_user_error(result, f"r.json: {field}: {said}")


def test_a_byte_order_mark_is_no_part_of_a_source_or_header(tmp_path: Path) -> None:
    """An editor's UTF-8 BOM at a file's start failed NVRTC ("unrecognized token"); the key
    is the one of the same text without it."""
    plain = _key_of(tmp_path, "plain", SOURCE.encode(), b"#define TILE 8\n")
    marked = _key_of(
        tmp_path, "marked", b"\xef\xbb\xbf" + SOURCE.encode(), b"\xef\xbb\xbf#define TILE 8\n"
    )
    assert marked == plain


def _key_of(tmp_path: Path, name: str, source: bytes, header: bytes) -> str:
    home = tmp_path / name
    home.mkdir()
    (home / "k.cu").write_bytes(source)
    (home / "mytile.h").write_bytes(header)
    return _key(home, "--header", "mytile.h")


@pytest.mark.parametrize(
    "command", [["verify"], ["gc"], ["cache", "info"], ["cache", "ls"], ["layers"]], ids=" ".join
)
def test_reading_commands_never_make_a_cache_of_another_directory(
    tmp_path: Path, command: list[str]
) -> None:
    """A project's directory named by mistake got LAYOUT, blobs/ and index/ written into it
    (verify, gc, layers), a missing one was made (layers)."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("hi\n")
    env = user_env(tmp_path)
    result = kcache(*command, "--cache-dir", str(project), env=env, cwd=tmp_path)
    assert_user_error(result, "is not a kcache cache directory")
    assert [p.name for p in project.iterdir()] == ["notes.txt"]
    result = kcache(*command, "--cache-dir", str(project / "notes.txt"), env=env, cwd=tmp_path)
    assert_user_error(result, "is a file, not a directory")
    result = kcache(*command, "--cache-dir", str(tmp_path / "typo"), env=env, cwd=tmp_path)
    assert result.returncode != 0 and not (tmp_path / "typo").exists(), result.stderr
    if command in (["verify"], ["gc"]):
        empty = tmp_path / "empty"
        empty.mkdir()
        assert kcache(*command, "--cache-dir", str(empty), env=env, cwd=tmp_path).returncode == 0
        assert list(empty.iterdir()) == []  # nothing to check, nothing made


@pytest.mark.parametrize("item", ["A B=3", "=3", "1X=3"])
def test_a_define_that_is_no_macro_is_named(tmp_path: Path, item: str) -> None:
    """It compiled and failed inside NVRTC ("catastrophic error"), its message hidden."""
    (tmp_path / "k.cu").write_text(SOURCE)
    result = kcache(
        "key", "k.cu", "--target", "sm_90", "--define", item, env=user_env(tmp_path), cwd=tmp_path
    )
    assert_user_error(result, f"--define {item!r}", "is not a macro definition")


@pytest.mark.parametrize("command", ["compile", "get"])
def test_o_never_replaces_the_recipes_own_input(tmp_path: Path, command: str) -> None:
    """``-o`` naming the source (or a header) was written over with the cubin; an empty one
    wrote nothing and succeeded. Both are refused before anything is compiled."""
    (tmp_path / "k.cu").write_text(SOURCE)
    (tmp_path / "mytile.h").write_text("#define TILE 8\n")
    env = {**user_env(tmp_path), "KCACHE_URL": ""}
    base = [command, "k.cu", "--target", "sm_90", "--header", "mytile.h"]
    for output in ("k.cu", "./k.cu", str(tmp_path / "mytile.h")):
        result = kcache(*base, "-o", output, env=env, cwd=tmp_path)
        assert_user_error(result, f"-o {output}", "the recipe's own input")
    assert (tmp_path / "k.cu").read_text() == SOURCE
    assert (tmp_path / "mytile.h").read_text() == "#define TILE 8\n"
    assert_user_error(kcache(*base, "-o", "", env=env, cwd=tmp_path), "-o needs a file name")


@pytest.mark.parametrize(
    "command",
    [
        ["get", "k.cu", "--target", "sm_90"],
        ["compile", "k.cu", "--target", "sm_90"],
        ["stats"],
        ["cache", "info"],
    ],
    ids=" ".join,
)
def test_a_server_out_of_reach_exits_1_for_every_command(
    tmp_path: Path, command: list[str]
) -> None:
    (tmp_path / "k.cu").write_text(SOURCE.replace('#include "mytile.h"', "#define TILE 1"))
    unreachable = "http://127.0.0.1:1"
    result = kcache(*command, "--server", unreachable, env=user_env(tmp_path), cwd=tmp_path)
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert unreachable in result.stderr and "Traceback" not in result.stderr
