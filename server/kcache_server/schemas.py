"""Request and response bodies of the HTTP API (pydantic models, never ORM rows).

Recipes stay plain JSON objects here: the core's ``Recipe.from_dict`` validates
them, with the same messages the client and the CLI give.

Everything a request carries is bounded here, at the door, to what the database
columns hold (``models.py``) on SQLite and PostgreSQL alike: integers fit a 32-bit
``INTEGER`` and are never booleans, strings have a size and no control characters
or lone surrogates. :func:`load_model` parses a body and turns every refusal into
the server's error naming the field.

The published schema says the same (``/openapi.json`` is the contract clients are
generated from): every check here that JSON Schema can state is stated, as a
``pattern``, a bound or a strict type, so a request the schema allows is one the
server accepts. A check keeps its own precise message (which field, what was wrong)
and the schema only carries its pattern: :class:`SchemaPattern` adds a pattern to
the published schema without a second check.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Path
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    StringConstraints,
    ValidationError,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError

from kcache.errors import InvalidKeyError
from kcache.keys import HEX_KEY_REGEX, KEY_PREFIX_REGEX, MIN_KEY_PREFIX, require_hex_key
from kcache.outcomes import ResolveStatus
from kcache.recipe import CONTROL_CHARACTERS
from kcache_server.errors import BadRequestError, InvalidRequestError

__all__ = [
    "HEX_KEY_PATTERN",
    "INT32_MAX",
    "INTEGRAL",
    "MAX_BUNDLE_KEYS",
    "PRINTABLE_PATTERN",
    "RECIPE_MARK",
    "SETTING_MARK",
    "ArtifactBody",
    "BatchError",
    "BatchRequest",
    "BatchResponse",
    "BatchResult",
    "BundleRequest",
    "Context",
    "DependencyBody",
    "DigestPath",
    "ErrorBody",
    "ExplainRequest",
    "ExplanationBody",
    "HealthBody",
    "HexKey",
    "JobManifestBody",
    "Label32",
    "Label64",
    "Label128",
    "Label256",
    "Label1024",
    "ManifestKernelBody",
    "ReadyBody",
    "RecipeKeyPath",
    "RecipeKeyPrefixPath",
    "ResolveRequest",
    "ResolveResponse",
    "SchemaPattern",
    "ToolchainBody",
    "ToolchainsResponse",
    "check_key",
    "check_label",
    "invalid_request",
    "load_json_model",
    "load_model",
]

#: The largest value of the ``INTEGER`` columns (pid, rank, world_size) on PostgreSQL.
INT32_MAX = 2**31 - 1

#: What :func:`kcache.keys.require_hex_key` accepts (a recipe key, base key or digest),
#: as the published schema states it: the core's own regex, anchored. ECMA-262 ``$``
#: ends the string (a trailing newline does not match), so the pattern is as
#: full-string as the check's ``fullmatch``.
HEX_KEY_PATTERN = f"^(?:{HEX_KEY_REGEX})$"
#: What :func:`check_label` accepts: no C0 or C1 control character. (A lone
#: surrogate is refused too; JSON Schema patterns cannot name one, nor can JSON
#: text that a schema-driven client sends carry one.)
PRINTABLE_PATTERN = f"^[^{CONTROL_CHARACTERS}]*$"


@dataclass(frozen=True)
class SchemaPattern:
    """Annotation: publish ``pattern`` in the field's JSON schema; the field's own check enforces it.

    Used where a validator already checks exactly what the pattern says and says
    what is wrong more precisely than "does not match" would.
    """

    pattern: str

    def __get_pydantic_json_schema__(
        self, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """The wrapped type's schema with the pattern added."""
        schema = handler(core_schema)
        schema["pattern"] = self.pattern
        return schema


# C0 and C1 control characters (NUL included) and UTF-16 surrogates: none of them
# belongs in a name, and PostgreSQL refuses NUL outright.
_UNPRINTABLE = re.compile(f"[{CONTROL_CHARACTERS}\\ud800-\\udfff]")


