"""The artifact metadata a fetch by key carries in one HTTP header (design §5), both ways.

``GET /v1/recipes/{key}/artifact`` answers with the bytes as the body and the metadata a
client needs to trust and use them in the header ``X-KCache-Meta``: the base64url
(RFC 4648 §5, no padding) of the compact, sorted JSON of the artifact's metadata
(:meth:`ArtifactMeta.to_dict`), compile ``log`` included (usually empty; the warnings a
caller asked to see, as ``cuda.core``'s ``Program.compile(logs=)``, when there were any).
The server encodes it once per artifact; the client decodes it as untrusted input
(:func:`parse_meta` checks every field, as it does for the metadata in JSON answers) and
then checks the body against it (sha256 and size). The log is not signed (neither is the
metadata route's): it says what the compiler printed, nothing a launch depends on.

A value longer than :data:`MAX_CHARS` (a dependency list of several hundred headers, a
long log) is not sent: the response then has no ``X-KCache-Meta``, and a client reads the
metadata route ``GET /v1/recipes/{key}`` instead, a second round trip for such artifacts
only. (The header once left the log out, so a kernel fetched by key had lost its
warnings: a hit answered ``logs=`` with nothing where a compile answered the warnings.)

The other way, a fetch may say what its client does when it misses:
``X-KCache-On-Miss: resolve`` (:data:`ON_MISS_HEADER`, :data:`ON_MISS_RESOLVE`) says a
``POST /v1/resolve`` of the same recipe follows a 404, and that resolve is the lookup
the caller sees (compiled, waited, or a miss). The server then does not audit the 404
itself, so one lookup is counted once, with its real outcome.

A fetch also says who asks, as a resolve's ``context`` does (client id, host, pid, job
id, rank, world size): ``X-KCache-Context`` (:data:`CONTEXT_HEADER`), the fields
form-encoded (:func:`encode_context`, :func:`decode_context`), so the audit event of a
fetch carries the job and process its resolve would have.

And the answer says how far the withdrawals behind it go: ``X-KCache-Withdrawals-Through``
(:data:`WITHDRAWALS_HEADER`), the newest withdrawal id the answering server process has
acted on. A client whose node has read the withdrawal feed that far counts the answer as a
read of the feed that found nothing new (docs/design.md, "What a binding rests on").
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any

from kcache.artifact import ArtifactMeta
from kcache.deps import Dependency
from kcache.keys import canonical_json, is_hex_key

__all__ = [
    "CONTEXT_FIELDS",
    "CONTEXT_HEADER",
    "HEADER",
    "MAX_CHARS",
    "MAX_CONTEXT_CHARS",
    "ON_MISS_HEADER",
    "ON_MISS_RESOLVE",
    "WITHDRAWALS_HEADER",
    "decode_context",
    "decode_meta",
    "encode_context",
    "encode_meta",
    "encode_withdrawals_through",
    "parse_meta",
    "parse_withdrawals_through",
]

#: The header's name (HTTP header names are case-insensitive).
HEADER = "X-KCache-Meta"
#: A fetch's request header: what its client does after a 404 (see the module docstring).
ON_MISS_HEADER = "X-KCache-On-Miss"
#: :data:`ON_MISS_HEADER`'s value for "a resolve of the same recipe follows".
ON_MISS_RESOLVE = "resolve"
#: A fetch's request header: who asks (a resolve's ``context``), form-encoded.
CONTEXT_HEADER = "X-KCache-Context"
#: A fetch's answer header: the newest withdrawal id its server process has acted on.
WITHDRAWALS_HEADER = "X-KCache-Withdrawals-Through"
#: The context's fields, and which of them are integers.
CONTEXT_FIELDS = ("client_id", "host", "pid", "job_id", "rank", "world_size")
_CONTEXT_INTS = frozenset({"pid", "rank", "world_size"})
#: The longest context value taken (six fields of at most 256 characters, encoded).
MAX_CONTEXT_CHARS = 8 * 1024
#: The longest value sent: well under what HTTP clients accept for all headers together
#: (httpx: 100 KiB), and what a proxy in front must allow (nginx: ``proxy_buffer_size 64k``).
MAX_CHARS = 32 * 1024
_KINDS = frozenset({"cubin", "ptx", "ltoir"})
#: Longest text field (kernel name, target, toolchain id) accepted from a header.
_MAX_TEXT = 4096


def encode_meta(meta: ArtifactMeta) -> str | None:
    """The ``X-KCache-Meta`` value for ``meta``, or None when it would exceed :data:`MAX_CHARS`."""
    value = base64.urlsafe_b64encode(canonical_json(meta.to_dict())).rstrip(b"=").decode("ascii")
    return value if len(value) <= MAX_CHARS else None


def decode_meta(value: str) -> ArtifactMeta:
    """Parse an ``X-KCache-Meta`` value; ValueError naming the field for anything malformed."""
    if len(value) > MAX_CHARS:
        raise ValueError(f"{HEADER} is {len(value)} characters, over the limit of {MAX_CHARS}")
    try:
        data = json.loads(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)))
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{HEADER} is not base64url-encoded JSON: {exc}") from None
    return parse_meta(data, HEADER)


def parse_meta(data: object, where: str = "artifact") -> ArtifactMeta:
    """Artifact metadata from its JSON object (as the API sends it), every field checked.

    For metadata received from elsewhere: ValueError naming ``where`` and the field for
    anything missing or of the wrong type. ``log`` may be absent (an older server's header
    omitted it): then it is empty.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object, not {type(data).__name__}")
    digest = _field(data, "digest", str, where)
    if not is_hex_key(digest):
        raise ValueError(f"{where}: digest must be 64 lowercase hex digits")
    size = _field(data, "size", int, where)
    if size < 0:
        raise ValueError(f"{where}: size must not be negative")
    kind = _field(data, "kind", str, where)
    if kind not in _KINDS:
        raise ValueError(f"{where}: kind {kind!r} is not one of {', '.join(sorted(_KINDS))}")
    names = _field(data, "lowered_names", dict, where)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in names.items()):
        raise ValueError(f"{where}: lowered_names must map strings to strings")
    dependencies = []
    for i, dep in enumerate(_field(data, "dependencies", list, where)):
        if (
            not isinstance(dep, dict)
            or not isinstance(dep.get("name"), str)
            or not is_hex_key(dep.get("sha256"))
        ):
            raise ValueError(f"{where}: dependencies[{i}] must be {{name, sha256}}")
        dependencies.append(Dependency(dep["name"], dep["sha256"]))
    log = data.get("log", "")
    if not isinstance(log, str):
        raise ValueError(f"{where}: log must be a JSON str")
    return ArtifactMeta(
        digest=digest,
        size=size,
        kind=kind,
        target=_text(data, "target", where),
        toolchain=_text(data, "toolchain", where),
        lowered_names=dict(names),
        compile_seconds=_number(data, "compile_seconds", where),
        log=log,
        dependencies=tuple(dependencies),
        dependencies_exact=_field(data, "dependencies_exact", bool, where),
        kernel=_text(data, "kernel", where),
        created_at=_number(data, "created_at", where),
        dependency_check=_optional_int(data, "dependency_check", where),
    )


