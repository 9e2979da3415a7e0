"""Request ids: one per HTTP request, on every response (``X-Request-ID``) and in the log.

A 500 answer carries only its request id; the traceback is logged under the same
id, so an operator can find what happened without the caller ever seeing it. The
id of the request being served is a context variable: it follows the request into
worker threads (``anyio.to_thread`` copies the context) and into the error handlers.
"""

from __future__ import annotations

import itertools
import os
from contextvars import ContextVar

__all__ = ["HEADER", "current_request_id", "new_request_id", "request_id_var"]

#: The response header that carries the id (lower case, as ASGI sends header names).
HEADER = b"x-request-id"

# A random prefix per process and a counter: unique across replicas and workers, and
# cheap enough for the fetch fast path (no random bytes per request).
_PREFIX = os.urandom(6).hex()
_COUNTER = itertools.count(1)

#: The id of the request this code runs for, or None outside a request.
request_id_var: ContextVar[str | None] = ContextVar("kcache_request_id", default=None)


def new_request_id() -> str:
    """A fresh id: ``<12 hex digits of this process>-<counter in hex>``."""
    return f"{_PREFIX}-{next(_COUNTER):x}"


def current_request_id() -> str | None:
    """The id of the request being served (None outside a request)."""
    return request_id_var.get()