def check_label(value: str) -> str:
    """``value`` unless it holds a control character or a lone surrogate."""
    bad = _UNPRINTABLE.search(value)
    if bad is not None:
        kind = (
            "a lone UTF-16 surrogate"
            if "\ud800" <= bad.group() <= "\udfff"
            else "a control character"
        )
        raise PydanticCustomError(
            "unprintable",
            "holds {kind} ({char}) at character {at}; send printable text",
            {"kind": kind, "char": ascii(bad.group()), "at": bad.start()},
        )
    return value


_Printable = AfterValidator(check_label)
_PrintableDoc = SchemaPattern(PRINTABLE_PATTERN)
#: Printable strings sized like the ``String(n)`` columns they are stored in.
Label32 = Annotated[str, StringConstraints(max_length=32), _Printable, _PrintableDoc]
Label64 = Annotated[str, StringConstraints(max_length=64), _Printable, _PrintableDoc]
Label128 = Annotated[str, StringConstraints(max_length=128), _Printable, _PrintableDoc]
Label256 = Annotated[str, StringConstraints(max_length=256), _Printable, _PrintableDoc]
Label1024 = Annotated[str, StringConstraints(max_length=1024), _Printable, _PrintableDoc]


def _hex_key(value: str) -> str:
    try:
        return require_hex_key(value, "key")  # the one check of keys, shared with the core
    except InvalidKeyError as exc:
        raise ValueError(exc.detail) from None  # pydantic names the field


#: A recipe key, base key or digest in a body: 64 lowercase hex digits (checked, and published).
HexKey = Annotated[str, AfterValidator(_hex_key), SchemaPattern(HEX_KEY_PATTERN)]

_KEY_DOC = "64 lowercase hex digits (a sha256); anything else is a 400"
#: A recipe key in a path. The route checks it with :func:`check_key` (a 400 naming
#: it); the published parameter carries the same pattern.
RecipeKeyPath = Annotated[
    str,
    Path(description=f"the recipe key: {_KEY_DOC}", json_schema_extra={"pattern": HEX_KEY_PATTERN}),
]
#: A recipe key or the start of one in a path (what ``kcache cache ls`` and the dashboard
#: print); the route finds the one key it begins, else a 404 or, for several, a 400.
RecipeKeyPrefixPath = Annotated[
    str,
    Path(
        description=f"the recipe key, or the start of one: {MIN_KEY_PREFIX} to 64 lowercase hex "
        "digits (anything else is a 400); a prefix must begin exactly one recipe key the server "
        "knows (none: 404; several: 400 listing them)",
        json_schema_extra={"pattern": f"^(?:{KEY_PREFIX_REGEX})$"},
    ),
]
#: A blob digest in a path, as :data:`RecipeKeyPath`.
DigestPath = Annotated[
    str,
    Path(
        description=f"the sha256 of the bytes: {_KEY_DOC}",
        json_schema_extra={"pattern": HEX_KEY_PATTERN},
    ),
]


def _integral(value: object) -> object:
    # JSON has one number type: 3.0 is the integer 3 to JSON Schema, and to us.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: Annotation for a strict ``int`` (no bool, no string) that takes an integer as JSON
#: means it: 3 or 3.0. It comes after the field's bounds (``Annotated[int, Field(strict=True,
#: ge=...), INTEGRAL]``): before them, pydantic would publish them as ``ge``/``le``.
INTEGRAL = BeforeValidator(_integral)
_Int32 = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX), INTEGRAL]
_Size = Annotated[int, Field(strict=True, ge=1, le=INT32_MAX), INTEGRAL]

#: Marks a schema node whose bounds are settings of this server: ``{keyword: setting}``
#: (``{"maxItems": "max_batch"}``; a dotted name reaches into ``audit``).
#: :mod:`kcache_server.serving.openapi` writes the configured values in its place.
SETTING_MARK = "x-kcache-setting"
#: Marks where the server's recipe schema goes: it names this server's toolchain,
#: targets and include sets, so it is built with the app (:mod:`kcache_server.recipe_schema`).
RECIPE_MARK = "x-kcache-recipe"

