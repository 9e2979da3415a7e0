"""The library cache hooks over foreign artifacts (docs/design.md section 10), without a GPU.

One real server (SQLite) for the module, with a ``publish`` token and a ``read`` one.
Each "node" is a ``KernelCache`` with a cache directory of its own: what one node's hook
published, another's finds on the server, then in its own tier. A group is all or none;
a server that cannot be reached is a miss, never an exception; CuPy's backend (against a
stand-in ``cupy`` package whose compiler calls the backend as CuPy 14.2's does) shares
nothing whose options name a user include directory; cuda.core's ``Program.compile``
takes kcache's resource as ``cache=``.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kcache_client import KernelCache
from kcache_client._foreign import ForeignCache, pack_group, unpack_group

from kcache.foreign import ForeignName
from tests.support import ServerThread, unique


@dataclass
class Fleet:
    server: ServerThread
    publish: str
    read: str
    root: Path

    def node(self, token: str | None = None, url: str | None = None) -> KernelCache:
        directory = self.root / unique("node")
        return KernelCache(url or self.server.url, token or self.publish, directory)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from kcache_server import Settings

    root = tmp_path_factory.mktemp("foreign-hooks")
    server = ServerThread(
        Settings(data_dir=root / "data", compile_workers=1, audit={"flush_s": 0.05}, auth_cache_s=0)
    )
    try:
        publish = server.state.tokens.create("hook-writer", ["publish"])
        read = server.state.tokens.create("hook-reader", ["read"])
        yield Fleet(server, publish, read, root)
    finally:
        server.stop()


def _name(library: str = "cupy", key: str | None = None) -> ForeignName:
    return ForeignName(library, "14.2.0", "sm_90", "nvrtc-13.0", key or unique("k") + ".cubin")


def test_pack_group_round_trips_and_refuses_a_cut_one() -> None:
    files = {"b.json": b"{}", "a.cubin": os.urandom(100), "empty": b""}
    blob = pack_group(files)
    assert unpack_group(blob) == files
    assert unpack_group(blob[:-1]) is None
    assert unpack_group(blob + b"x") is None
    assert unpack_group(b"not a group") is None


def test_one_node_publishes_another_finds_it_on_the_server_then_in_its_tier(
    fleet: Fleet,
) -> None:
    name = _name()
    files = {"payload": os.urandom(2000)}
    writer = ForeignCache(fleet.node())
    assert writer.get(name) is None  # a miss: the library compiles
    assert writer.put(name, files)
    assert writer.get(name) == files  # read your writes (memory)
    assert writer.flush(30)
    assert writer.counts["published"] == 1
    node = fleet.node(token=fleet.read)
    reader = ForeignCache(node)
    assert reader.get(name) == files
    assert reader.counts["server_hits"] == 1
    again = ForeignCache(node)  # another process of the same node
    assert again.get(name) == files
    assert (again.counts["node_hits"], again.counts["server_hits"]) == (1, 0)


def test_a_group_is_all_or_none(fleet: Fleet) -> None:
    name = _name("triton")
    files = {f"kernel.{ext}": os.urandom(500) for ext in ("cubin", "ptx", "json")}
    writer = ForeignCache(fleet.node())
    writer.put(name, files)
    assert writer.flush(30) and writer.counts["published"] == 1
    # One of its files is gone from the server's store (evicted, set aside): a whole miss.
    store = fleet.server.state.backends.store
    gone = hashlib.sha256(files["kernel.ptx"]).hexdigest()
    store.delete(gone)
    fleet.server.state.resolver._blobs.discard(gone)
    reader = ForeignCache(fleet.node(token=fleet.read))
    assert reader.get(name) is None
    assert reader.counts["misses"] == 1
    assert reader.cache.tier.lookup(name.binding_key) is None  # nothing half kept either


def _closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    sock.close()
    return port


def test_a_server_out_of_reach_is_a_quick_miss_and_not_asked_again(fleet: Fleet) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    foreign = ForeignCache(fleet.node(url=url))
    started = time.monotonic()
    assert foreign.get(_name()) is None
    assert foreign.get(_name()) is None
    assert time.monotonic() - started < 5
    assert foreign.counts["unreachable"] == 1  # the second lookup did not ask
    assert foreign.put(_name(), {"payload": b"x"})  # kept locally, nothing queued to send
    assert foreign.flush(1)


def test_a_token_without_publish_publishes_nothing_and_still_reads(fleet: Fleet) -> None:
    foreign = ForeignCache(fleet.node(token=fleet.read))
    foreign.put(_name(), {"payload": b"a"})
    foreign.flush(30)
    foreign.put(_name(), {"payload": b"b"})
    foreign.flush(30)
    assert foreign.counts["published"] == 0
    assert foreign._publish_refused


def test_an_answer_signed_by_another_key_is_a_miss(fleet: Fleet, tmp_path: Path) -> None:
    from kcache_client._settings import ClientSettings

    from kcache.signing import SigningKey

    name = _name()
    writer = ForeignCache(fleet.node())
    writer.put(name, {"payload": b"signed"})
    assert writer.flush(30)
    stranger = SigningKey.generate()
    settings = ClientSettings.from_env(
        url=fleet.server.url,
        token=fleet.read,
        cache_dir=tmp_path / "node",
        trusted_keys=stranger.public_key,
    )
    foreign = ForeignCache(KernelCache(settings=settings))
    assert foreign.get(name) is None
    assert foreign.counts["refused"] == 1


# ---------------------------------------------------------------- CuPy's backend

_FAKE_CUPY = {
    "cupy/__init__.py": """
        __version__ = "14.2.0"
        from cupy import cuda
    """,
    "cupy/cuda/__init__.py": """
        def get_cuda_path():
            return None
    """,
    # The interface of CuPy 14.2's cupy/cuda/_compiler_cache.py, as its docstrings state it.
    "cupy/cuda/_compiler_cache.py": """
        import abc

        class KernelCacheBackend(abc.ABC):
            @abc.abstractmethod
            def load(self, name): ...

            @abc.abstractmethod
            def save(self, name, cubin, source): ...

        class DiskKernelCacheBackend(KernelCacheBackend):
            entries = {}

            def load(self, name):
                return self.entries.get(name)

            def save(self, name, cubin, source):
                self.entries[name] = cubin
    """,
    # A compiler that calls the backend as CuPy 14.2's _compile_with_cache_cuda does: from
    # a function of that name, with the options and the architecture in its locals.
    "cupy/cuda/compiler.py": """
        import hashlib
        from cupy.cuda._compiler_cache import DiskKernelCacheBackend

        _kernel_cache_backend = DiskKernelCacheBackend()
        compiles = []

        def _set_kernel_cache_backend(backend):
            global _kernel_cache_backend
            _kernel_cache_backend = backend

        def _get_nvrtc_version():
            return (13, 0)

        def _compile_with_cache_cuda(source, options, arch, backend="nvrtc"):
            options += ("-ftz=true",)
            name = hashlib.sha1(repr((source, options, arch)).encode()).hexdigest() + ".cubin"
            payload = _kernel_cache_backend.load(name)
            if payload is not None:
                return payload
            compiles.append(name)
            payload = b"\\x7fELF" + source.encode()
            _kernel_cache_backend.save(name, payload, source)
            return payload
    """,
}


@pytest.fixture
def fake_cupy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "fake-cupy"
    for relative, text in _FAKE_CUPY.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(root))
    yield root / "cupy"
    for module in [m for m in sys.modules if m == "cupy" or m.startswith("cupy.")]:
        del sys.modules[module]


def test_cupy_backend_shares_compiles_across_nodes(fleet: Fleet, fake_cupy: Path) -> None:
    import cupy.cuda.compiler as compiler
    from kcache_client.cupy import install_backend, uninstall_backend

    cupy_include = str(fake_cupy / "_core" / "include")
    options = ("--std=c++17", f"-I{cupy_include}")
    source = f"__global__ void k() {{}} // {unique()}"
    first = install_backend(fleet.node())
    try:
        payload = compiler._compile_with_cache_cuda(source, options, "90")
        assert len(compiler.compiles) == 1
        assert first.foreign.flush(30) and first.foreign.counts["published"] == 1
    finally:
        uninstall_backend()
    second = install_backend(fleet.node(token=fleet.read))  # another node, an empty tier
    try:
        assert compiler._compile_with_cache_cuda(source, options, "90") == payload
        assert len(compiler.compiles) == 1  # found on the server: nothing compiled
        assert second.foreign.counts["server_hits"] == 1
        # Another architecture is another entry.
        compiler._compile_with_cache_cuda(source, options, "80")
        assert len(compiler.compiles) == 2
    finally:
        uninstall_backend()


def test_cupy_backend_never_shares_a_compile_with_user_include_dirs(
    fleet: Fleet, fake_cupy: Path, tmp_path: Path
) -> None:
    import cupy.cuda.compiler as compiler
    from cupy.cuda._compiler_cache import DiskKernelCacheBackend
    from kcache_client.cupy import install_backend, uninstall_backend

    user = tmp_path / "my-headers"
    user.mkdir()
    source = f'#include "mine.cuh"\n// {unique()}'
    for options in (
        (f"-I{user}",),
        ("-I", str(user)),
        (f"--include-path={user}",),
        ("-include", "x.h"),
    ):
        backend = install_backend(fleet.node())
        try:
            compiler._compile_with_cache_cuda(source, options, "90")
            assert backend.foreign.flush(30)
            assert backend.foreign.counts["published"] == 0  # never reached the fleet
            assert backend.unshared, options
        finally:
            uninstall_backend()
    # It went to CuPy's own disk cache instead, as without kcache.
    assert DiskKernelCacheBackend.entries
    # Called from anywhere but CuPy's compiler, the backend cannot see options: fail closed.
    backend = install_backend(fleet.node())
    try:
        backend.save("direct.cubin", b"\x7fELF", "src")
        assert backend.foreign.flush(30) and backend.foreign.counts["published"] == 0
        assert DiskKernelCacheBackend.entries["direct.cubin"] == b"\x7fELF"
    finally:
        uninstall_backend()


def test_cupy_backend_lookups_survive_a_dead_server(fleet: Fleet, fake_cupy: Path) -> None:
    import cupy.cuda.compiler as compiler
    from kcache_client.cupy import install_backend, uninstall_backend

    install_backend(fleet.node(url=f"http://127.0.0.1:{_closed_port()}"))
    try:
        source = f"// {unique()}"
        compiler._compile_with_cache_cuda(source, (), "90")
        compiler._compile_with_cache_cuda(source, (), "90")
        assert len(compiler.compiles) == 1  # the second from this node's tier
    finally:
        uninstall_backend()


# ---------------------------------------------------------------- cuda.core's resource


def test_cuda_core_program_cache_is_a_program_cache_resource(fleet: Fleet) -> None:
    pytest.importorskip("cuda.core.utils")
    from cuda.core.utils import ProgramCacheResource
    from kcache_client.cuda_core import ProgramCache

    cache = ProgramCache(fleet.node())
    assert isinstance(cache, ProgramCacheResource)
    assert cache.get(b"absent") is None and cache.get("absent", b"d") == b"d"
    with pytest.raises(KeyError):
        cache[b"absent"]
    cache[b"k1"] = b"one"
    cache["k2"] = bytearray(b"two")
    assert cache[b"k1"] == b"one" and cache[b"k2"] == b"two"  # "k2" and b"k2": one entry
    assert len(cache) == 2
    del cache[b"k1"]
    with pytest.raises(KeyError):
        del cache[b"k1"]
    assert len(cache) == 1
    cache.clear()
    assert len(cache) == 0


def test_cuda_core_program_cache_publishes_by_the_end_of_its_with_block(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    # cuda.core closes a resource at the end of `with cache:`; kcache's close waits for
    # the block's publishes (here slowed down), so another node finds them at once.
    pytest.importorskip("cuda.core.utils")
    from kcache_client.cuda_core import ProgramCache

    publish = ForeignCache._publish

    def slow_publish(self: ForeignCache, name: ForeignName, files: dict[str, bytes]) -> None:
        time.sleep(0.5)
        publish(self, name, files)

    monkeypatch.setattr(ForeignCache, "_publish", slow_publish)
    key = unique("cuda-core-key").encode()
    with ProgramCache(fleet.node()) as cache:
        cache[key] = b"compiled in the block"
    assert cache.foreign.counts["published"] == 1
    assert cache.foreign._http is None  # its connections are closed
    reader = ProgramCache(fleet.node(token=fleet.read))
    assert reader.get(key) == b"compiled in the block"
    assert reader.foreign.counts["server_hits"] == 1


def test_cuda_core_compile_uses_the_fleet(fleet: Fleet) -> None:
    core = pytest.importorskip("cuda.core")
    from kcache_client.cuda_core import ProgramCache

    source = f'extern "C" __global__ void k(int* a) {{ *a = {int(time.time() * 1000) % 100000}; }}'
    options = core.ProgramOptions(arch="sm_90")
    first = ProgramCache(fleet.node())
    built = core.Program(source, "c++", options=options).compile("cubin", cache=first)
    assert first.flush(30) and first.foreign.counts["published"] == 1
    second = ProgramCache(fleet.node(token=fleet.read))
    found = core.Program(source, "c++", options=options).compile("cubin", cache=second)
    assert second.foreign.counts["server_hits"] == 1
    assert bytes(found.code) == bytes(built.code)


# ---------------------------------------------------------------- Triton's cache manager


def _triton_node(fleet: Fleet, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, token: str) -> None:
    import kcache_client.triton as kt

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / unique("triton")))
    monkeypatch.setattr(kt, "_foreign", ForeignCache(fleet.node(token=token)))


def test_triton_groups_travel_whole(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import kcache_client.triton as kt

    key = unique("TRITONKEY").upper().replace("-", "")
    files = {
        "add.cubin": os.urandom(3000),
        "add.ptx": b".version 8.7",
        "add.json": b'{"name": "add"}',
    }
    _triton_node(fleet, monkeypatch, tmp_path, fleet.publish)
    writer = kt.CacheManager(key)
    assert writer.get_group("add.json") is None  # a miss: Triton compiles
    group = {name: writer.put(data, name) for name, data in files.items()}
    writer.put(b"launcher", "launcher.so")  # no group: stays on this node
    writer.put_group("add.json", group)
    assert writer.get_group("add.json") == group
    assert kt._foreign.flush(30) and kt._foreign.counts["published"] == 1

    _triton_node(fleet, monkeypatch, tmp_path, fleet.read)  # another node, empty caches
    reader = kt.CacheManager(key)
    got = reader.get_group("add.json")
    assert got is not None and sorted(got) == sorted(files)
    assert {name: Path(path).read_bytes() for name, path in got.items()} == files
    assert all(path.startswith(reader.cache_dir) for path in got.values())
    assert reader.get_file("launcher.so") is None and not reader.has_file("launcher.so")
    # Triton's own layout: the group file names local paths, written after its files.
    written = json.loads(Path(reader.cache_dir, "__grp__add.json").read_text())
    assert written == {"child_paths": got}


def test_triton_a_group_cut_half_way_is_never_returned(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import kcache_client.triton as kt

    key = unique("CUT").upper().replace("-", "")
    _triton_node(fleet, monkeypatch, tmp_path, fleet.publish)
    writer = kt.CacheManager(key)
    first = writer.put(b"cubin", "k.cubin")
    writer.put(b"{}", "k.json")  # the process dies before put_group: nothing published
    assert kt._foreign.flush(30) and kt._foreign.counts["published"] == 0
    # A group file naming a file that is gone is not a group (nor published whole).
    Path(writer.cache_dir, "__grp__k.json").write_text(
        json.dumps({"child_paths": {"k.cubin": first, "k.json": first + ".gone"}})
    )
    assert writer.get_group("k.json") is None
    _triton_node(fleet, monkeypatch, tmp_path, fleet.read)
    assert kt.CacheManager(key).get_group("k.json") is None


def test_triton_manager_uses_the_cache_dir_triton_knobs_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Triton 3.4+ takes its cache directory from triton.knobs.cache.dir, which a program may
    # set in place of TRITON_CACHE_DIR: the manager keeps its files where Triton's own would.
    import types

    import kcache_client.triton as kt

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "from-env"))
    knobs = types.ModuleType("triton.knobs")
    knobs.cache = types.SimpleNamespace(dir=str(tmp_path / "from-knobs"))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "triton.knobs", knobs)
    assert kt.CacheManager("KEYA").cache_dir == str(tmp_path / "from-knobs" / "KEYA")
    monkeypatch.delitem(sys.modules, "triton.knobs")
    assert kt.CacheManager("KEYB").cache_dir == str(tmp_path / "from-env" / "KEYB")


def test_a_forked_child_publishes_with_a_writer_of_its_own(fleet: Fleet) -> None:
    """A DataLoader-style fork: the child has the parent's queue but not its thread; its own
    writes still go out, and its exit does not wait on the parent's queue."""
    foreign = ForeignCache(fleet.node())
    foreign.put(_name(), {"payload": b"parent"})
    assert foreign.flush(30)
    child_name = _name()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            started = time.monotonic()
            foreign.put(child_name, {"payload": b"child"})
            done = foreign.flush(20)
            code = (
                0
                if done and foreign.counts["published"] == 2 and time.monotonic() - started < 15
                else 3
            )
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    reader = ForeignCache(fleet.node(token=fleet.read))
    assert reader.get(child_name) == {"payload": b"child"}
