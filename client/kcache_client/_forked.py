"""What a forked child must not share with its parent: one fork hook for every such object.

A data loader's workers fork a process that holds a :class:`~kcache_client.KernelCache`.
Sockets, file locks and queues copied into the child are still the parent's: a keep-alive
connection read by both processes, a lock object the child may not use, audit events both
would send. Each object that holds one registers here (:func:`reset_in_child`) and its
``_after_fork_in_child()`` runs in every child, right after the fork, before anything else
can use it (``os.register_at_fork``).
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol

__all__ = ["reset_in_child"]


class _Resettable(Protocol):
    def _after_fork_in_child(self) -> None: ...


#: The objects of this process that start afresh in a child; each goes when it is collected.
_OBJECTS: weakref.WeakSet[_Resettable] = weakref.WeakSet()


def reset_in_child(obj: _Resettable) -> None:
    """Run ``obj._after_fork_in_child()`` in every child this process forks from now on."""
    _OBJECTS.add(obj)


def _after_fork_in_child() -> None:
    for obj in list(_OBJECTS):
        obj._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