_RECIPE_DOC = (
    "A recipe (docs/design.md, section 3): source, name, headers, flags, target (sm_XX; "
    '"auto" must be resolved by the client), output, name_expressions, specialization, '
    "link, lto, toolchain (omitted: the server's default), include_sets."
)
_RECIPE_EXAMPLE = {
    "source": 'extern "C" __global__ void add(float* a, const float* b) { a[threadIdx.x] += b[threadIdx.x]; }',
    "target": "sm_90",
}

M = TypeVar("M", bound=BaseModel)


def invalid_request(errors: Sequence[Any]) -> BadRequestError | InvalidRequestError:
    """The server's error for pydantic's ``errors()`` list: the first problem, its field named."""
    first: dict[str, Any] = (
        dict(errors[0]) if errors else {"type": "invalid", "loc": (), "msg": "invalid request"}
    )
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return BadRequestError(f"the body is not valid JSON: {ctx.get('error', first.get('msg'))}")
    loc = [str(p) for p in tuple(first.get("loc", ())) if p != "body"]
    field = ".".join(loc) or "body"
    message = str(first.get("msg", "invalid"))
    if first.get("type") == "extra_forbidden":
        message = "unknown field"
    elif not loc:
        message = "the body must be a JSON object (sent with Content-Type: application/json)"
    return InvalidRequestError(field, message)


def parse_json(raw: bytes) -> Any:
    """The JSON value of a request body, or a 400 that says what is wrong with it."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise BadRequestError("the body is not valid JSON: it nests too deeply") from None
    except UnicodeDecodeError as exc:
        raise BadRequestError(
            f"the body is not valid JSON: it is not UTF-8 ({exc.reason})"
        ) from None
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits
        raise BadRequestError(f"the body is not valid JSON: {str(exc)[:200]}") from None


def load_model(model: type[M], data: Any) -> M:
    """Validate parsed JSON ``data`` as ``model``, or raise the error naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid_request(exc.errors(include_url=False, include_input=False)) from None


def load_json_model(model: type[M], raw: bytes) -> M:
    """A JSON body validated as ``model`` in one pass, or the error :func:`load_model` gives.

    pydantic's own JSON parser validates the bytes directly, in about half the time of
    ``json.loads`` and :func:`load_model`; it is also stricter in places (a UTF-8 BOM, a
    lone surrogate escape). Whatever it refuses goes the two-step way, which accepts the
    same bodies as before or names their problem as before: one set of accepted bodies
    and one set of messages.
    """
    try:
        return model.model_validate_json(raw)
    except ValidationError:
        return load_model(model, parse_json(raw))


def check_key(value: str, what: str) -> str:
    """``value`` if it is a sha256 hex key (a recipe key or digest in a path), else a 400 naming ``what``."""
    try:
        return require_hex_key(value, what)
    except InvalidKeyError as exc:
        raise BadRequestError(str(exc)) from None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Context(_Strict):
    """Who asks: recorded with every audit event."""

    client_id: Label256 | None = None
    host: Label256 | None = None
    pid: _Int32 | None = None
    job_id: Label256 | None = None
    rank: _Int32 | None = None
    world_size: _Size | None = None


class ResolveRequest(_Strict):
    """Body of ``POST /v1/resolve``."""

    recipe: dict[str, Any] = Field(
        description=_RECIPE_DOC, examples=[_RECIPE_EXAMPLE], json_schema_extra={RECIPE_MARK: True}
    )
    compile: bool = Field(
        default=True, strict=True, description="compile on a miss (needs the compile scope)"
    )
    context: Context = Field(default_factory=Context)


