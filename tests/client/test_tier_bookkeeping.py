"""A publish's bookkeeping (record, manifest entry): written when the process is idle,
in batches or on demand, and never for a blob that went away meanwhile.

Another process may evict the blob (it saw no record yet), ``kcache cache clear`` may
remove it, a reader may quarantine it: what is left must never be a record naming a
missing blob, and the blob is not brought back.
"""

from __future__ import annotations

from pathlib import Path

from client_harness import tier_entry
from kcache_client import KernelCache
from kcache_client._tier import NodeTier

from kcache.artifact import ArtifactMeta
from kcache.keys import sha256_hex


def _gone(tier: NodeTier, key: str, meta: ArtifactMeta) -> None:
    assert tier.index.artifact(meta.digest) is None  # no record names the missing blob
    assert not tier.store.has(meta.digest)  # and the blob was not brought back
    assert tier.lookup(key) is None
    assert tier.usage().entries == 0


def test_a_blob_cleared_before_its_record_is_written_gets_no_record(tmp_path: Path) -> None:
    tier = NodeTier(tmp_path, max_bytes=0)
    other = NodeTier(tmp_path, max_bytes=0)  # as another process
    key, base, meta, data = tier_entry("cleared before")
    write_alias = tier.index.write_alias

    def then_cleared(
        recipe_key: str, written: ArtifactMeta, signature: dict[str, str] | None = None
    ) -> None:
        write_alias(recipe_key, written, signature)
        assert other.clear().removed == 1  # between the alias and the record

    tier.index.write_alias = then_cleared  # type: ignore[method-assign]
    tier.publish(key, base, meta, data)
    tier.flush()
    _gone(tier, key, meta)
    assert tier.index.manifest(base) == []


def test_a_blob_cleared_while_its_record_is_written_has_the_record_taken_back(
    tmp_path: Path,
) -> None:
    tier = NodeTier(tmp_path, max_bytes=0)
    other = NodeTier(tmp_path, max_bytes=0)
    key, base, meta, data = tier_entry("cleared during")
    record = tier.index.record_metadata

    def cleared_meanwhile(base_key: str, written: ArtifactMeta) -> None:
        assert other.clear().removed == 1  # the blob goes as the record is being written
        record(base_key, written)

    tier.index.record_metadata = cleared_meanwhile  # type: ignore[method-assign]
    tier.publish(key, base, meta, data)
    tier.flush()
    _gone(tier, key, meta)


def test_an_undisturbed_publish_writes_its_record_and_manifest_entry(tmp_path: Path) -> None:
    tier = NodeTier(tmp_path, max_bytes=0)
    key, base, meta, data = tier_entry("undisturbed")
    tier.publish(key, base, meta, data)
    assert tier.index.artifact(meta.digest) is None  # pending: nothing reads it yet
    tier.flush()
    assert tier.index.artifact(meta.digest) == meta
    assert [e.digest for e in tier.index.manifest(base)] == [meta.digest]
    assert tier.lookup(key) == (meta, data)


def test_pending_records_are_written_by_the_32nd_publish(tmp_path: Path) -> None:
    tier = NodeTier(tmp_path, max_bytes=0)
    entries = [tier_entry(f"batch {i}") for i in range(32)]
    for key, base, meta, data in entries[:31]:
        tier.publish(key, base, meta, data)
    assert not list(tier.index.files("artifacts"))  # all pending
    key, base, meta, data = entries[31]
    tier.publish(key, base, meta, data)
    assert {p.stem for p in tier.index.files("artifacts")} == {e[2].digest for e in entries}


def test_a_process_about_to_wait_for_another_writes_its_pending_records(tmp_path: Path) -> None:
    tier = NodeTier(tmp_path, max_bytes=0)
    key, base, meta, data = tier_entry("then waits")
    tier.publish(key, base, meta, data)
    assert tier.index.artifact(meta.digest) is None
    other_key = sha256_hex(b"fetched by another process")
    other = NodeTier(tmp_path, max_bytes=0)
    with other.hold_unless(other_key, lambda: None) as held:  # another process fetches it
        assert held is None
        looked: list[object] = []

        def published() -> str:
            looked.append(tier.index.artifact(meta.digest))
            return "the other's entry"

        with tier.hold_unless(other_key, published) as found:  # this one waits for it
            assert found == "the other's entry"
    assert looked == [meta]  # written before the first look, while the other held the key


def test_a_waiters_bookkeeping_stops_at_the_end_of_its_nap(tmp_path: Path) -> None:
    """Pending records are written in a waiter's naps, never past their end (a wait ends when
    the entry is there, not when the bookkeeping is done): one at least, the rest later."""
    import time

    tier = NodeTier(tmp_path, max_bytes=0)
    entries = [tier_entry(f"pending {i}") for i in range(5)]
    for key, base, meta, data in entries:
        tier.publish(key, base, meta, data)
    tier.publisher.flush(until=time.monotonic())  # a nap already over
    assert [p.stem for p in tier.index.files("artifacts")] == [entries[0][2].digest]
    tier.publisher.flush()
    assert {p.stem for p in tier.index.files("artifacts")} == {e[2].digest for e in entries}


def test_lists_and_evictions_count_pending_publishes(tmp_path: Path) -> None:
    tier = NodeTier(tmp_path, max_bytes=0)
    key, base, meta, data = tier_entry("listed")
    tier.publish(key, base, meta, data)
    (listed,) = tier.entries()
    assert (listed.digest, listed.kind) == (meta.digest, "cubin")  # its record, written first


def test_closing_the_cache_writes_the_pending_records(tmp_path: Path) -> None:
    key, base, meta, data = tier_entry("closed")
    cache = KernelCache(None, cache_dir=tmp_path)
    cache.tier.publish(key, base, meta, data)
    assert cache.tier.index.artifact(meta.digest) is None
    cache.close()
    fresh = NodeTier(tmp_path)
    assert fresh.index.artifact(meta.digest) == meta
    assert [e.digest for e in fresh.index.manifest(base)] == [meta.digest]
