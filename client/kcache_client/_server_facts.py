"""The server's default toolchain, kept in the node tier with its signature.

A recipe without a toolchain is keyed with the server's default, so before this a process
asked ``GET /v1/toolchains`` before its first key: one request per process, on a node whose
tier already held every kernel of the job. The answer carries the server's signature of its
default as of a moment (:class:`kcache.signing.DefaultToolchain`); the tier keeps it with
the other server facts, and a process that starts while it is young (at most
:data:`MAX_AGE_S`, by the signed moment and this machine's clock) keys with it without
asking, once a key trusted for the server (given, or pinned) verifies it. Anyone may write
a shared tier's facts: an unsigned, forged or old word is not taken (the server is asked).

What this gives up: a server whose default changes (an upgrade) is followed by processes
that start at most :data:`MAX_AGE_S` later; until then they key as before and get the
kernels of the former default, which are what the server compiled for those keys. Include
sets' digests are not kept this way: they change with files, not with releases, and are
asked for each time a process needs them (docs/design.md "What a binding rests on").
"""

from __future__ import annotations

import time
from typing import Any

from kcache.signing import DefaultToolchain, Signature, SignatureError
from kcache_client._trust import Trust

__all__ = ["MAX_AGE_S", "kept_default", "signed_default"]

#: How long a signed default toolchain is used without asking: a job's processes start
#: within seconds or minutes of each other, and a server's upgrade is followed this soon.
MAX_AGE_S = 300.0
#: A word signed this far ahead of this machine's clock is still taken (clocks differ).
_AHEAD_S = 60.0


def signed_default(body: dict[str, Any]) -> dict[str, Any]:
    """What of a ``GET /v1/toolchains`` answer the tier keeps for :func:`kept_default`
    (nothing from a server that does not sign its default)."""
    issued_at, signature = body.get("default_issued_at"), body.get("default_signature")
    if not isinstance(issued_at, int) or isinstance(issued_at, bool):
        return {}
    if not isinstance(signature, dict):
        return {}
    return {"default_issued_at": issued_at, "default_signature": signature}


def kept_default(
    facts: dict[str, Any] | None, trust: Trust, now: float | None = None
) -> str | None:
    """The default toolchain the tier's ``facts`` name, if the server's signature over it
    verifies by a key trusted for the server and it was signed less than :data:`MAX_AGE_S`
    ago; else None (ask the server)."""
    if not facts:
        return None
    toolchain, issued_at = facts.get("default_toolchain"), facts.get("default_issued_at")
    if not isinstance(toolchain, str) or not isinstance(issued_at, int):
        return None
    age = (time.time() if now is None else now) - issued_at
    if not -_AHEAD_S <= age <= MAX_AGE_S:
        return None
    try:
        signature = Signature.from_dict(facts.get("default_signature"))
    except SignatureError:
        return None
    word = DefaultToolchain(toolchain, issued_at)
    return toolchain if trust.default_toolchain_verdict(word, signature).ok else None