class BatchRequest(_Strict):
    """Body of ``POST /v1/resolve/batch``: many recipes, misses compiled in parallel."""

    recipes: list[dict[str, Any]] = Field(
        description=(
            "recipes, each as in /v1/resolve (the Recipe schema). Each is checked on its own: "
            "a recipe that is wrong is an error result in its place, not a refused batch, so "
            "an item only has to be a JSON object here"
        ),
        json_schema_extra={SETTING_MARK: {"maxItems": "max_batch"}},
    )
    compile: bool = Field(default=True, strict=True)
    context: Context = Field(default_factory=Context)


class ExplainRequest(_Strict):
    """Body of ``POST /v1/explain``: the recipe whose miss is to be explained."""

    recipe: dict[str, Any] = Field(
        description=_RECIPE_DOC, examples=[_RECIPE_EXAMPLE], json_schema_extra={RECIPE_MARK: True}
    )


class ExplanationBody(BaseModel):
    """Whether the server holds the recipe and how; the nearest other recipe of its kernel it
    recorded, and what differs from it."""

    recipe_key: str | None = Field(
        default=None,
        description="the recipe's key (the whole key a prefix in the path stood for)",
    )
    held: Literal["key", "manifest"] | None = Field(
        default=None,
        description="how the server holds the recipe now, so that resolving it is a hit: 'key' "
        "(an artifact under its own key), 'manifest' (a dependency-aware match: an artifact of "
        "the same base key whose recorded headers and include-set files are this recipe's); "
        "null: a resolve would compile it",
    )
    digest: str | None = Field(
        default=None, description="the digest of the artifact held for it; null when not held"
    )
    failure: str | None = Field(
        default=None,
        description="the kind of the failed compile the server remembers for it ('error', "
        "'timeout', 'too_large'): a resolve answers that error without compiling",
    )
    seen_before: bool = Field(
        default=False,
        description="recorded here before but not held now (its artifact was evicted, collected "
        "or set aside since)",
    )
    nearest_key: str | None = Field(
        description="recipe key of the nearest other recorded recipe (same program name and "
        "source, or same base key); null when none is recorded"
    )
    differences: list[str] = Field(
        description="one line per difference, e.g. 'header add.cuh changed (3f2a1b2c.. -> "
        "9c01d4e5..)', 'flag -lineinfo added', 'target sm_80 -> sm_90'; at most 12, then "
        "'... and N more'"
    )
    text: str = Field(
        description="one line: 'held by its exact key: artifact <digest[:16]>', 'held through a "
        "dependency-aware match: ...', a remembered failure, or why a resolve would compile it "
        "('never seen', 'nearest <key[:16]>: <d1>; <d2>', preceded by 'seen before: ...' for a "
        "recipe whose artifact went away)"
    )


class DependencyBody(BaseModel):
    """A header the compile read, with the sha256 of its bytes."""

    name: str
    sha256: str


class ArtifactBody(BaseModel):
    """Artifact metadata."""

    digest: str
    size: int
    kind: str
    target: str
    toolchain: str
    lowered_names: dict[str, str]
    compile_seconds: float
    log: str
    dependencies: list[DependencyBody]
    dependencies_exact: bool
    kernel: str
    created_at: float
    dependency_check: int = Field(
        description="How the dependency list was proven: 1 checked by read markers, from an NVRTC "
        "that had seen no failed compile; 0 recorded by a release that trusted NVRTC's trace alone "
        "(never used for a manifest match)"
    )


class SignatureBody(BaseModel):
    """An Ed25519 signature by the server (of ``recipe_key`` -> the artifact, or of its default
    toolchain; GET /v1/keys has the keys)."""

    key_id: str = Field(description="16 hex digits: the signing key's id")
    signature: str = Field(description="64 bytes, base64url without padding")


class ResolveResponse(BaseModel):
    """A resolved recipe: how it was found, its keys, its artifact's metadata and their signature."""

    status: ResolveStatus
    recipe_key: str
    base_key: str
    artifact: ArtifactBody
    signature: SignatureBody = Field(
        description="covers recipe_key and the artifact's digest, size, kind, target, toolchain, "
        "lowered_names and dependencies (kcache.signing.signed_message); a client checks it "
        "before it uses or stores the artifact"
    )


