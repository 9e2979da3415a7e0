"""Bforeign: a node-tier hit through kcache's library cache hooks against the library's own disk cache.

Issue 47's goal: a hit through each hook costs at most 1.2 x the library's own local disk
cache hit. No server: the hooks' node tier is warm (filled by a put), and each timed call
forgets this process's memory first, so it reads the tier (the alias, the group's blob,
its digest) as a fresh process of the node would; the anchor reads the same bytes from
the library's own cache on the same disk.

  * cuda.core: ``ProgramCache().get(key)`` against cuda.core's ``FileStreamProgramCache``
    ``get(key)`` (its own local cache), on a 64 KiB payload under the same key;
  * CuPy: kcache's backend ``load(name)`` as CuPy 14.2's compiler calls it (from
    ``_compile_with_cache_cuda``, whose options it reads) against the same read and SHA-1
    check CuPy's ``DiskKernelCacheBackend.load`` does (CuPy is not needed: the backend runs
    against a stand-in ``cupy`` package, the anchor is that read written out);
  * Triton: ``get_group`` of a 3-file group (80 KiB) where the node's Triton directory
    holds it, against ``FileCacheManager.get_group``'s reads on the same files; and from the
    node tier into an empty Triton directory (a fresh container), against writing the same
    files there as Triton's own ``put`` does (the floor of any cache that hands Triton paths).

Prints one JSON line per figure (us per call, median over interleaved batches).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import emit

SECONDS = float(os.environ.get("BENCH_SECONDS", "3"))
BATCH = 50
PAYLOAD = os.urandom(64 << 10)


def per_call_us(variants: dict[str, Callable[[], object]], seconds: float) -> dict[str, float]:
    """Median over batches of the mean us per call; variants interleaved batch by batch."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        for _ in range(10):
            fn()
    deadline = time.monotonic() + seconds * len(variants)
    while time.monotonic() < deadline or min(len(s) for s in samples.values()) < 5:
        for name, fn in variants.items():
            started = time.perf_counter()
            for _ in range(BATCH):
                fn()
            samples[name].append((time.perf_counter() - started) / BATCH * 1e6)
    return {name: statistics.median(s) for name, s in samples.items()}


def cuda_core(root: Path) -> None:
    from cuda.core.utils import FileStreamProgramCache
    from kcache_client import KernelCache
    from kcache_client.cuda_core import ProgramCache

    key = hashlib.sha256(b"bench key").digest()
    ours = ProgramCache(KernelCache(None, None, root / "tier-cc"))
    ours[key] = PAYLOAD
    theirs = FileStreamProgramCache(root / "cuda-core-cache")
    theirs[key] = PAYLOAD

    def ours_hit() -> object:
        ours.foreign.clear_memory()
        assert ours.get(key) == PAYLOAD
        return None

    def theirs_hit() -> object:
        assert theirs.get(key) == PAYLOAD
        return None

    t = per_call_us({"ours": ours_hit, "anchor": theirs_hit}, SECONDS)
    emit(
        "Bforeign cuda.core node-tier hit",
        t["ours"],
        t["anchor"],
        "us/call",
        anchor_is="FileStreamProgramCache.get",
    )


_FAKE = {
    "cupy/__init__.py": "__version__ = '14.2.0'\nfrom cupy import cuda\n",
    "cupy/cuda/__init__.py": "def get_cuda_path():\n    return None\n",
    "cupy/cuda/_compiler_cache.py": textwrap.dedent(
        """
        import abc
        class KernelCacheBackend(abc.ABC):
            @abc.abstractmethod
            def load(self, name): ...
            @abc.abstractmethod
            def save(self, name, cubin, source): ...
        class DiskKernelCacheBackend(KernelCacheBackend):
            def load(self, name):
                return None
            def save(self, name, cubin, source):
                pass
        """
    ),
    "cupy/cuda/compiler.py": textwrap.dedent(
        """
        _kernel_cache_backend = None
        def _set_kernel_cache_backend(backend):
            global _kernel_cache_backend
            _kernel_cache_backend = backend
        def _get_nvrtc_version():
            return (13, 0)
        def _compile_with_cache_cuda(name, options, arch):
            return _kernel_cache_backend.load(name)
        def _save_with_cache_cuda(name, options, arch, payload):
            _kernel_cache_backend.save(name, payload, "")
        _save_with_cache_cuda.__code__ = _save_with_cache_cuda.__code__.replace(co_name="_compile_with_cache_cuda")
        """
    ),
}


