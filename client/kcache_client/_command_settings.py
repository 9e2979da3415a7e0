"""The settings a client command runs with: its flags, the environment, then a command's defaults.

Its own module because two commands need it: every client command opens its
``KernelCache`` with these settings (:mod:`kcache_client._cli`), and ``kcache config``
(:mod:`kcache_client._config_cli`) shows them with where each came from.

A command differs from a library in two defaults only, because a person is waiting:
its server gets a few seconds (retries included) before it is called unreachable,
with a status line on stderr before each wait, and a connect gets 2 s. Both give way
to the environment (``KCACHE_RETRY_*``, ``KCACHE_CONNECT_TIMEOUT_S``), as every
setting does.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kcache.cli import include_set_dirs

if TYPE_CHECKING:
    from kcache_client._settings import ClientSettings, RetryPolicy

__all__ = ["COMMAND_CONNECT_TIMEOUT_S", "COMMAND_RETRY", "command_settings"]

#: The CLI gives a server this long (retries included) before saying it is unreachable,
#: unless KCACHE_RETRY_* say otherwise (the retry fields a command starts from).
COMMAND_RETRY = {"attempts": 4, "base_s": 0.2, "cap_s": 0.8, "budget_s": 4.0}
#: Connecting should be quick (unless KCACHE_CONNECT_TIMEOUT_S); compiles may still take
#: minutes once connected.
COMMAND_CONNECT_TIMEOUT_S = 2.0


def _announcing_retry(url: str) -> RetryPolicy:
    """A short retry budget that says on stderr, before each wait, that it is waiting.

    Once one request has retried in vain, later requests of the same command try once
    and give up: the server did not answer a moment ago, and each further round of
    retries would only repeat the wait.
    """
    from dataclasses import dataclass

    from kcache_client._settings import RetryPolicy

    gave_up = False

    @dataclass(frozen=True)
    class AnnouncingRetry(RetryPolicy):
        def backoff(self, attempt: int) -> float:
            nonlocal gave_up
            if attempt == 0 and gave_up:
                return float("inf")  # beyond any budget: the transport stops at once
            if attempt >= 1:
                gave_up = True
            wait = super().backoff(attempt)
            if attempt + 1 < self.attempts:
                print(
                    f"kcache: waiting for the server at {url} (try {attempt + 2} of {self.attempts})",
                    file=sys.stderr,
                    flush=True,
                )
            return wait

    # A person waits at the terminal: a few seconds, unless the environment says otherwise.
    return AnnouncingRetry.from_env(**COMMAND_RETRY)


def command_settings(args: argparse.Namespace, url: str | None) -> ClientSettings:
    """The settings a client command runs with: its flags, then the environment, then the
    command's defaults (a short retry budget and connect timeout: a person is waiting)."""
    import httpx

    from kcache_client._settings import DEFAULT_TIMEOUT, ClientSettings, timeout_from_env

    explicit = getattr(args, "cache_dir", None)
    return ClientSettings.from_env(
        url=url,
        token=getattr(args, "token", None),
        cache_dir=explicit,
        auto_target=getattr(args, "auto_target", None),
        local_compile=True if getattr(args, "local_compile", False) else None,
        include_sets=include_set_dirs(args),
        retry=_announcing_retry(url) if url else None,
        timeout=timeout_from_env(
            httpx.Timeout(DEFAULT_TIMEOUT.read, connect=COMMAND_CONNECT_TIMEOUT_S)
        ),
    )
