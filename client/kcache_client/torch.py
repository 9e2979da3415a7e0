"""Launching kcache kernels with PyTorch tensors on PyTorch's current stream.

::

    from kcache_client.torch import Kernel

    add = Kernel(cache.get(recipe), signature=("const float*", "const float*", "float*", "int"))
    add(grid=(n + 255) // 256, block=256, *(x, y, out, n))     # torch.cuda.current_stream()

A tensor argument is passed as its data pointer, after checking that it lives on the
device the launch runs on (a host or another GPU's pointer would fault); where a
``signature`` declares the parameter (``"float*"``), its dtype and contiguity are
checked too. A Python number is packed by the declared parameter type (``"int"``,
``"float"``, ``"uint64_t"`` ...), else by the size the driver reports for the
parameter (cuda.core's ``Kernel.arguments_info``): 4 bytes take an ``int`` as int32
and a ``float`` as float32, 8 bytes as int64 and float64. NumPy and ctypes scalars
pass unchanged. torch and cuda.core are imported only when used.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kcache_client._adapters import cuda_core, require

__all__ = ["Kernel", "Param", "launch", "pack_arguments", "parse_signature"]

#: C scalar types -> NumPy scalar type names (packed by value).
_SCALARS = {
    "bool": "bool_",
    "char": "int8",
    "signed char": "int8",
    "int8_t": "int8",
    "unsigned char": "uint8",
    "uint8_t": "uint8",
    "short": "int16",
    "int16_t": "int16",
    "unsigned short": "uint16",
    "uint16_t": "uint16",
    "int": "int32",
    "int32_t": "int32",
    "unsigned": "uint32",
    "unsigned int": "uint32",
    "uint32_t": "uint32",
    "long": "int64",
    "long long": "int64",
    "int64_t": "int64",
    "ptrdiff_t": "int64",
    "unsigned long": "uint64",
    "unsigned long long": "uint64",
    "uint64_t": "uint64",
    "size_t": "uint64",
    "__half": "float16",
    "half": "float16",
    "float": "float32",
    "double": "float64",
}
#: Pointee C types -> torch dtype names (a ``void*`` takes any dtype): every scalar type
#: under its torch name, and bfloat16, which NumPy has no scalar for.
_POINTEES = {
    **{c_type: name.removesuffix("_") for c_type, name in _SCALARS.items()},
    "__nv_bfloat16": "bfloat16",
}
_QUALIFIERS = re.compile(r"\b(?:const|volatile|__restrict__|__restrict|restrict)\b")


@dataclass(frozen=True)
class Param:
    """One declared kernel parameter: a pointer to ``dtype`` (None: ``void*``), or a scalar."""

    text: str
    pointer: bool
    dtype: str | None  # torch dtype name for pointers, NumPy scalar type name for scalars


def parse_signature(signature: Sequence[str]) -> tuple[Param, ...]:
    """Parameter types as C spells them (``"const float*"``, ``"int"``) -> :class:`Param` s."""
    if isinstance(signature, str):
        raise TypeError('signature is a list of parameter types, such as ("float*", "int")')
    params = []
    for i, text in enumerate(signature):
        if not isinstance(text, str):
            raise TypeError(f"signature[{i}]: a C type string, not {type(text).__name__}")
        base = " ".join(_QUALIFIERS.sub(" ", text).replace("*", " * ").split())
        if base.endswith("*"):
            pointee = base[:-1].strip()
            if "*" in pointee:
                raise ValueError(
                    f"signature[{i}]: {text!r}: pointers to pointers are not launched from tensors"
                )
            if pointee != "void" and pointee not in _POINTEES:
                raise ValueError(
                    f"signature[{i}]: {text!r}: unknown pointee type {pointee!r} (use void*)"
                )
            params.append(Param(text, True, None if pointee == "void" else _POINTEES[pointee]))
        elif base in _SCALARS:
            params.append(Param(text, False, _SCALARS[base]))
        else:
            known = ", ".join(sorted(_SCALARS))
            raise ValueError(
                f"signature[{i}]: {text!r} is not a scalar type kcache packs ({known}) or a pointer"
            )
    return tuple(params)


_BY_SIZE = {
    (2, float): "float16",
    (4, float): "float32",
    (8, float): "float64",
    (1, int): "int8",
    (2, int): "int16",
    (4, int): "int32",
    (8, int): "int64",
}


def _scalar(np: Any, value: Any, dtype: str, where: str) -> Any:
    if dtype.startswith("int") or dtype.startswith("uint"):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{where}: an integer parameter ({dtype}) got {type(value).__name__}")
        info = np.iinfo(dtype)
        if not info.min <= value <= info.max:
            # An unsigned pattern in a signed parameter of the same width is still one value.
            unsigned = np.iinfo("u" + dtype) if not dtype.startswith("u") else None
            if unsigned is None or not 0 <= value <= unsigned.max:
                raise OverflowError(f"{where}: {value} does not fit {dtype}")
            return getattr(np, "u" + dtype)(value)
    return getattr(np, dtype)(value)


def pack_arguments(
    args: Sequence[Any],
    *,
    device: int,
    params: Sequence[Param] | None = None,
    sizes: Sequence[int] | None = None,
) -> list[Any]:
    """Kernel arguments for cuda.core's ``launch``: tensors as checked data pointers, numbers packed.

    ``device`` is the CUDA device index the launch runs on; ``params`` the declared
    signature (checked: count, dtype and contiguity of tensors, the type of numbers);
    ``sizes`` the parameter sizes in bytes the driver reports, used for numbers when
    there is no signature.
    """
    torch = require("torch", "torch", "kcache_client.torch")
    np = require("numpy", "numpy", "kcache_client.torch")
    if params is not None and len(params) != len(args):
        raise TypeError(
            f"the kernel takes {len(params)} arguments ({', '.join(p.text for p in params)}), got {len(args)}"
        )
    if sizes is not None and len(sizes) != len(args):
        raise TypeError(f"the kernel takes {len(sizes)} arguments, got {len(args)}")
    packed: list[Any] = []
    for i, arg in enumerate(args):
        where = f"argument {i}"
        param = params[i] if params is not None else None
        if isinstance(arg, torch.Tensor):
            if param is not None:
                if not param.pointer:
                    raise TypeError(f"{where}: a tensor for the scalar parameter {param.text!r}")
                if param.dtype is not None and arg.dtype != getattr(torch, param.dtype):
                    raise TypeError(
                        f"{where}: {param.text!r} takes torch.{param.dtype}, the tensor is {arg.dtype}"
                    )
                if not arg.is_contiguous():
                    raise ValueError(
                        f"{where}: {param.text!r} takes a contiguous tensor; pass .contiguous()"
                    )
            if arg.device.type != "cuda" or arg.device.index != device:
                raise ValueError(
                    f"{where}: the tensor is on {arg.device}, the launch runs on cuda:{device}"
                )
            packed.append(np.uint64(arg.data_ptr()))
        elif isinstance(arg, bool | int | float) and not isinstance(arg, np.generic):
            if param is not None:
                if param.pointer:
                    raise TypeError(
                        f"{where}: {param.text!r} takes a tensor, got {type(arg).__name__}"
                    )
                assert param.dtype is not None
                packed.append(_scalar(np, arg, param.dtype, where))
            elif sizes is not None:
                kind = float if isinstance(arg, float) else int
                dtype = (
                    "bool_"
                    if isinstance(arg, bool) and sizes[i] == 1
                    else _BY_SIZE.get((sizes[i], kind))
                )
                if dtype is None:
                    raise TypeError(
                        f"{where}: a {type(arg).__name__} for a {sizes[i]}-byte parameter; pass a NumPy scalar"
                    )
                packed.append(_scalar(np, arg, dtype, where))
            else:
                raise TypeError(
                    f"{where}: a Python {type(arg).__name__} with no parameter type known; give the "
                    "kernel a signature or pass a NumPy scalar (np.int32, np.float32, ...)"
                )
        else:
            packed.append(arg)  # NumPy/ctypes scalars and cuda.core Buffers: cuda.core packs them
    return packed


class Kernel:
    """A kcache kernel launched with torch tensors; loaded once per device.

    ``kernel`` is an :class:`~kcache_client.Artifact` (with ``name`` picking the kernel
    of a module with several, as in ``Artifact.load``) or a loaded cuda.core Kernel;
    ``signature`` optionally declares the parameter types, as C spells them.
    """

    def __init__(
        self, kernel: Any, name: str | None = None, *, signature: Sequence[str] | None = None
    ) -> None:
        self._source = kernel
        self._name = name
        self.params = None if signature is None else parse_signature(signature)
        self._loaded: dict[int, tuple[Any, list[int] | None]] = {}
        self._lock = threading.Lock()

    def _for_device(self, device: int) -> tuple[Any, list[int] | None]:
        loaded = self._loaded.get(device)
        if loaded is not None:
            return loaded
        with self._lock:
            loaded = self._loaded.get(device)
            if loaded is None:
                from kcache_client._artifact import Artifact

                if isinstance(self._source, Artifact):
                    kernel = self._source.load(self._name, device=device)
                else:
                    kernel = self._source
                try:
                    sizes: list[int] | None = [int(p.size) for p in kernel.arguments_info]
                except Exception:  # older cuda.core or driver without cuFuncGetParamInfo
                    sizes = None
                loaded = self._loaded[device] = (kernel, sizes)
        return loaded

    def __call__(
        self,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        *args: Any,
        stream: Any = None,
        shared_mem: int = 0,
    ) -> None:
        """Launch on ``stream`` (default: ``torch.cuda.current_stream()`` of the current device)."""
        torch = require("torch", "torch", "kcache_client.torch")
        device = _current_device(torch)
        kernel, sizes = self._for_device(device)
        packed = pack_arguments(args, device=device, params=self.params, sizes=sizes)
        core = cuda_core()
        torch_stream = stream if stream is not None else torch.cuda.current_stream(device)
        config = core.LaunchConfig(grid=_dims(grid), block=_dims(block), shmem_size=shared_mem)
        core.launch(
            _core_stream(core, device, int(torch_stream.cuda_stream)), config, kernel, *packed
        )


def launch(
    kernel: Any,
    grid: int | Sequence[int],
    block: int | Sequence[int],
    *args: Any,
    stream: Any = None,
    shared_mem: int = 0,
    signature: Sequence[str] | None = None,
) -> None:
    """Launch ``kernel`` (a cuda.core Kernel or a :class:`Kernel`) with tensors on torch's current stream."""
    runner = kernel if isinstance(kernel, Kernel) else Kernel(kernel, signature=signature)
    runner(grid, block, *args, stream=stream, shared_mem=shared_mem)


