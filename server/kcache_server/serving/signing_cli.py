"""``kcache signing-key create|public`` and ``kcache db signing-keys [list|retire]``.

A fleet's replicas sign with one key, read from a secret file (``KCACHE_SIGNING_KEY_FILE``),
and the images that run jobs carry its public half (``KCACHE_TRUSTED_KEYS``, e.g.
``@/etc/kcache/fleet-key.pub``). ``kcache signing-key create FILE`` makes that key (the
private PEM, mode 0600, never replacing a file) and prints the public half in the form
``KCACHE_TRUSTED_KEYS`` takes (base64url of the 32 raw bytes, which ``openssl`` does not
print); ``kcache signing-key public FILE`` prints it for a key that exists (one a server
made at its first start, say). ``--public``/``--out`` write it as a key file the clients
read with ``@FILE``, replacing only such a file (never a private key or anything else).

The keys the servers on a database signed with are recorded there
(:mod:`kcache_server.signing_keys`); ``kcache db signing-keys`` lists them and
``kcache db signing-keys retire KEY_ID`` retires one for good, which is how a lost or
compromised key is replaced (a server with another key refuses to start until then).

Registered by :func:`kcache_server.serving.cli.register`; imports nothing beyond argparse
until a command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["register"]


def _check_public_destination(path: Path, option: str) -> None:
    """Refuse ``path`` for ``option`` when something other than a public key file is there:
    writing it would destroy a private signing key (or a source) without a word."""
    from kcache.cli_toolkit import UsageError
    from kcache.signing import SignatureError, TrustedKeys

    if not (path.exists() or path.is_symlink()):
        return
    try:
        if path.is_file() and not path.is_symlink() and TrustedKeys.parse(f"@{path}"):
            return  # a public key file (this command's own, written again): replaced
    except (OSError, UnicodeError, SignatureError, ValueError):
        pass
    raise UsageError(
        f"{option} {path}: a file is there that is not a public key file (a private signing "
        "key, say): kcache replaces only a public key file it wrote; name a new file"
    )


def _write_public(path: Path, key_id: str, public_key: str) -> None:
    """The public half as a file ``KCACHE_TRUSTED_KEYS=@FILE`` reads (one key a line, # comments)."""
    text = (
        f"# kcache signing key {key_id}: its public half, for KCACHE_TRUSTED_KEYS=@{path.name}\n"
        f"{public_key}\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(text)
    partial.chmod(0o644)  # a public key: readable by every user of an image or host
    os.replace(partial, path)


def _cmd_create(args: argparse.Namespace) -> int:
    from kcache.cli_toolkit import UsageError
    from kcache.signing import SigningKey

    path = Path(args.file)
    if path.exists() or path.is_symlink():
        raise UsageError(
            f"{path} exists: `kcache signing-key create` never replaces a key (servers sign with "
            f"it and clients trust it); print its public half with `kcache signing-key public "
            f"{path}`, or name a new file"
        )
    if args.public:
        _check_public_destination(Path(args.public), "--public")
    key = SigningKey.load_or_create(path)  # mode 0600, written atomically
    if args.public:
        _write_public(Path(args.public), key.key_id, key.public_key)
    print(key.public_key)
    wrote = f" and its public half in {args.public}" if args.public else ""
    print(
        f"kcache: made signing key {key.key_id} in {path} (mode 0600){wrote}. Give the file to "
        "every server replica as KCACHE_SIGNING_KEY_FILE (a secret); the images that run jobs "
        "carry the public half (printed above) as KCACHE_TRUSTED_KEYS",
        file=sys.stderr,
    )
    return 0


def _cmd_public(args: argparse.Namespace) -> int:
    from kcache.cli_toolkit import UsageError
    from kcache.signing import SignatureError
    from kcache_server.signer import load_signing_key

    path = Path(args.file)
    if not path.exists():
        raise UsageError(f"{path} does not exist: name a server's signing key file")
    try:
        key = load_signing_key(path, str(path))
    except SignatureError as exc:
        raise UsageError(str(exc)) from None
    if args.out:
        _check_public_destination(Path(args.out), "--out")
        _write_public(Path(args.out), key.key_id, key.public_key)
        print(f"kcache: wrote the public half of key {key.key_id} to {args.out}", file=sys.stderr)
    print(key.public_key)
    return 0


def _database(args: argparse.Namespace, what: str) -> Any:
    from kcache_server import migrate
    from kcache_server.backends import open_settings_database
    from kcache_server.serving._cli_support import load_settings, require_database

    settings = load_settings(args)
    require_database(settings, args, what)
    db = open_settings_database(settings)
    migrate.check_schema(db, settings.database_url)
    return db


def _cmd_list(args: argparse.Namespace) -> int:
    from kcache_server.signing_keys import recorded_keys
    from kcache_server.terminal import printable

    db = _database(args, "kcache db signing-keys")
    try:
        keys = recorded_keys(db)
    finally:
        db.dispose()
    if args.json:
        print(json.dumps([key.to_dict() for key in keys]))
        return 0
    if not keys:
        print(
            "kcache: no signing key is recorded: a server records its key at its first start",
            file=sys.stderr,
        )
    for key in keys:
        started = (
            f"{key.last_started_at:%Y-%m-%d %H:%M}" if key.last_started_at is not None else "never"
        )
        fields = [
            key.key_id,
            key.state,
            f"recorded {key.recorded_at:%Y-%m-%d %H:%M}",
            f"last started {started}",
        ]
        if key.retired_at is not None:
            why = f" ({printable(key.note)})" if key.note else ""
            fields.append(f"{key.state} {key.retired_at:%Y-%m-%d %H:%M}{why}")
        fields.append(key.public_key)
        print("\t".join(fields))
    return 0


def _cmd_retire(args: argparse.Namespace) -> int:
    from kcache_server.signing_keys import retire

    db = _database(args, "kcache db signing-keys retire")
    try:
        key, changed = retire(db, args.key_id, args.reason)
    finally:
        db.dispose()
    if not changed:
        print(
            f"kcache: signing key {key.key_id} was already retired "
            f"({key.retired_at:%Y-%m-%d %H:%M})"
            if key.retired_at is not None
            else f"kcache: signing key {key.key_id} was already retired",
            file=sys.stderr,
        )
        return 0
    print(f"retired {key.key_id}")
    print(
        f"kcache: no server starts with key {key.key_id} again; servers still running with it sign "
        "until they stop: restart them with the new key (KCACHE_SIGNING_KEY_FILE). Clients that "
        "were given it (KCACHE_TRUSTED_KEYS) or pinned it still accept it: take it out of the "
        "images' key file, and users who pinned it remove the server's entry from their "
        "known_servers.json",
        file=sys.stderr,
    )
    return 0


def _key_id(text: str) -> str:
    """An argparse type: a key id, 16 hex digits."""
    value = text.strip().lower()
    if len(value) != 16 or any(c not in "0123456789abcdef" for c in value):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a key id (16 hex digits, as `kcache db signing-keys` lists them)"
        )
    return value


def _add_db_options(parser: argparse.ArgumentParser, default: Any = None) -> None:
    parser.add_argument(
        "--data-dir",
        default=default,
        help="data directory (default $KCACHE_DATA_DIR or ./.kcache)",
    )
    parser.add_argument(
        "--db-url",
        default=default,
        help="database URL (default $KCACHE_DB_URL or SQLite in the data dir)",
    )


def register(subparsers: Any, db_sub: Any) -> list[argparse.ArgumentParser]:
    """Add ``signing-key`` to the ``kcache`` command and ``signing-keys`` to ``kcache db``;
    the parsers whose commands touch a database (for the caller's error handling)."""
    key = subparsers.add_parser(
        "signing-key",
        help="make a server signing key (a fleet's, shared by its replicas) or print its public half",
        description="A fleet's server replicas share one signing key, given to each as "
        "KCACHE_SIGNING_KEY_FILE (a secret); the images that run jobs carry its public half "
        "as KCACHE_TRUSTED_KEYS (e.g. @/etc/kcache/fleet-key.pub).",
    )
    key_sub = key.add_subparsers(dest="signing_key_command", required=True)
    create = key_sub.add_parser(
        "create",
        help="make a new Ed25519 signing key in FILE (PEM, mode 0600) and print its public half",
    )
    create.add_argument(
        "file", metavar="FILE", help="where to write the private key (never replaced)"
    )
    create.add_argument(
        "--public",
        metavar="PUBFILE",
        help="also write the public half to PUBFILE, the file KCACHE_TRUSTED_KEYS=@PUBFILE reads",
    )
    create.set_defaults(func=_cmd_create)
    public = key_sub.add_parser(
        "public",
        help="print the public half of the signing key in FILE, as KCACHE_TRUSTED_KEYS takes it",
    )
    public.add_argument(
        "file", metavar="FILE", help="a signing key (PEM), e.g. KCACHE_SIGNING_KEY_FILE"
    )
    public.add_argument(
        "--out",
        metavar="PUBFILE",
        help="also write it to PUBFILE, the file KCACHE_TRUSTED_KEYS=@PUBFILE reads",
    )
    public.set_defaults(func=_cmd_public)

    keys = db_sub.add_parser(
        "signing-keys",
        help="list the signing keys recorded in the database; `retire KEY_ID` retires one for good",
        description="The servers on a database record the key they sign with at start-up, and "
        "refuse to start when another key is in use there. List the keys (the default), or "
        "retire one for good (a lost or compromised key): no server starts with it again, and "
        "a server with a new key may start.",
    )
    _add_db_options(keys)
    keys.add_argument("--json", action="store_true", help="print a JSON list, not lines")
    keys.set_defaults(func=_cmd_list)
    keys_sub = keys.add_subparsers(dest="signing_keys_command", required=False, metavar="ACTION")
    listing = keys_sub.add_parser("list", help="list the recorded keys (the default)")
    _add_db_options(listing, argparse.SUPPRESS)
    listing.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    listing.set_defaults(func=_cmd_list)
    retiring = keys_sub.add_parser(
        "retire",
        help="retire KEY_ID for good: no server starts with it again (a lost or compromised key)",
    )
    retiring.add_argument("key_id", metavar="KEY_ID", type=_key_id, help="16 hex digits")
    retiring.add_argument("--reason", help="why, kept with the key (e.g. 'lost with node-3')")
    _add_db_options(retiring, argparse.SUPPRESS)
    retiring.set_defaults(func=_cmd_retire)
    return [keys, listing, retiring]
