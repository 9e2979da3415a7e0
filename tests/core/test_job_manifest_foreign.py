"""Job manifests that name foreign groups (format version 2, docs/design.md section 10).

A manifest without foreign groups is still version 1, byte for byte and digest for
digest what the older reader wrote and reads (:mod:`tests.core.job_manifest_v1`, that
reader verbatim); one with foreign groups is version 2, which the older reader refuses
with its sentence for a version it does not know, rather than read its kernels and
drop the rest.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kcache.bundle_format import BundleError
from kcache.foreign import ForeignBinding, ForeignFileRef, ForeignName, binding_key
from kcache.foreign_section import (
    ForeignGroup,
    ForeignMissing,
    ForeignSectionReader,
    end_line,
    group_head,
    header_line,
    missing_line,
)
from kcache.job_manifest import (
    JobManifest,
    ManifestError,
    ManifestForeign,
    ManifestKernel,
    diff_manifests,
)
from kcache.signing import SigningKey
from tests.core import job_manifest_v1 as old

KERNEL = ManifestKernel("a" * 64, "b" * 64, "add", "sm_90", "nvrtc-13.0", "cubin", 100)


def _group(key: str = "k1.cubin", data: bytes = b"payload") -> ManifestForeign:
    files = [{"name": "payload", "digest": hashlib.sha256(data).hexdigest(), "size": len(data)}]
    return ManifestForeign.of(ForeignName("cupy", "14.2.0", "sm_90", "nvrtc-13.0", key), files)


def test_a_manifest_without_foreign_groups_is_the_version_1_it_was() -> None:
    new = JobManifest.of([KERNEL], "job", created_at=1.0)
    before = old.JobManifest.of([old.ManifestKernel(**KERNEL.to_dict())], "job", created_at=1.0)
    assert new.version == 1
    assert new.dumps() == before.dumps()  # the same bytes, so the same digest and marker
    assert new.digest == before.digest
    assert old.JobManifest.loads(new.dumps()).digest == new.digest
    assert JobManifest.loads(before.dumps()) == new


def test_foreign_groups_make_a_version_2_manifest_that_round_trips() -> None:
    groups = [_group("k2.cubin", b"two"), _group("k1.cubin")]
    manifest = JobManifest.of([KERNEL], "job", foreign=groups)
    assert manifest.version == 2
    assert manifest.binding_keys == sorted(g.binding_key for g in groups)
    body = json.loads(manifest.dumps())
    assert body["foreign"][0]["binding_key"] == manifest.foreign[0].binding_key
    again = JobManifest.loads(manifest.dumps())
    assert again == manifest and again.digest == manifest.digest
    # The digest covers the groups: another file is another manifest (another marker).
    other = JobManifest.of([KERNEL], "job", foreign=[_group("k2.cubin", b"TWO"), _group()])
    assert other.digest != manifest.digest
    diff = diff_manifests(manifest, other)
    assert not diff.same and [a.name.key for a, _ in diff.foreign_changed] == ["k2.cubin"]
    assert diff_manifests(JobManifest.of([KERNEL]), manifest).foreign_added == manifest.foreign


def test_an_older_reader_refuses_a_version_2_manifest(tmp_path: Path) -> None:
    manifest = JobManifest.of([KERNEL], "job", foreign=[_group()])
    path = manifest.save(tmp_path / "m.json")
    with pytest.raises(old.ManifestError, match="manifest version 2 is not one this kcache reads"):
        old.JobManifest.load(path)


def test_what_a_reader_refuses() -> None:
    body = json.loads(JobManifest.of([KERNEL], foreign=[_group()]).dumps())
    as_v1 = {**body, "version": 1}
    with pytest.raises(ManifestError, match="version 1 manifest has no"):
        JobManifest.from_dict(as_v1)
    renamed = json.loads(json.dumps(body))
    renamed["foreign"][0]["key"] = "k9.cubin"  # the stated binding key is another name's
    with pytest.raises(ManifestError, match="binding_key is not"):
        JobManifest.from_dict(renamed)
    edited = json.loads(json.dumps(body))
    edited["foreign"][0]["files"][0]["size"] = 8  # a file changed by hand: the digest says so
    with pytest.raises(ManifestError, match="states digest"):
        JobManifest.from_dict(edited)
    with pytest.raises(ManifestError, match="version 3"):
        JobManifest.from_dict({**body, "version": 3})


def _section(*parts: bytes) -> list[bytes]:
    whole = b"".join(parts)
    return [whole[i : i + 7] for i in range(0, len(whole), 7)]  # in small, uneven pieces


def test_the_foreign_section_gives_whole_groups_and_the_rest_of_the_answer() -> None:
    files = {"a.cubin": b"\x7fELF" + bytes(50), "a.json": b"{}"}
    refs = tuple(
        ForeignFileRef(n, hashlib.sha256(d).hexdigest(), len(d)) for n, d in sorted(files.items())
    )
    binding = ForeignBinding(ForeignName("triton", "3.5", "any", "any", "k"), refs, "token:w")
    signature = SigningKey.generate().sign_foreign(binding)
    body = b"".join(files[r.name] for r in refs)
    gone = binding_key("triton", "3.5", "any", "any", "gone")
    chunks = _section(
        header_line(),
        group_head(binding, signature),
        body,
        b"\n",
        missing_line(gone, "no group"),
        end_line(1, 1),
        b"THE KERNELS' BUNDLE",
    )
    reader = ForeignSectionReader(chunks, max_file_bytes=1000, max_items=2, where="t")
    items = list(reader)
    assert isinstance(items[0], ForeignGroup) and items[0].files == files
    assert items[0].binding == binding and items[0].signature == signature
    assert items[1] == ForeignMissing(gone, "no group")
    assert b"".join(reader.rest()) == b"THE KERNELS' BUNDLE"

    damaged = bytearray(body)
    damaged[-1] ^= 1  # the group's last file no longer hashes to its digest
    cases = {
        "does not hash": [header_line(), group_head(binding, signature), bytes(damaged), b"\n"],
        "truncated": [header_line(), group_head(binding, signature), body[:-3]],
        "more than the 0": [header_line(), group_head(binding, signature), body, b"\n"],
        "end counts": [header_line(), end_line(1, 0)],
    }
    for said, parts in cases.items():
        most = 0 if said.startswith("more") else 2
        with pytest.raises(BundleError, match=said):
            list(
                ForeignSectionReader(
                    _section(*parts), max_file_bytes=1000, max_items=most, where="t"
                )
            )
    with pytest.raises(BundleError, match="size must be an integer at most 10"):
        list(
            ForeignSectionReader(
                _section(header_line(), group_head(binding, signature), body, b"\n"),
                max_file_bytes=10,
                max_items=2,
                where="t",
            )
        )
