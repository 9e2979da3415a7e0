"""The collective operations a warmup needs, and the adapter for ``torch.distributed``.

A warmup needs only two collectives: an all-gather (every rank's concrete recipes)
and a broadcast from the leader (the outcomes; it doubles as the barrier). Any
object with those two methods, a ``rank`` and a ``world_size`` will do, so jobs
on MPI or a custom launcher can plug in their own.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

__all__ = ["Collective", "TorchCollective", "as_collective"]


@runtime_checkable
class Collective(Protocol):
    """Object collectives over a group of processes. Every call is made by every member.

    Implementations bound their waits: a member that never arrives makes the others
    raise (any exception) instead of hanging.
    """

    @property
    def rank(self) -> int:
        """This process's rank in the group (0-based)."""
        ...

    @property
    def world_size(self) -> int:
        """How many processes the group has."""
        ...

    def all_gather(self, obj: Any) -> list[Any]:
        """Every member's ``obj`` (JSON-able data), indexed by rank."""
        ...

    def broadcast(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s ``obj``; the others pass anything (ignored)."""
        ...


class TorchCollective:
    """A :class:`Collective` over a ``torch.distributed`` process group.

    The collectives run on a gloo side group created with ``timeout``: they then stay
    on the CPU whatever the job's main backend is (NCCL would need GPU tensors and a
    current device), and every wait is bounded by the timeout, so a dead leader
    cannot hang the other ranks. Objects travel as JSON.
    """

    def __init__(self, group: Any = None, *, timeout: float = 1800.0) -> None:
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call init_process_group first"
            )
        self._dist = dist
        self._torch = torch
        self._parent = group if group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(self._parent) if group is not None else None
        self._group = dist.new_group(
            ranks=ranks,
            backend="gloo",
            timeout=timedelta(seconds=timeout),
            # Only the group's members take part, so a subgroup's warmup needs no one else.
            use_local_synchronization=ranks is not None,
        )
        self._rank = int(dist.get_rank(self._group))
        self._world_size = int(dist.get_world_size(self._group))

    @property
    def rank(self) -> int:
        """This process's rank within the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The group's size."""
        return self._world_size

    def all_gather(self, obj: Any) -> list[Any]:
        """Every member's JSON-able ``obj``, as tensors on the gloo side group."""
        torch = self._torch
        data = _encode(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self._world_size)]
        self._dist.all_gather(
            sizes, torch.tensor([len(data)], dtype=torch.int64), group=self._group
        )
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self._world_size)]
        self._dist.all_gather(parts, mine, group=self._group)
        return [_decode(part[: int(size.item())]) for part, size in zip(parts, sizes, strict=True)]

    def broadcast(self, obj: Any, src: int) -> Any:
        """Group rank ``src``'s JSON-able ``obj``, as tensors on the gloo side group."""
        torch = self._torch
        data = _encode(obj) if self._rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._dist.broadcast(size, group=self._group, group_src=src)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8)
        if self._rank == src:
            buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._dist.broadcast(buf, group=self._group, group_src=src)
        return _decode(buf)

    def close(self) -> None:
        """Destroy the side group."""
        self._dist.destroy_process_group(self._group)


def _encode(obj: Any) -> bytes:
    # JSON, not pickle: what a warmup exchanges is plain data, and unpickling what
    # another process sent would let any rank run code in every other one.
    return json.dumps(obj, separators=(",", ":")).encode()


def _decode(tensor: Any) -> Any:
    # bytes(tolist()) rather than .numpy(): torch's object collectives need numpy,
    # which a CPU-only training image may lack.
    return json.loads(bytes(tensor.tolist())) if tensor.numel() else None


def as_collective(group: Any, *, timeout: float) -> Collective | None:
    """``group`` as a Collective: as it is, a torch process group, or torch's world; None alone.

    With ``group=None`` the default torch process group is used when one is
    initialised, so ``cache.warmup(recipes)`` in a torchrun job does the right thing.
    """
    if group is not None and isinstance(group, Collective):
        return group
    dist = sys.modules.get("torch.distributed")
    if group is None:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        if dist.get_world_size() == 1:
            return None
    return TorchCollective(group, timeout=timeout)
