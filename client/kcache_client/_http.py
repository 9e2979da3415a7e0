"""HTTP to the kcache server: auth, bounded retries with backoff and jitter, error mapping.

Retries cover what a retry can fix: connection failures (refused, reset, timed
out) and the server saying it is overloaded (429/503/502/504), where its
``Retry-After`` is honoured. Every other error status is mapped once, here, to a
typed error from :mod:`kcache_client.errors`. Resolve requests are safe to repeat:
identical concurrent resolves join one compile on the server.
"""

from __future__ import annotations

import email.utils
import threading
import time
from typing import Any

import httpx

from kcache_client._settings import DEFAULT_TIMEOUT, RetryPolicy
from kcache_client.errors import (
    AuthenticationError,
    ClientError,
    RecipeRefusedError,
    RemoteCompileError,
    RemoteNotFoundError,
    RequestRejectedError,
    ServerBusyError,
    ServerResponseError,
    ServerUnavailableError,
)

__all__ = ["Transport", "batch_item_error", "parse_retry_after"]

_BUSY = frozenset({429, 502, 503, 504})


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` as seconds: a number, or an HTTP date; None if absent or garbled."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class Transport:
    """One server: a pooled ``httpx.Client`` plus the retry and error policy.

    ``client``, when given, is used as it is (its timeouts, limits, proxies, event hooks
    and transport apply) and never closed here; kcache adds its ``Authorization`` and
    ``User-Agent`` headers to each request and sends absolute URLs. Otherwise the
    transport opens its own client with ``timeout`` and closes it in :meth:`close`.
    ``requests`` counts the HTTP requests sent (retries included), for diagnostics.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        retry: RetryPolicy | None = None,
        timeout: httpx.Timeout | None = None,
        client: httpx.Client | None = None,
        user_agent: str = "kcache-client",
    ) -> None:
        self.url = url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self._headers = {"User-Agent": user_agent}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._owned = client is None
        self._client = client or httpx.Client(timeout=timeout or DEFAULT_TIMEOUT)
        self._count_lock = threading.Lock()
        self.requests = 0

    def close(self) -> None:
        """Close the connection pool (not an injected client: its owner closes it)."""
        if self._owned:
            self._client.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        ok: tuple[int, ...] = (200,),
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """Send with retries; return a response whose status is in ``ok``, or raise a typed error."""
        policy = retry or self.retry
        deadline = time.monotonic() + policy.budget_s
        last_status = 0
        last_retry_after: float | None = None
        cause = ""
        for attempt in range(policy.attempts):
            with self._count_lock:
                self.requests += 1
            try:
                response = self._client.request(
                    method,
                    self.url + path,
                    json=json,
                    headers=self._headers,
                    timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
                )
            except httpx.TransportError as exc:
                # Connection refused/reset, DNS, timeouts, a server that died mid-reply.
                cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                wait = policy.backoff(attempt)
                last_status = 0
            else:
                if response.status_code in ok:
                    return response
                if response.status_code not in _BUSY:
                    raise self._error(response)
                last_status = response.status_code
                last_retry_after = parse_retry_after(response.headers.get("Retry-After"))
                wait = (
                    min(last_retry_after, policy.max_retry_after_s)
                    if last_retry_after is not None
                    else policy.backoff(attempt)
                )
                response.close()
            if attempt + 1 >= policy.attempts or time.monotonic() + wait > deadline:
                break
            time.sleep(wait)
        if last_status:
            raise ServerBusyError(self.url, last_status, last_retry_after)
        raise ServerUnavailableError(self.url, cause or "no response")

    def _error(self, response: httpx.Response) -> ServerResponseError | RemoteCompileError:
        """Map an error status and its JSON body ``{"error", "detail", ...}`` to a typed error."""
        url = str(response.request.url)
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            body = {"error": "http_error", "detail": response.text[:500]}
        code = str(body.get("error", "http_error"))
        detail = body.get("detail", "")
        detail = detail if isinstance(detail, str) else str(detail)
        status = response.status_code
        if code == "compile_error":
            return RemoteCompileError(
                body.get("recipe_key"), str(body.get("log") or ""), detail=detail
            )
        if status in (401, 403):
            return AuthenticationError(
                url, status, code, detail or "set KCACHE_TOKEN to a valid token"
            )
        if status == 404:
            return RemoteNotFoundError(url, status, code, detail)
        if status in (400, 413, 422):
            return RequestRejectedError(url, status, code, detail)
        return ServerResponseError(url, status, code, detail)


def batch_item_error(url: str, item: dict[str, Any], recipe_key: str) -> ClientError:
    """The typed error of one failed recipe of ``POST /v1/resolve/batch``.

    ``item`` is its result ``{"status": "error", "error", "detail", "log"?, "recipe_key"?}``:
    a compile error is a RemoteCompileError, a miss without compile a RemoteNotFoundError,
    anything else a RecipeRefusedError carrying the server's code.
    """
    code = str(item.get("error") or "error")
    detail = str(item.get("detail") or "")
    log = str(item.get("log") or "")
    if code == "compile_error":
        return RemoteCompileError(str(item.get("recipe_key") or recipe_key), log, detail=detail)
    if code == "not_found":
        return RemoteNotFoundError(url, 404, code, detail)
    return RecipeRefusedError(url, code, detail, recipe_key=recipe_key, log=log)
