"""``GET /v1/keys``: the public keys artifact signatures are made with (:mod:`kcache_server.signer`)."""

from __future__ import annotations

from fastapi import APIRouter

from kcache_server.routes._deps import ERRORS, Reader, State
from kcache_server.schemas import KeysResponse

router = APIRouter(prefix="/v1/keys", tags=["keys"])


@router.get("", response_model=KeysResponse, responses=ERRORS)
async def keys(_: Reader, state: State) -> KeysResponse:
    """The signing key, and after a rotation the key before it, which endorses it.

    A client without configured keys pins what this answers on first contact with a
    URL, and afterwards accepts a new signing key only with an endorsement by a key it
    pinned.
    """
    return KeysResponse.model_validate(state.signer.published())