def cupy(root: Path) -> None:
    fake = root / "fake-cupy"
    for relative, text in _FAKE.items():
        (fake / relative).parent.mkdir(parents=True, exist_ok=True)
        (fake / relative).write_text(text)
    sys.path.insert(0, str(fake))
    compiler = importlib.import_module("cupy.cuda.compiler")
    from kcache_client import KernelCache
    from kcache_client.cupy import install_backend

    backend = install_backend(KernelCache(None, None, root / "tier-cupy"))
    name = hashlib.sha1(b"bench").hexdigest() + ".cubin"
    options = ("--std=c++17", "-ftz=true")
    compiler._save_with_cache_cuda(name, options, "90", PAYLOAD)
    backend.foreign.flush(10)
    # CuPy's DiskKernelCacheBackend file: SHA-1 hex of the cubin, then the cubin.
    disk = root / "cupy-cache"
    disk.mkdir()
    (disk / name).write_bytes(hashlib.sha1(PAYLOAD).hexdigest().encode() + PAYLOAD)

    def ours_hit() -> object:
        backend.foreign.clear_memory()
        assert compiler._compile_with_cache_cuda(name, options, "90") == PAYLOAD
        return None

    def theirs_hit() -> object:  # DiskKernelCacheBackend.load, written out
        data = (disk / name).read_bytes()
        cubin = data[40:]
        assert data[:40] == hashlib.sha1(cubin).hexdigest().encode()
        return cubin

    t = per_call_us({"ours": ours_hit, "anchor": theirs_hit}, SECONDS)
    emit(
        "Bforeign CuPy backend node-tier hit",
        t["ours"],
        t["anchor"],
        "us/call",
        anchor_is="DiskKernelCacheBackend.load's read and SHA-1 check",
    )


def triton(root: Path) -> None:
    import kcache_client.triton as kt
    from kcache_client import KernelCache
    from kcache_client._foreign import ForeignCache

    files = {"k.cubin": PAYLOAD, "k.ptx": PAYLOAD[: 16 << 10], "k.json": b'{"name": "k"}'}
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton-writer")
    kt._foreign = ForeignCache(KernelCache(None, None, root / "tier-triton"))
    writer = kt.CacheManager("BENCHKEY")
    group = {n: writer.put(d, n) for n, d in files.items()}
    writer.put_group("k.json", group)
    kt._foreign.flush(10)
    reader_dir = root / "triton-reader"
    writer_dir = root / "triton-writer" / "BENCHKEY"

    def read_group(grp: Path) -> dict[str, bytes]:  # FileCacheManager.get_group, then the reads
        children = json.loads(grp.read_text())["child_paths"]
        found = {c: p for c, p in children.items() if os.path.exists(p)}
        assert len(found) == 3
        return {c: Path(p).read_bytes() for c, p in found.items()}

    def ours_local() -> object:  # this node's Triton directory holds the group: Triton's layout
        os.environ["TRITON_CACHE_DIR"] = str(root / "triton-writer")
        got = kt.CacheManager("BENCHKEY").get_group("k.json")
        assert got is not None
        return {c: Path(p).read_bytes() for c, p in got.items()}

    def theirs_local() -> object:
        os.makedirs(writer_dir, exist_ok=True)  # FileCacheManager.__init__, made per lookup too
        return read_group(writer_dir / "__grp__k.json")

    t = per_call_us({"ours": ours_local, "anchor": theirs_local}, SECONDS)
    emit(
        "Bforeign Triton group hit, local directory",
        t["ours"],
        t["anchor"],
        "us/call",
        anchor_is="FileCacheManager.get_group plus reading the files",
    )

    def ours_tier() -> object:  # a fresh node's Triton directory: the group comes from the tier
        shutil.rmtree(reader_dir, ignore_errors=True)
        os.environ["TRITON_CACHE_DIR"] = str(reader_dir)
        kt._foreign.clear_memory()
        got = kt.CacheManager("BENCHKEY").get_group("k.json")
        assert got is not None and len(got) == 3
        return got

    def floor_tier() -> (
        object
    ):  # the same files written into a fresh directory, as Triton's put does
        target = reader_dir / "BENCHKEY"
        shutil.rmtree(reader_dir, ignore_errors=True)
        target.mkdir(parents=True)
        paths = {}
        for name, data in files.items():
            temp = target / f".tmp.{name}"
            temp.write_bytes(data)
            os.replace(temp, target / name)
            paths[name] = str(target / name)
        (target / "__grp__k.json").write_text(json.dumps({"child_paths": paths}))
        return paths

    t = per_call_us({"ours": ours_tier, "anchor": floor_tier}, SECONDS)
    emit(
        "Bforeign Triton group from the node tier into an empty directory",
        t["ours"],
        t["anchor"],
        "us/call",
        anchor_is="writing the same files there as Triton's FileCacheManager.put does",
    )


def main() -> None:
    os.environ.pop("KCACHE_URL", None)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cupy(root)
        triton(root)
        try:
            cuda_core(root)
        except ImportError as exc:
            print(json.dumps({"bench": "Bforeign cuda.core", "skipped": str(exc)}))


if __name__ == "__main__":
    main()
