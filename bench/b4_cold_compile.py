"""B4: cold compile through the server (``POST /v1/resolve``, miss) vs NVRTC called directly.

The anchor calls NVRTC in-process on the same recipes with the same options (bundled
headers on the include path), nothing else. Each recipe is new to both (a distinct
constant), so every request really compiles. Goal: ours <= 1.10 x anchor + 20 ms.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support
from _harness import emit, kcache_server

from tests.support import VECTOR_ADD

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "15"))


def source(i: int, salt: str) -> str:
    return VECTOR_ADD.replace("x[i] + y[i]", f"x[i] + y[i] * {i}.0f /* {salt} */")


#: The second series: the kernel with 20 in-memory headers it includes (read markers, a
#: longer trace to check), against NVRTC given the same headers.
HEADERS = {
    f"h{i}.cuh": f"#pragma once\n__device__ float h{i}(float v) {{ return v + {i}; }}\n"
    for i in range(20)
}
INCLUDES = "".join(f"#include <{name}>\n" for name in HEADERS)


def direct_nvrtc_ms(src: str, headers: dict[str, str] | None = None) -> float:
    """NVRTC alone: create, compile for sm_90 with the bundled headers, fetch the cubin."""
    from cuda.bindings import nvrtc

    from kcache.toolchain import load_toolchain

    headers = headers or {}
    options = [b"-arch=sm_90", *(f.encode() for f in load_toolchain().include_flags)]
    started = time.perf_counter()
    _, prog = nvrtc.nvrtcCreateProgram(
        src.encode(),
        b"kernel.cu",
        len(headers),
        [text.encode() for text in headers.values()],
        [name.encode() for name in headers],
    )
    (result,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
    assert result == nvrtc.nvrtcResult.NVRTC_SUCCESS
    _, size = nvrtc.nvrtcGetCUBINSize(prog)
    buf = bytearray(size)
    nvrtc.nvrtcGetCUBIN(prog, buf)
    nvrtc.nvrtcDestroyProgram(prog)
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    salt = str(time.time_ns())
    direct_nvrtc_ms(source(0, "warm " + salt))  # load NVRTC once, as the server's workers have
    with kcache_server() as url, httpx.Client(timeout=120) as client:
        for warm in ("warm a", "warm b"):  # every compile worker has run NVRTC once
            client.post(
                url + "/v1/resolve",
                json={"recipe": {"source": source(0, warm + salt), "target": "sm_90"}},
            )
        for label, headers, prefix in (("", {}, ""), ("_20_headers", HEADERS, INCLUDES)):
            anchor: list[float] = []
            ours: list[float] = []
            # Rounds alternate anchor and ours, so both see the same machine noise.
            for i in range(1, ROUNDS + 1):
                anchor.append(direct_nvrtc_ms(prefix + source(i, "anchor " + salt), headers))
                recipe = {"source": prefix + source(i, "ours " + salt), "target": "sm_90"}
                if headers:
                    recipe["headers"] = headers
                started = time.perf_counter()
                reply = (
                    client.post(url + "/v1/resolve", json={"recipe": recipe, "compile": True})
                    .raise_for_status()
                    .json()
                )
                ours.append((time.perf_counter() - started) * 1e3)
                assert reply["status"] == "compiled", reply
            ours_ms, anchor_ms = statistics.median(ours), statistics.median(anchor)
            emit(
                f"B4.cold_compile{label}.median_ms",
                ours_ms,
                anchor_ms,
                "ms",
                goal="ours <= 1.10 x anchor + 20 ms",
                budget_ms=round(1.10 * anchor_ms + 20, 1),
                met=ours_ms <= 1.10 * anchor_ms + 20,
                rounds=ROUNDS,
            )


if __name__ == "__main__":
    main()
