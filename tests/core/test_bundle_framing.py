"""A bundle entry whose bytes do not end where its size says is refused with the true cause.

An entry shorter than its announced size was reported as "longer than its size": the
reader, taking ``size`` bytes, ran into the next entry's header line. Both readers (the
streaming one a prefetch uses and the indexer of a bundle file) say which it was.
"""

from __future__ import annotations

import hashlib
import io

import pytest

from kcache.artifact import ArtifactMeta
from kcache.bundle_format import (
    BundleError,
    BundleReader,
    end_line,
    entry_head,
    header_line,
    index_bundle,
)
from kcache.signing import SigningKey

KEY = SigningKey.generate()


def _entry(i: int, data: bytes, announced: int | None = None) -> bytes:
    meta = ArtifactMeta(
        digest=hashlib.sha256(data).hexdigest(),
        size=len(data) if announced is None else announced,
        kind="cubin",
        target="sm_90",
        toolchain="nvrtc13.5-x",
    )
    recipe_key = f"{i:02x}" * 32
    return entry_head(recipe_key, meta, KEY.sign(recipe_key, meta)) + data + b"\n"


def _bundle(*entries: bytes) -> bytes:
    return header_line() + b"".join(entries) + end_line(len(entries), 0)


def _refusal(data: bytes) -> tuple[str, str]:
    """What the streaming reader and the file indexer say of ``data``."""
    with pytest.raises(BundleError) as streamed:
        list(BundleReader([data], max_entry_bytes=1 << 20, where="b.kcb"))
    with pytest.raises(BundleError) as indexed:
        index_bundle(io.BytesIO(data), max_entry_bytes=1 << 20, where="b.kcb")
    return str(streamed.value), str(indexed.value)


def test_a_well_framed_bundle_reads_in_both_readers() -> None:
    data = _bundle(_entry(1, b"\x7fELF one"), _entry(2, b"\x7fELF two"))
    assert len(list(BundleReader([data], max_entry_bytes=1 << 20, where="b"))) == 2
    assert len(index_bundle(io.BytesIO(data), max_entry_bytes=1 << 20, where="b")) == 2


def test_an_entry_shorter_than_its_size_is_called_shorter() -> None:
    data = _bundle(_entry(1, b"\x7fELF one", announced=20), _entry(2, b"\x7fELF two"))
    for said in _refusal(data):
        assert "entry 1 is shorter than its size (20 bytes)" in said, said
        assert "after 8 of them" in said, said


def test_an_entry_longer_than_its_size_is_called_longer() -> None:
    data = _bundle(_entry(1, b"\x7fELF one", announced=5), _entry(2, b"\x7fELF two"))
    for said in _refusal(data):
        assert "entry 1 is longer than its size (5 bytes)" in said, said
