"""Give the server on the GPU image its NVRTC header directory: ``python server_headers.py ROOT``.

The image's NVRTC is 13.0, which has no ``nvrtcInstallBundledHeaders`` (13.3+), so
``kcache.toolchain.load_toolchain`` cannot extract the headers and the server does not
start; the 13.3+ NVRTC wheel is too large to carry to the machine. The acceptance needs no
server compile (foreign artifacts are the libraries' own compiles), so the header
directory ``load_toolchain(ROOT)`` looks for is filled here with the image's own CUDA
headers (``nvidia/cu13/include``, what CuPy and cuda.core compile with), hashed as
kcache hashes an extracted tree. The server then starts on ``KCACHE_TOOLCHAIN_DIR=ROOT``;
no recipe is compiled by it in this run.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from cuda.bindings import nvrtc
from cuda.pathfinder import find_nvidia_header_directory, load_nvidia_dynamic_lib

from kcache import toolchain


def main() -> int:
    root = Path(sys.argv[1])
    located = [load_nvidia_dynamic_lib("nvrtc"), load_nvidia_dynamic_lib("nvJitLink")]
    nvrtc_lib, jitlink_lib = (Path(lib.abs_path) for lib in located)
    builtins = sorted(nvrtc_lib.parent.glob("libnvrtc-builtins.so*"))
    libraries = [nvrtc_lib, jitlink_lib, *builtins[-1:]]
    _, major, minor = nvrtc.nvrtcVersion()
    lib_hash = toolchain._library_hash(libraries, root)
    dest = root / f"nvrtc{major}.{minor}-{lib_hash[:16]}"
    headers = find_nvidia_header_directory("cudart")
    if headers is None:
        print("no CUDA header directory found", file=sys.stderr)
        return 1
    shutil.copytree(headers, dest / "include", dirs_exist_ok=True)
    (dest / "tree.sha256").write_text(toolchain._tree_hash(dest / "include") + "\n")
    print(f"server headers: {headers} -> {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
