"""Without the server: keying from what the node tier kept, and the one line that says so.

A recipe without a toolchain is keyed with the server's default, and one naming a server
include set with that set's digest (:mod:`~kcache_client._include_pins`). ``KernelCache``
asks the server for both (``GET /v1/toolchains``) and saves the answer in the node tier (a
signed default is taken from there while it is young: :mod:`~kcache_client._server_facts`).
When the server cannot be reached these read what the tier kept, so a process started while
the server is down keys its recipes as before and finds them in the tier; failing that, a
local NVRTC's toolchain is used where local compiles are on, and else the error says what
is not known yet and where it was looked for. Whatever answers instead (the tier, a local
compile), the process logs once that its server did not answer (:func:`tell_offline`).
"""

from __future__ import annotations

import logging
import threading

from kcache.errors import ToolchainError
from kcache_client._include_pins import server_set_digests
from kcache_client._local import LocalCompiler
from kcache_client._tier import NodeTier
from kcache_client.errors import ServerUnavailableError

__all__ = ["OFFLINE_LOGGER", "offline_set_digests", "offline_toolchain", "tell_offline"]

#: The logger of the one line a process logs when its server first fails it (``kcache``
#: commands, which say so in their own words, silence it).
OFFLINE_LOGGER = "kcache_client.offline"
_offline_log = logging.getLogger(OFFLINE_LOGGER)
_offline_told = threading.Lock()  # held for good once the line is logged: once per process


def tell_offline(offline: ServerUnavailableError, answer: str) -> None:
    """Log, once per process, that the server did not answer and how the cache answered instead.

    A training job whose server is down keeps running on its node tier (and local
    compiles, where enabled), which is the point; but it should not do so without a
    word, and a word per kernel would flood its log. A warning, so that a program
    that configured no logging still shows it (Python's last-resort handler).
    """
    if not _offline_told.acquire(blocking=False):
        return
    _offline_log.warning(
        "kcache server %s is unreachable (%s); %s. Logged once per process: later "
        "answers without the server are not logged (KernelCache.stats counts them).",
        offline.url,
        offline.cause,
        answer,
    )


def offline_toolchain(
    tier: NodeTier, url: str | None, local: LocalCompiler, cause: ServerUnavailableError
) -> str:
    """The default toolchain ``tier`` kept for the server at ``url``; else a local NVRTC's
    where local compiles are on; else ServerUnavailableError (``cause``, and what is missing)."""
    if url is not None:
        facts = tier.load_server_facts(url)
        if facts and isinstance(facts.get("default_toolchain"), str):
            return str(facts["default_toolchain"])
    if local.enabled:
        try:
            return local.engine().toolchain_id
        except ToolchainError as exc:
            raise ServerUnavailableError(
                cause.url, f"{cause.cause}; and no local NVRTC: {exc}"
            ) from exc
    raise ServerUnavailableError(
        cause.url,
        f"{cause.cause}; the recipe names no toolchain, and the server's default is not "
        f"known in {tier.root} yet (give the recipe a toolchain, or enable local compiles)",
    ) from cause


def offline_set_digests(tier: NodeTier, url: str, cause: ServerUnavailableError) -> dict[str, str]:
    """The include sets' digests ``tier`` kept for the server at ``url``; else
    ServerUnavailableError (``cause``, and that the sets' contents are not known)."""
    facts = tier.load_server_facts(url)
    if facts and isinstance(facts.get("include_set_digests"), dict):
        return server_set_digests(facts)
    raise ServerUnavailableError(
        cause.url,
        f"{cause.cause}; the recipe names a server include set, whose contents are not "
        f"known in {tier.root} yet",
    ) from cause
