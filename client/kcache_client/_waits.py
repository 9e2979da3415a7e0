"""How long the client waits for bytes: :class:`Waits`, and what it reads of any :class:`Timeouts`.

kcache's own HTTP client (:mod:`kcache_client._lean_http`) reads three waits of a
timeout, each the longest wait for the next bytes: while connecting, while reading,
while sending (None: no bound). :class:`Waits` holds them, with nothing imported for
it; ``ClientSettings.timeout`` defaults to one. A caller may still hand over an
``httpx.Timeout``, or anything else with those three attributes (:class:`Timeouts`):
its ``pool`` wait, if it has one, bounds nothing here (the lean client waits for no
pooled connection: it opens another).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

__all__ = ["Timeouts", "Waits"]


class Timeouts(Protocol):
    """What the client reads of a timeout: a :class:`Waits`, an ``httpx.Timeout``, or the like."""

    @property
    def connect(self) -> float | None:
        """The longest wait to connect (TCP, a proxy's tunnel, TLS), in seconds; None: none."""
        ...

    @property
    def read(self) -> float | None:
        """The longest wait for the next bytes of an answer, in seconds; None: none."""
        ...

    @property
    def write(self) -> float | None:
        """The longest wait to send the next bytes of a request, in seconds; None: none."""
        ...


class Waits(NamedTuple):
    """The longest wait for bytes while connecting, reading and sending, in seconds (None: none)."""

    connect: float | None
    read: float | None
    write: float | None
