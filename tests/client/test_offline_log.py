"""A ``KernelCache`` whose server is down says so once per process, through ``logging``.

Issue 31 item 6: the fallback to the node tier (and to local compiles) was silent in
a library, where the CLI says it on stderr. Each program runs in a fresh process: the
line is logged once per process, so this test's own process may have said it already.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support import ROOT, VECTOR_ADD, free_port

_PROGRAM = textwrap.dedent(
    """
    import logging, sys
    from kcache import Recipe
    from kcache_client import ClientSettings, KernelCache, RetryPolicy

    {logging}
    fast = RetryPolicy(attempts=2, base_s=0.01, cap_s=0.02, budget_s=0.5)
    settings = ClientSettings.from_env(local_compile=True, retry=fast)
    source = {source!r}
    with KernelCache(sys.argv[1], cache_dir=sys.argv[2], settings=settings) as cache:
        for name in ("first_add", "second_add"):
            art = cache.get(Recipe(source=source.replace("add(", name + "("), target="sm_90"))
            assert art.origin == "local_compile", art.origin
        assert cache.stats.local_compiles == 2
    print("done")
    """
)


def _run(tmp_path: Path, logging_setup: str) -> subprocess.CompletedProcess[str]:
    program = _PROGRAM.format(logging=logging_setup, source=VECTOR_ADD)
    url = f"http://127.0.0.1:{free_port()}"
    return subprocess.run(
        [sys.executable, "-c", program, url, str(tmp_path / "tier")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )


def test_the_fallback_is_logged_once_per_process(tmp_path: Path) -> None:
    result = _run(
        tmp_path, "logging.basicConfig(level=logging.INFO, format='%(name)s %(message)s')"
    )
    assert result.stdout.strip() == "done", result.stderr
    said = [line for line in result.stderr.splitlines() if "is unreachable" in line]
    assert len(said) == 1, result.stderr  # two fallbacks, one line
    assert said[0].startswith("kcache_client.offline kcache server http://127.0.0.1:")
    assert "compiled here into the node tier" in said[0]


def test_a_program_that_configured_no_logging_still_sees_it(tmp_path: Path) -> None:
    result = _run(tmp_path, "")
    assert result.stdout.strip() == "done", result.stderr
    assert result.stderr.count("is unreachable") == 1, result.stderr  # the last-resort handler
