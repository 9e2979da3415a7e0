"""A KernelCache used on both sides of a fork (a data loader's workers fork the process).

Its keep-alive connections were the parent's in the child too: both read from one socket,
each the other's answers ("the server keyed the recipe as ..., this client as ...", a 404
for a compile, a body that is not JSON). A child that used the cache and then closed it
raised "UnixFileLock ... was inherited across fork" from the node's event spool. Real
processes, a real server (the session's), the real connection pool.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

from client_harness import KcacheServer, kernels
from kcache_client import ClientSettings, KernelCache

ROUNDS = 25


def test_parent_and_child_each_get_their_own_answers(kserver: KcacheServer, tmp_path: Path) -> None:
    recipes = kernels(4, "fork", target="sm_80")
    settings = ClientSettings.from_env(send_events=True)
    cache = KernelCache(kserver.url, cache_dir=tmp_path / "tier", settings=settings)
    expected = [cache.get(r).digest for r in recipes]  # a keep-alive connection now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the same gets as the parent, each from the server
        os.close(read)
        code = 1
        try:
            for i in range(ROUNDS):
                n = i % len(recipes)
                assert cache.get(recipes[n], refresh=True).digest == expected[n]
            cache.get(recipes[0])  # a memory hit: an audit event for the node's spool
            cache.close()
            code = 0
        except BaseException:
            os.write(write, traceback.format_exc().encode()[-4000:])
        finally:
            os._exit(code)
    os.close(write)
    try:
        for i in range(ROUNDS):
            n = (i + 1) % len(recipes)
            assert cache.get(recipes[n], refresh=True).digest == expected[n]
    finally:
        _, status = os.waitpid(pid, 0)
        said = os.read(read, 8192).decode(errors="replace")
        os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0, said
    cache.get(recipes[1])
    cache.close()  # the parent still leads its spool and sends its events