def _current_device(torch: Any) -> int:
    """torch's current CUDA device, or :class:`~kcache_client.errors.NoDeviceError` in one line.

    torch answers a CPU-only build with a bare ``AssertionError`` ("Torch not compiled with
    CUDA enabled") and a machine without a driver or GPU with a ``RuntimeError`` from its
    lazy initialisation; both mean the same here, a launch with no device to run on. Only
    the failing call pays for the check (the launch path is unchanged).
    """
    try:
        return int(torch.cuda.current_device())
    except (AssertionError, RuntimeError) as exc:
        from kcache_client.errors import NoDeviceError

        version = getattr(torch, "__version__", "?")
        build = (
            f"torch {version} is a CPU-only build: install a CUDA build of torch"
            if getattr(getattr(torch, "version", None), "cuda", None) is None
            else f"torch {version} found no usable GPU"
        )
        cause = " ".join(str(exc).split()) or type(exc).__name__
        raise NoDeviceError(
            f"kcache_client.torch launches on torch's current CUDA device, and there is none: "
            f"{build} ({cause})"
        ) from None


def _dims(value: int | Sequence[int]) -> int | tuple[int, ...]:
    return int(value) if isinstance(value, int) else tuple(int(v) for v in value)


class _ForeignStream:
    """A stream handle in the ``__cuda_stream__`` protocol (for cuda.core releases before from_handle)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


_streams: dict[tuple[int, int], Any] = {}


def _core_stream(core: Any, device: int, handle: int) -> Any:
    """cuda.core's view of torch's stream ``handle`` (not owned: torch keeps it alive)."""
    stream = _streams.get((device, handle))
    if stream is None:
        if hasattr(core.Stream, "from_handle"):
            stream = core.Stream.from_handle(handle)
        else:
            stream = core.Device(device).create_stream(_ForeignStream(handle))
        if len(_streams) > 256:
            _streams.clear()  # handles of destroyed streams: cheap to make again
        _streams[(device, handle)] = stream
    return stream
