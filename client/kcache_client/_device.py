"""What ``target="auto"`` means on this process: the compute capability of its CUDA device.

The CUDA driver is asked directly (``cuda.bindings.driver``, imported only when a
recipe says ``auto``), so the client needs neither torch nor a CUDA context of its
own. The device is the one given, else torch's current device when torch has
already initialised CUDA (the usual ``torch.cuda.set_device(local_rank)``), else
``LOCAL_RANK`` modulo the device count, else device 0.
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache

from kcache_client.errors import NoDeviceError

__all__ = ["auto_target", "current_device", "driver_version"]


def _driver_call(result: tuple[object, ...], what: str) -> tuple[object, ...]:
    from cuda.bindings import driver

    if result[0] != driver.CUresult.CUDA_SUCCESS:
        raise NoDeviceError(f'target "auto": {what} failed with {result[0]!r}')
    return result


def _device_count() -> int:
    from cuda.bindings import driver

    _driver_call(driver.cuInit(0), "cuInit")
    (_, count) = _driver_call(driver.cuDeviceGetCount(), "cuDeviceGetCount")
    return int(count)  # type: ignore[call-overload,no-any-return]


def current_device() -> int:
    """The ordinal of the device this process uses (see the module docstring)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return int(torch.cuda.current_device())
        except Exception:  # a torch build without CUDA support: fall through to the driver
            pass
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank and local_rank.isdigit():
        count = _device_count()
        return int(local_rank) % count if count else 0
    return 0


@lru_cache(maxsize=16)
def auto_target(device: int | None = None) -> str:
    """``sm_XY`` of ``device`` (see :func:`current_device`); NoDeviceError if there is none."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise NoDeviceError(
            'target "auto" needs the CUDA driver bindings: pip install cuda-bindings '
            "(or give the recipe an explicit target such as sm_90)"
        ) from exc
    try:
        ordinal = current_device() if device is None else device
        count = _device_count()
        if count == 0:
            raise NoDeviceError('target "auto": the CUDA driver reports no devices')
        if not 0 <= ordinal < count:
            raise NoDeviceError(f'target "auto": device {ordinal} does not exist ({count} visible)')
        (_, dev) = _driver_call(driver.cuDeviceGet(ordinal), "cuDeviceGet")
        attr = driver.CUdevice_attribute
        (_, major) = _driver_call(
            driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
            "cuDeviceGetAttribute",
        )
        (_, minor) = _driver_call(
            driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
            "cuDeviceGetAttribute",
        )
    except NoDeviceError:
        raise
    except Exception as exc:  # the driver library missing raises pathfinder's own types
        raise NoDeviceError(
            f'target "auto" needs an NVIDIA GPU and driver, and none is usable here: {exc} '
            "(give the recipe an explicit target such as sm_90, or auto_target= to KernelCache)"
        ) from exc
    return f"sm_{major}{minor}"


@lru_cache(maxsize=1)
def driver_version() -> int | None:
    """The CUDA version the driver supports (``cuDriverGetVersion``: 13000 is 13.0); None if unknown."""
    try:
        from cuda.bindings import driver

        (status, version) = driver.cuDriverGetVersion()
        if status != driver.CUresult.CUDA_SUCCESS:
            return None
        return int(version)
    except Exception:  # no bindings or no driver library: the caller says what it could not check
        return None
