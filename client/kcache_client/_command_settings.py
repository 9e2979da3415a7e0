"""The settings a client command runs with: its flags, the environment, then a command's defaults.

Its own module because two commands need it: every client command opens its
``KernelCache`` with these settings (:func:`command_cache`, for :mod:`kcache_client._cli`
and :mod:`kcache_client._job_cli`), and ``kcache config`` (:mod:`kcache_client._config_cli`)
shows them with where each came from.

A command differs from a library in two defaults only, because a person is waiting:
its server gets a few seconds (retries included) before it is called unreachable,
and a connect gets 2 s. Both give way to the environment (``KCACHE_RETRY_*``,
``KCACHE_CONNECT_TIMEOUT_S``), as every setting does. And its cache's transport says
on stderr, before each wait for a retry, that it is waiting (:func:`announce_retry`,
the transport's ``on_retry`` hook); once one request has gone unanswered, later
requests of the same command try once and give up: the server did not answer a moment
ago, and each further round of retries would only repeat the wait.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kcache.cli_toolkit import include_set_dirs

if TYPE_CHECKING:
    from kcache_client._cache import KernelCache
    from kcache_client._http import RetryNotice
    from kcache_client._settings import ClientSettings

__all__ = [
    "COMMAND_CONNECT_TIMEOUT_S",
    "COMMAND_RETRY",
    "announce_retry",
    "command_cache",
    "command_settings",
]

#: The CLI gives a server this long (retries included) before saying it is unreachable,
#: unless KCACHE_RETRY_* say otherwise (the retry fields a command starts from).
COMMAND_RETRY = {"attempts": 4, "base_s": 0.2, "cap_s": 0.8, "budget_s": 4.0}
#: Connecting should be quick (unless KCACHE_CONNECT_TIMEOUT_S); compiles may still take
#: minutes once connected.
COMMAND_CONNECT_TIMEOUT_S = 2.0


def announce_retry(notice: RetryNotice) -> None:
    """Say on stderr that the command waits for its server, and which try comes next."""
    print(
        f"kcache: waiting for the server at {notice.url} (try {notice.next_try} of {notice.attempts})",
        file=sys.stderr,
        flush=True,
    )


def command_cache(args: argparse.Namespace, url: str | None) -> KernelCache:
    """The ``KernelCache`` a client command runs with: :func:`command_settings`, its retries
    announced on stderr, and one try per request once a request went unanswered."""
    from kcache_client._cache import KernelCache

    return KernelCache(
        settings=command_settings(args, url), on_retry=announce_retry, give_up_after_outage=True
    )


def command_settings(args: argparse.Namespace, url: str | None) -> ClientSettings:
    """The settings a client command runs with: its flags, then the environment, then the
    command's defaults (a short retry budget and connect timeout: a person is waiting)."""
    from kcache_client._settings import (
        DEFAULT_TIMEOUT,
        ClientSettings,
        RetryPolicy,
        timeout_from_env,
    )

    explicit = getattr(args, "cache_dir", None)
    return ClientSettings.from_env(
        url=url,
        token=getattr(args, "token", None),
        cache_dir=explicit,
        auto_target=getattr(args, "auto_target", None),
        local_compile=True if getattr(args, "local_compile", False) else None,
        include_sets=include_set_dirs(args),
        # A person waits at the terminal: a few seconds, unless the environment says otherwise.
        retry=RetryPolicy.from_env(**COMMAND_RETRY) if url else None,
        timeout=timeout_from_env(DEFAULT_TIMEOUT._replace(connect=COMMAND_CONNECT_TIMEOUT_S)),
    )
