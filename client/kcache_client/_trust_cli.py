"""``kcache trust``: whose signatures this user's client accepts, and replacing a pin.

- ``kcache trust list``: the given keys (``KCACHE_TRUSTED_KEYS``) and every server URL
  pinned in the pin file (``KCACHE_KNOWN_SERVERS``), with its key ids and when it was
  first pinned.
- ``kcache trust forget URL``: drop ``URL``'s pins, after a deliberate key change (a
  ``kcache serve`` restarted with a new data directory on the same port, a server given a
  new key without an endorsement): its next contact pins the key it signs with then. What a
  refusal of the new key tells the user to run.
- ``kcache trust pin [URL]``: contact ``URL`` (default ``--server``/``$KCACHE_URL``) now and
  pin its keys if it has none pinned (``--replace``: forget the old pins first), printing the
  key ids, to compare with what the server's operator publishes.

Only argparse is imported to register; the rest when a command runs.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from kcache.cli_toolkit import UsageError, add_server_arguments, server_url

__all__ = ["register"]


def _settings(args: argparse.Namespace) -> Any:
    from kcache_client._settings import ClientSettings

    return ClientSettings.from_env(url=None)


def _when(at: float | None) -> str:
    if at is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def _cmd_list(args: argparse.Namespace) -> int:
    from kcache.signing import SignatureError, TrustedKeys
    from kcache_client._trust import KnownServers

    settings = _settings(args)
    given: list[str] = []
    problem = None
    if settings.trusted_keys:
        try:
            given = TrustedKeys.parse(settings.trusted_keys).key_ids
        except (SignatureError, OSError) as exc:
            problem = f"KCACHE_TRUSTED_KEYS cannot be read: {exc}"
    known = KnownServers(settings.known_servers)
    pinned = known.entries()
    if args.json:
        body = {
            "given_keys": given,
            "pin_file": str(known.path),
            "servers": [
                {"url": url, "key_ids": ids, "pinned_at": at} for url, (ids, at) in pinned.items()
            ],
        }
        if problem:
            body["problem"] = problem
        print(json.dumps(body, indent=1))
        return 1 if problem else 0
    if problem:
        print(f"given keys: {problem}")
    elif given:
        print(f"given keys (KCACHE_TRUSTED_KEYS, for every server): {', '.join(given)}")
    else:
        print("given keys: none (KCACHE_TRUSTED_KEYS is unset): each server's pinned keys vouch")
    print(f"pinned servers ({known.path}):")
    if not pinned:
        print("  none yet (a server's first contact pins its key)")
    for url, (ids, at) in pinned.items():
        print(f"  {url}  keys {', '.join(ids) or '-'}  pinned {_when(at)}")
    return 1 if problem else 0


def _cmd_forget(args: argparse.Namespace) -> int:
    from kcache_client._trust import KnownServers

    settings = _settings(args)
    known = KnownServers(settings.known_servers)
    url = args.url.strip().rstrip("/")
    if not known.forget(url):
        listed = ", ".join(known.entries()) or "none"
        raise UsageError(f"{url} is not pinned in {known.path} (pinned: {listed})")
    print(
        f"forgot the keys pinned for {url} in {known.path}: its next contact pins the key it "
        "signs with then (check its id against what its operator publishes: kcache trust list)"
    )
    return 0


def _cmd_pin(args: argparse.Namespace) -> int:
    from kcache_client._http import Transport
    from kcache_client._trust import KnownServers, Trust

    url = args.url.strip().rstrip("/") if args.url else server_url(args)
    if not url:
        raise UsageError("no server: pass URL, or --server / $KCACHE_URL")
    settings = _settings(args)
    known = KnownServers(settings.known_servers)
    if args.replace:
        known.forget(url)
    before = known.keys(url)
    transport = Transport(url, args.token or settings.token, retry=settings.retry)
    try:
        trust = Trust.from_settings(None, settings.known_servers, url)
        keys = trust._server_keys(transport.url, lambda: transport.request_json("GET", "/v1/keys"))
    finally:
        transport.close()
    if before is not None:
        print(
            f"{url} was pinned already (keys {', '.join(before.key_ids)} in {known.path}); "
            "nothing changed (--replace forgets them first)"
        )
    else:
        print(f"pinned {url}: keys {', '.join(keys.key_ids)} in {known.path}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``kcache trust`` (list, forget, pin)."""
    trust = subparsers.add_parser(
        "trust",
        help="whose signatures this client accepts: given keys, servers pinned on first contact",
        description="Artifacts are used only when signed by a key trusted for the server they "
        "come through: the given keys (KCACHE_TRUSTED_KEYS, what a fleet's images carry), or "
        "else the keys pinned for the server's URL at its first contact (KCACHE_KNOWN_SERVERS).",
    )
    sub = trust.add_subparsers(dest="trust_command", required=True)
    listing = sub.add_parser("list", help="the given keys and every pinned server URL")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(func=_cmd_list)
    forget = sub.add_parser(
        "forget",
        help="drop a server's pins after a deliberate key change (its next contact pins anew)",
    )
    forget.add_argument("url", metavar="URL", help="the server's URL, as pinned")
    forget.set_defaults(func=_cmd_forget)
    pin = sub.add_parser(
        "pin", help="contact a server now and pin its keys (--replace: forget the old pins first)"
    )
    pin.add_argument("url", nargs="?", metavar="URL", help="default --server / $KCACHE_URL")
    add_server_arguments(pin)
    pin.add_argument("--replace", action="store_true", help="forget the URL's pins first")
    pin.set_defaults(func=_cmd_pin)
