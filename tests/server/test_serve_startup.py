"""``kcache serve`` starts its compile workers before it builds the app: a refused start leaves none.

The workers are launched first so that they load NVRTC while the server imports its
web stack (issue 13, instant commands); when building the app then fails, the command
must still say why in its usual words and stop the workers it launched, scratch
directories included.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support import KCACHE, ROOT, free_port


def test_a_refused_start_stops_the_workers_it_launched(tmp_path: Path) -> None:
    data = tmp_path / "data"
    # The session's toolchain directory (conftest), nothing else of kcache's environment.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KCACHE_") or k == "KCACHE_TOOLCHAIN_DIR"
    }
    serve = [KCACHE, "serve", "--host", "0.0.0.0", "--port", str(free_port())]
    done = subprocess.run(
        [*serve, "--data-dir", str(data)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "refusing to serve on 0.0.0.0 without tokens" in done.stderr
    assert "Traceback" not in done.stderr  # no worker complained about a vanished server
    assert (data / "tmp").is_dir()  # the workers were launched, in scratch directories there
    assert list((data / "tmp").iterdir()) == []  # and stopped, their scratch removed
