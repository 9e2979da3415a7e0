"""``GET /v1/toolchains``: what recipes without a toolchain are compiled with, and the targets.

A server that cannot compile (:mod:`kcache_server.compiler_presence`) has no default
toolchain to offer or sign: it answers 501 ``cannot_compile`` with the reason (the NVRTC
found, the one needed, the pip command), which a client shows as it is, rather than
a default it cannot build.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from kcache.include_sets import CURRENT_AGE_S
from kcache_server.errors import CannotCompileError
from kcache_server.routes._deps import ERRORS, Reader, State
from kcache_server.schemas import ErrorBody, SignatureBody, ToolchainBody, ToolchainsResponse

router = APIRouter(prefix="/v1/toolchains", tags=["toolchains"])


@router.get("", response_model=ToolchainsResponse, responses={**ERRORS, 501: {"model": ErrorBody}})
async def toolchains(_: Reader, state: State) -> ToolchainsResponse:
    """The default toolchain id, every toolchain's targets, and the registered include sets.

    ``include_set_digests`` is what a client pins a recipe's sets to before keying it
    (``name@<digest>``): the digest of each set's contents now (walked at most ten
    times a second: a client asks once per process and job start), so an edited set
    gives its recipes other keys on every node tier too. ``default_signature`` signs the
    default toolchain as of ``default_issued_at``: clients keep it in their node tier and
    key recipes with it, without asking, while it is young (include set digests are asked
    for every time they are needed: they change with files, not with releases).
    """
    toolchain = state.backends.toolchain
    if not toolchain.compiles:
        raise CannotCompileError(
            toolchain.cannot_compile, "there is no default toolchain to key recipes with:"
        )
    sets = state.backends.compiler.include_sets
    # A walk of each set's tree, off the loop.
    digests = await run_in_threadpool(sets.digests, max_age_s=CURRENT_AGE_S)
    issued_at, signature = state.signer.sign_default_toolchain(toolchain.id)  # about 50 us
    return ToolchainsResponse(
        default=toolchain.id,
        toolchains=[ToolchainBody.model_validate(toolchain.describe())],
        include_sets=sets.names,
        include_set_digests=digests,
        default_issued_at=issued_at,
        default_signature=SignatureBody.model_validate(signature.to_dict()),
    )
