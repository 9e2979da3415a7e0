"""Request and response bodies of the HTTP API (pydantic models, never ORM rows).

Recipes stay plain JSON objects here: the core's ``Recipe.from_dict`` validates
them, with the same messages the client and the CLI give.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ArtifactBody",
    "BatchRequest",
    "BatchResponse",
    "Context",
    "DependencyBody",
    "ErrorBody",
    "HealthBody",
    "ReadyBody",
    "ResolveRequest",
    "ResolveResponse",
    "ToolchainBody",
    "ToolchainsResponse",
]

_RECIPE_DOC = (
    "A recipe (ARCHITECTURE section 3): source, name, headers, flags, target (sm_XX; "
    '"auto" must be resolved by the client), output, name_expressions, specialization, '
    "link, lto, toolchain (omitted: the server's default), include_sets."
)
_RECIPE_EXAMPLE = {
    "source": 'extern "C" __global__ void add(float* a, const float* b) { a[threadIdx.x] += b[threadIdx.x]; }',
    "target": "sm_90",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Context(_Strict):
    """Who asks: recorded with every audit event."""

    client_id: str | None = Field(default=None, max_length=256)
    host: str | None = Field(default=None, max_length=256)
    pid: int | None = Field(default=None, ge=0)
    job_id: str | None = Field(default=None, max_length=256)
    rank: int | None = Field(default=None, ge=0)
    world_size: int | None = Field(default=None, ge=1)


class ResolveRequest(_Strict):
    """Body of ``POST /v1/resolve``."""

    recipe: dict[str, Any] = Field(description=_RECIPE_DOC, examples=[_RECIPE_EXAMPLE])
    compile: bool = Field(default=True, description="compile on a miss (needs the compile scope)")
    context: Context = Field(default_factory=Context)


class BatchRequest(_Strict):
    """Body of ``POST /v1/resolve/batch``: many recipes, misses compiled in parallel."""

    recipes: list[dict[str, Any]] = Field(description="recipes, as in /v1/resolve")
    compile: bool = True
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

    status: Literal["hit", "compiled", "waited"]
    recipe_key: str
    base_key: str
    artifact: ArtifactBody


class ErrorBody(BaseModel):
    """Every error: a code and a precise sentence, plus what the error carries."""

    error: str
    detail: str
    field: str | None = None
    log: str | None = None
    recipe_key: str | None = None
    cached: bool | None = None


class BatchResponse(BaseModel):
    """One result per recipe, in order: a resolve body or ``{"status": "error", ...}``."""

    results: list[dict[str, Any]]


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

    status: str


class ReadyBody(BaseModel):
    """Readiness, with each check's result."""

    status: str
    checks: dict[str, str]
