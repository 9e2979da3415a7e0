"""``check_loadable``: what ``Artifact.load()`` refuses before the driver, on real NVRTC output.

The cubins and PTX are compiled here by the real NVRTC (it needs no GPU); the device's
compute capability and the driver's version are the inputs a GPU would give.
"""

from __future__ import annotations

import re

import pytest
from kcache_client import ArchitectureMismatchError
from kcache_client._artifact import check_loadable

from kcache import Recipe
from kcache.compilers import InProcessCompiler
from kcache.errors import InvalidArtifactError
from kcache.toolchain import Toolchain

bindings = pytest.importorskip("cuda.bindings.utils")

SOURCE = 'extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }\n'


@pytest.fixture(scope="module")
def built(toolchain: Toolchain) -> dict[str, bytes]:
    """Real NVRTC output by target: cubins for four SMs, PTX for two."""
    compiler = InProcessCompiler(toolchain)
    out = {}
    for target in ("sm_80", "sm_86", "sm_90", "sm_90a"):
        out[target] = compiler.compile(
            Recipe(source=SOURCE, target=target, toolchain=toolchain.id)
        ).data
    for target in ("compute_80", "compute_90a"):
        recipe = Recipe(source=SOURCE, target=target, output="ptx", toolchain=toolchain.id)
        out[target] = compiler.compile(recipe).data
    return out


def ptx_isa(data: bytes) -> str:
    found = re.search(rb"\.version (\d+\.\d+)", data)
    assert found is not None
    return found.group(1).decode()


@pytest.mark.parametrize(
    ("target", "device"),
    [("sm_80", (8, 0)), ("sm_80", (8, 6)), ("sm_80", (8, 9)), ("sm_86", (8, 6)), ("sm_90", (9, 0))],
)
def test_a_cubin_loads_on_its_own_major_version_from_its_minor_on(
    built: dict[str, bytes], target: str, device: tuple[int, int]
) -> None:
    assert check_loadable("cubin", built[target], target, device, 13000) is None


@pytest.mark.parametrize(
    ("target", "device", "built_for", "have"),
    [
        ("sm_80", (9, 0), "sm_80", "sm_90"),  # the case: another major version
        ("sm_90", (8, 0), "sm_90", "sm_80"),
        ("sm_86", (8, 0), "sm_86", "sm_80"),  # a lower minor
        ("sm_90", (10, 0), "sm_90", "sm_100"),
        ("sm_90a", (10, 0), "sm_90a", "sm_100"),
    ],
)
def test_a_cubin_for_another_architecture_is_refused_naming_both(
    built: dict[str, bytes], target: str, device: tuple[int, int], built_for: str, have: str
) -> None:
    with pytest.raises(ArchitectureMismatchError) as caught:
        check_loadable("cubin", built[target], target, device, 13000, device="GPU 1")
    assert f"the artifact is {built_for}, GPU 1 is {have}" in str(caught.value)
    assert (caught.value.artifact, caught.value.device) == (built_for, have)
    assert isinstance(caught.value, RuntimeError)


def test_the_sm_comes_from_the_bytes_not_the_metadata(built: dict[str, bytes]) -> None:
    # Metadata that claims sm_90 cannot get an sm_80 cubin past the check.
    with pytest.raises(ArchitectureMismatchError, match="is sm_80, the device is sm_90"):
        check_loadable("cubin", built["sm_80"], "sm_90", (9, 0), 13000)


def test_bytes_that_are_no_cubin_are_refused(built: dict[str, bytes]) -> None:
    with pytest.raises(InvalidArtifactError):
        check_loadable("cubin", built["compute_80"], "sm_80", (8, 0), 13000)


def test_ptx_is_compiled_for_later_devices_unless_arch_specific(built: dict[str, bytes]) -> None:
    needed = bindings.get_minimal_required_cuda_ver_from_ptx_ver(ptx_isa(built["compute_80"]))
    assert check_loadable("ptx", built["compute_80"], "compute_80", (9, 0), needed) is None
    assert check_loadable("ptx", built["compute_90a"], "compute_90a", (9, 0), needed) is None
    with pytest.raises(ArchitectureMismatchError, match="is PTX for sm_90a, the device is sm_100"):
        check_loadable("ptx", built["compute_90a"], "compute_90a", (10, 0), needed)
    with pytest.raises(ArchitectureMismatchError, match="is PTX for sm_80, the device is sm_75"):
        check_loadable("ptx", built["compute_80"], "compute_80", (7, 5), needed)


def test_ptx_newer_than_the_driver_is_refused_naming_both(built: dict[str, bytes]) -> None:
    isa = ptx_isa(built["compute_80"])
    needed = bindings.get_minimal_required_cuda_ver_from_ptx_ver(isa)
    older = needed - 10 if needed % 1000 else needed - 1000 + 90  # the CUDA release before it
    with pytest.raises(ArchitectureMismatchError) as caught:
        check_loadable("ptx", built["compute_80"], "compute_80", (9, 0), older)
    assert caught.value.artifact == f"PTX ISA {isa}"
    need = f"{needed // 1000}.{needed % 1000 // 10}"
    have = f"{older // 1000}.{older % 1000 // 10}"
    assert f"is PTX ISA {isa}, which needs a CUDA {need} driver" in str(caught.value)
    assert caught.value.device == f"CUDA {have} driver"


def test_what_cannot_be_checked_is_said(built: dict[str, bytes]) -> None:
    isa = ptx_isa(built["compute_80"])
    note = check_loadable("ptx", built["compute_80"], "compute_80", (9, 0), None)
    assert note is not None and f"PTX ISA {isa}" in note and "not checked" in note
    future = b"//\n.version 99.9\n.target sm_80\n.address_size 64\n"
    note = check_loadable("ptx", future, "compute_80", (9, 0), 13000)
    assert note is not None and "99.9" in note and "not checked" in note
    assert check_loadable("ltoir", b"\x00", "sm_90", (9, 0), 13000) is None
