"""On a machine with two GPUs: tests/gpu/warmup_nccl_check.py under torchrun, with NCCL.

Run on the device machine: ``pytest -m gpu tests/client/test_gpu_warmup_nccl.py`` (or the
script itself under torchrun, which prints every check).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import free_port

pytestmark = pytest.mark.gpu

SCRIPT = Path(__file__).resolve().parents[1] / "gpu" / "warmup_nccl_check.py"


def test_two_gpus_warm_up_twice_with_skew_launch_exactly_and_refuse_sm80(
    tmp_path: Path,
) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(SCRIPT),
        "--workdir",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    shown = proc.stdout[-6000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, shown
    assert [line["failures"] for line in lines if line["check"] == "summary"] == [0], shown
    done = {
        (line.get("rank"), line["check"], line.get("kernel")) for line in lines if line.get("ok")
    }
    for rank in (0, 1):
        assert {(rank, "warmup1", None), (rank, "warmup2", None)} <= done, shown
        for kernel in ("add", "scale", "axpy"):
            assert (rank, "launch1", kernel) in done, shown
        for kernel in ("add", "scale", "axpy", "maximum"):
            assert (rank, "launch2", kernel) in done, shown
        assert (rank, "sm80_refused", None) in done, shown
        assert (rank, "ptx", None) in done, shown
