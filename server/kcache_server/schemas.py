"""Request and response bodies of the HTTP API (pydantic models, never ORM rows).

Recipes stay plain JSON objects here: the core's ``Recipe.from_dict`` validates
them, with the same messages the client and the CLI give.

Everything a request carries is bounded here, at the door, to what the database
columns hold (``models.py``) on SQLite and PostgreSQL alike: integers fit a 32-bit
``INTEGER`` and are never booleans, strings have a size and no control characters
or lone surrogates. :func:`load_model` parses a body and turns every refusal into
the server's error naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
)
from pydantic_core import PydanticCustomError

from kcache.errors import InvalidKeyError
from kcache.keys import require_hex_key
from kcache.outcomes import ResolveStatus
from kcache_server.errors import BadRequestError, InvalidRequestError

__all__ = [
    "INT32_MAX",
    "ArtifactBody",
    "BatchError",
    "BatchRequest",
    "BatchResponse",
    "BatchResult",
    "Context",
    "DependencyBody",
    "ErrorBody",
    "HealthBody",
    "Label32",
    "Label128",
    "Label256",
    "Label1024",
    "ReadyBody",
    "ResolveRequest",
    "ResolveResponse",
    "ToolchainBody",
    "ToolchainsResponse",
    "check_key",
    "check_label",
    "invalid_request",
    "load_model",
]

#: The largest value of the ``INTEGER`` columns (pid, rank, world_size) on PostgreSQL.
INT32_MAX = 2**31 - 1

# C0 and C1 control characters (NUL included) and UTF-16 surrogates: none of them
# belongs in a name, and PostgreSQL refuses NUL outright.
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


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
#: Printable strings sized like the ``String(n)`` columns they are stored in.
Label32 = Annotated[str, StringConstraints(max_length=32), _Printable]
Label128 = Annotated[str, StringConstraints(max_length=128), _Printable]
Label256 = Annotated[str, StringConstraints(max_length=256), _Printable]
Label1024 = Annotated[str, StringConstraints(max_length=1024), _Printable]

# Strict: JSON true is not the integer 1, and "3" is not 3.
_Int32 = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]

_RECIPE_DOC = (
    "A recipe (ARCHITECTURE section 3): source, name, headers, flags, target (sm_XX; "
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
    world_size: Annotated[_Int32, Field(ge=1)] | None = None


class ResolveRequest(_Strict):
    """Body of ``POST /v1/resolve``."""

    recipe: dict[str, Any] = Field(description=_RECIPE_DOC, examples=[_RECIPE_EXAMPLE])
    compile: bool = Field(
        default=True, strict=True, description="compile on a miss (needs the compile scope)"
    )
    context: Context = Field(default_factory=Context)


class BatchRequest(_Strict):
    """Body of ``POST /v1/resolve/batch``: many recipes, misses compiled in parallel."""

    recipes: list[dict[str, Any]] = Field(description="recipes, as in /v1/resolve")
    compile: bool = Field(default=True, strict=True)
    context: Context = Field(default_factory=Context)


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


class ResolveResponse(BaseModel):
    """A resolved recipe: how it was found, its keys and its artifact's metadata."""

    status: ResolveStatus
    recipe_key: str
    base_key: str
    artifact: ArtifactBody


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


class HealthBody(BaseModel):
    """Liveness."""

    status: Literal["ok"]


class ReadyBody(BaseModel):
    """Readiness, with each check's result (``ok ...``, ``degraded: ...`` or ``failed: ...``)."""

    status: Literal["ready", "not_ready"]
    checks: dict[str, str]