def _field(data: dict[str, Any], name: str, kind: type[Any], where: str) -> Any:
    value = data.get(name)
    # bool is an int in Python, and JSON's true is not a size.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{where}: {name} must be a JSON {kind.__name__}")
    return value


def _optional_int(data: dict[str, Any], name: str, where: str) -> int:
    """A non-negative integer field that older servers do not send (absent: 0)."""
    if name not in data:
        return 0
    value: int = _field(data, name, int, where)
    if value < 0:
        raise ValueError(f"{where}: {name} must not be negative")
    return value


def _text(data: dict[str, Any], name: str, where: str) -> str:
    value: str = _field(data, name, str, where)
    if len(value) > _MAX_TEXT:
        raise ValueError(f"{where}: {name} is longer than {_MAX_TEXT} characters")
    return value


def _number(data: dict[str, Any], name: str, where: str) -> float:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where}: {name} must be a finite number")
    return float(value)


def encode_context(context: dict[str, Any]) -> str:
    """The :data:`CONTEXT_HEADER` value of a context (its known fields that are set)."""
    from urllib.parse import urlencode

    return urlencode([(k, str(context[k])) for k in CONTEXT_FIELDS if context.get(k) is not None])


def decode_context(value: str | None) -> dict[str, Any]:
    """The fields of a :data:`CONTEXT_HEADER` value, as a resolve's ``context`` would hold
    them (integers as ints); an unknown field, a repeated one, an integer that is not one,
    or a value over :data:`MAX_CONTEXT_CHARS` is dropped (the rest stays), never an error:
    the context labels a lookup, it decides nothing."""
    from urllib.parse import parse_qsl

    if not value or len(value) > MAX_CONTEXT_CHARS:
        return {}
    out: dict[str, Any] = {}
    try:
        pairs = parse_qsl(value, keep_blank_values=False, max_num_fields=len(CONTEXT_FIELDS) * 2)
    except ValueError:
        return {}
    for name, text in pairs:
        if name not in CONTEXT_FIELDS or name in out:
            continue
        if name in _CONTEXT_INTS:
            try:
                out[name] = int(text)
            except ValueError:
                continue
        else:
            out[name] = text
    return out


def encode_withdrawals_through(through: int | None) -> dict[str, str]:
    """The :data:`WITHDRAWALS_HEADER` of an answer right as of withdrawal ``through``; none
    while it is None (the server has not read its withdrawals yet: nothing is claimed)."""
    return {} if through is None else {WITHDRAWALS_HEADER: str(through)}


def parse_withdrawals_through(value: str | None) -> int | None:
    """:data:`WITHDRAWALS_HEADER`'s withdrawal id; None where it is absent or anything but
    a decimal of at most 18 digits (nothing is then claimed, and the feed is read as ever)."""
    if value is None or not (0 < len(value) <= 18 and value.isascii() and value.isdigit()):
        return None
    return int(value)