class PublicKeyBody(BaseModel):
    """A public key the server signs with (or signed with before a rotation)."""

    key_id: str
    public_key: str = Field(description="the 32 raw bytes of the Ed25519 public key, base64url")
    endorsements: list[SignatureBody] = Field(
        description="signatures by earlier keys over this one: a client that pinned one of them "
        "accepts this key too"
    )


class KeysResponse(BaseModel):
    """``GET /v1/keys``: the keys artifact signatures are made with."""

    algorithm: Literal["ed25519"]
    signing_key_id: str = Field(description="the key answers are signed with now")
    keys: list[PublicKeyBody]


class ErrorBody(BaseModel):
    """Every error: a code and a precise sentence, plus what the error carries."""

    error: str
    detail: str
    request_id: str | None = Field(
        default=None, description="on a 500: find the details in the server log"
    )
    field: str | None = None
    log: str | None = None
    recipe_key: str | None = None
    cached: bool | None = None


class BatchError(ErrorBody):
    """A recipe of a batch that failed: ``status`` is ``error``, the rest is its error body."""

    status: Literal["error"]


#: One result of a batch: a resolve body, or the recipe's error (told apart by ``status``).
BatchResult = Annotated[ResolveResponse | BatchError, Field(discriminator="status")]


class BatchResponse(BaseModel):
    """One result per recipe, in order: a resolve body or ``{"status": "error", ...}``."""

    results: list[BatchResult]


class ToolchainBody(BaseModel):
    """A toolchain (``Toolchain.describe()``)."""

    id: str
    nvrtc_version: str
    nvjitlink_version: str
    targets: list[str]


class ToolchainsResponse(BaseModel):
    """Body of ``GET /v1/toolchains``."""

    default: str
    toolchains: list[ToolchainBody]
    include_sets: list[str]
    #: name -> sha256 of the set's contents: what ``name@<digest>`` in a recipe pins.
    include_set_digests: dict[str, str] = {}
    #: When ``default_signature`` was made (the server's clock, epoch seconds).
    default_issued_at: int = Field(
        description="when the server signed its default toolchain (epoch seconds)"
    )
    default_signature: SignatureBody = Field(
        description="the server's signature of its default toolchain as of default_issued_at "
        "(kcache-default-toolchain/v1): a node tier keeps it, and processes that start while it "
        "is young key recipes with it without asking"
    )


class HealthBody(BaseModel):
    """Liveness."""

    status: Literal["ok"]


class ReadyBody(BaseModel):
    """Readiness, with each check's result (``ok ...``, ``degraded: ...`` or ``failed: ...``)."""

    status: Literal["ready", "not_ready"]
    version: str  # kcache's release on this replica (a rollout shows which replicas run which)
    checks: dict[str, str]


class ManifestKernelBody(BaseModel):
    """One kernel of a job manifest: its recipe key and the artifact that served it."""

    recipe_key: str
    digest: str
    kernel: str
    target: str
    toolchain: str
    kind: str = Field(description="the artifact's kind; empty when it is no longer stored")
    size: int = Field(description="the artifact's bytes; 0 when it is no longer stored")


class JobManifestBody(BaseModel):
    """Body of ``GET /v1/jobs/{job_id}/manifest`` (:mod:`kcache.job_manifest`)."""

    format: Literal["kcache-manifest"]
    version: int = Field(description="the manifest format's version (readers refuse others)")
    job_id: str | None
    created_at: float
    digest: str = Field(description="sha256 over the version and each recipe key and digest")
    kernels: list[ManifestKernelBody]


#: Recipe keys one ``POST /v1/bundle`` may name.
MAX_BUNDLE_KEYS = 10_000


class BundleRequest(_Strict):
    """Body of ``POST /v1/bundle``: the recipe keys whose artifacts to stream, and who asks."""

    recipe_keys: list[HexKey] = Field(
        min_length=1, max_length=MAX_BUNDLE_KEYS, description="recipe keys (a manifest's)"
    )
    context: Context = Field(default_factory=Context)
