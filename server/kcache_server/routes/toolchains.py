"""``GET /v1/toolchains``: what recipes without a toolchain are compiled with, and the targets."""

from __future__ import annotations

from fastapi import APIRouter

from kcache_server.routes._deps import ERRORS, Reader, State
from kcache_server.schemas import ToolchainBody, ToolchainsResponse

router = APIRouter(prefix="/v1/toolchains", tags=["toolchains"])


@router.get("", response_model=ToolchainsResponse, responses=ERRORS)
async def toolchains(_: Reader, state: State) -> ToolchainsResponse:
    """The default toolchain id, every toolchain's targets, and the registered include sets."""
    toolchain = state.backends.toolchain
    return ToolchainsResponse(
        default=toolchain.id,
        toolchains=[ToolchainBody.model_validate(toolchain.describe())],
        include_sets=state.backends.compiler.include_sets.names,
    )
