"""When is NVRTC's dependency trace incomplete? Each case in a fresh process, against plain NVRTC.

Each case runs in a new interpreter: first what the case does (a failed compile of some
kind, a compile on another thread, ...), then, twice, a reference program with three
in-memory headers (one nesting another), traced with ``--fdevice-time-trace``. A line
per case says whether the reference traces were complete (the builtin header and all
four headers) and, if not, what they held. This is the evidence behind
``docs/design.md`` ("Proving a dependency list"); run it against any NVRTC release:

    .venv/bin/python bench/nvrtc_trace_probe.py

It calls NVRTC directly (no kcache code in the compiles), with the options kcache uses.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REFERENCE_HEADERS = {
    "a.cuh": "#include <a2.cuh>\n__device__ int fa() { return fa2(); }\n",
    "a2.cuh": "__device__ int fa2() { return 1; }\n",
    "b.cuh": "__device__ int fb() { return 2; }\n",
    "c.cuh": "__device__ int fc() { return 3; }\n",
}
REFERENCE = (
    "#include <a.cuh>\n#include <b.cuh>\n#include <c.cuh>\n"
    'extern "C" __global__ void k(int* o) { o[0] = fa() + fb() + fc(); }\n'
)
COMPLETE = ["__nv_nvrtc_builtin_header.h", "a2.cuh", "a.cuh", "b.cuh", "c.cuh"]
HEADER_FATAL = ("#include <e.cuh>\n", {"e.cuh": "#error stop\n"})

#: case -> (what it compiles first, extra options for that compile, traced?, on a thread?)
CASES: dict[str, tuple[str, dict[str, str], list[str], bool, bool]] = {
    "nothing before": ("", {}, [], True, False),
    "#error in a header (depth 1)": (*HEADER_FATAL, [], True, False),
    "#error in a header (depth 3)": (
        "#include <e.cuh>\n",
        {"e.cuh": "#include <e2.cuh>\n", "e2.cuh": "#include <e3.cuh>\n", "e3.cuh": "#error x\n"},
        [],
        True,
        False,
    ),
    "#error in a header, untraced": (*HEADER_FATAL, [], False, False),
    "#error in a header, on another thread": (*HEADER_FATAL, [], True, True),
    "#error in a header, -fdevice-syntax-only": (
        *HEADER_FATAL,
        ["-fdevice-syntax-only"],
        True,
        False,
    ),
    "missing include in a header": (
        "#include <e.cuh>\n",
        {"e.cuh": "#include <absent.h>\n"},
        [],
        True,
        False,
    ),
    "too many errors in a header": (
        "#include <e.cuh>\n",
        {"e.cuh": "__device__ int x = ;\n" * 200},
        [],
        True,
        False,
    ),
    "bundled header fails (cooperative_groups, -no-source-include)": (
        "#include <cooperative_groups.h>\n",
        {},
        ["-no-source-include"],
        True,
        False,
    ),
    "#error in the source": ("#error stop\n", {}, [], True, False),
    "missing include in the source": ("#include <absent.h>\n", {}, [], True, False),
    "syntax error in a header": (
        "#include <e.cuh>\n",
        {"e.cuh": "__device__ int x = ;\n"},
        [],
        True,
        False,
    ),
    "static_assert in a header": (
        "#include <e.cuh>\n",
        {"e.cuh": 'static_assert(sizeof(int) == 3, "no");\n'},
        [],
        True,
        False,
    ),
    "warning in a header": (
        '#include <e.cuh>\nextern "C" __global__ void w() {}\n',
        {"e.cuh": "#warning hi\n"},
        [],
        True,
        False,
    ),
    "name expression typo": ("NAME_TYPO", {}, [], True, False),
    "50 empty headers": (
        "".join(f"#include <e{i}.cuh>\n" for i in range(50))
        + 'extern "C" __global__ void w() {}\n',
        {f"e{i}.cuh": "" for i in range(50)},
        [],
        True,
        False,
    ),
}


def _compile(
    source: str, headers: dict[str, str], extra: list[str], traced: bool, include: list[str]
) -> list[str] | None:
    from cuda.bindings import nvrtc

    trace = Path(tempfile.mkdtemp()) / "trace"
    options = ["-arch=sm_90", *include, *extra]
    options += [f"--fdevice-time-trace={trace}"] if traced else []
    names = list(headers)
    typo = source == "NAME_TYPO"
    if typo:
        source = "template <typename T> __global__ void s(T* x) { x[0] = T(1); }\n"
    _, prog = nvrtc.nvrtcCreateProgram(
        source.encode(),
        b"kernel.cu",
        len(names),
        [headers[n].encode() for n in names],
        [n.encode() for n in names],
    )
    if typo:
        nvrtc.nvrtcAddNameExpression(prog, b"s<flaot>")
    nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
    nvrtc.nvrtcDestroyProgram(prog)
    path = trace.with_suffix(".json")
    if not path.exists():
        return None
    events = json.loads(path.read_text())["traceEvents"]
    return [e["args"]["detail"] for e in events if e.get("name") == "Processing Header File"]


def _case(name: str) -> None:
    """In the fresh process: the case, then the reference program twice."""
    from kcache.toolchain import load_toolchain  # only for the bundled headers' -I options

    include = load_toolchain().include_flags
    source, headers, extra, traced, threaded = CASES[name]
    if source:
        if threaded:
            worker = threading.Thread(
                target=_compile, args=(source, headers, extra, traced, include)
            )
            worker.start()
            worker.join()
        else:
            _compile(source, headers, extra, traced, include)
    traces = [_compile(REFERENCE, REFERENCE_HEADERS, [], True, include) for _ in range(2)]
    print(json.dumps(traces))


def main() -> None:
    """One line per case."""
    if len(sys.argv) > 2 and sys.argv[1] == "--case":
        _case(sys.argv[2])
        return
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    print(f"NVRTC {major}.{minor}: the reference program's trace after each case")
    for name in CASES:
        done = subprocess.run(
            [sys.executable, __file__, "--case", name], capture_output=True, text=True, check=True
        )
        traces = json.loads(done.stdout)
        verdict = (
            "complete"
            if all(t == COMPLETE for t in traces)
            else f"INCOMPLETE: {traces[0]} then {traces[1]}"
        )
        print(f"  {name:62s} {verdict}")


if __name__ == "__main__":
    main()
