"""Per-caller storage quotas: a cap on the bytes of stored artifacts each token caused to be compiled.

:class:`QuotaCompiler` wraps the engine's compiler. Every compile is charged to the
caller it ran for (:data:`~kcache_server.fairness.current_caller`: a token, or a client
address on an open server) in ``compile_charges``; a charge counts while an
artifact row with its digest exists, so eviction (and ``kcache cache rm``) gives the
bytes back. With ``token_quota_bytes`` set:

- a caller whose stored compiles already reach the quota is refused before
  compiling (nothing runs);
- a compile whose output would take the caller past the quota is refused before
  anything is stored (the compile's time is lost, the quota holds exactly).

Both are :class:`~kcache_server.errors.QuotaExceededError` (507 ``quota_exceeded``).
The artifact size limit comes first: output over ``max_artifact_bytes`` is left
for the engine to refuse (422 ``artifact_too_large``) and is never charged. Bytes
that are stored already (another recipe made the same ones) cost nothing more.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from kcache.artifact import CompileOutput
from kcache.compilers import Compiler
from kcache.eviction import format_size
from kcache.include_sets import IncludeSets
from kcache.recipe import Recipe
from kcache.toolchain import Toolchain
from kcache_server.errors import QuotaExceededError
from kcache_server.fairness import current_caller
from kcache_server.models import Artifact, CompileCharge, utcnow

__all__ = ["QuotaCompiler", "stored_bytes_of"]

_charges = cast(sa.Table, CompileCharge.__table__)
_artifacts = cast(sa.Table, Artifact.__table__)


def stored_bytes_of(db: sa.Engine, caller: str) -> int:
    """Bytes of stored artifacts whose compile ``caller`` caused."""
    query = (
        sa.select(sa.func.coalesce(sa.func.sum(_charges.c.size), 0))
        .select_from(_charges.join(_artifacts, _artifacts.c.digest == _charges.c.digest))
        .where(_charges.c.caller == caller)
    )
    with db.connect() as conn:
        return int(conn.execute(query).scalar_one())


class QuotaCompiler:
    """A :class:`~kcache.compilers.Compiler` that charges and limits each caller; see the module docstring."""

    def __init__(
        self,
        inner: Compiler,
        db: sa.Engine,
        *,
        quota_bytes: int | None,
        max_artifact_bytes: int | None,
    ) -> None:
        self.inner = inner
        self.toolchain: Toolchain = inner.toolchain
        self.include_sets: IncludeSets = inner.include_sets
        self.db = db
        self.quota_bytes = quota_bytes or None
        self.max_artifact_bytes = max_artifact_bytes
        self._insert: Any = postgresql.insert if db.dialect.name == "postgresql" else sqlite.insert

    def compile(self, recipe: Recipe, link_inputs: Sequence[bytes] = ()) -> CompileOutput:
        """Refuse a caller over its quota, compile, then charge (or refuse) the output."""
        caller = current_caller.get()
        used = 0
        if caller and self.quota_bytes is not None:
            used = stored_bytes_of(self.db, caller)
            if used >= self.quota_bytes:
                raise QuotaExceededError(self._refusal(caller, used, None))
        output = self.inner.compile(recipe, link_inputs)
        size = len(output.data)
        if not caller or (self.max_artifact_bytes is not None and size > self.max_artifact_bytes):
            return output  # the engine refuses it as too large; never stored, never charged
        digest = hashlib.sha256(output.data).hexdigest()
        if (
            self.quota_bytes is not None
            and used + size > self.quota_bytes
            and not self._stored(digest)
        ):
            raise QuotaExceededError(self._refusal(caller, used, size))
        with self.db.begin() as conn:
            conn.execute(
                self._insert(_charges)
                .values(digest=digest, caller=caller, size=size, created_at=utcnow())
                .on_conflict_do_nothing(index_elements=["digest"])
            )
        return output

    def _stored(self, digest: str) -> bool:
        with self.db.connect() as conn:
            found = conn.execute(
                sa.select(_artifacts.c.digest).where(_artifacts.c.digest == digest)
            ).first()
        return found is not None

    def _refusal(self, caller: str, used: int, size: int | None) -> str:
        quota = format_size(self.quota_bytes or 0)
        who = caller.replace("token:", "token ", 1).replace("client:", "client ", 1)
        if size is None:
            what = f"at its quota of {quota} (token_quota_bytes), so nothing was compiled"
        else:
            what = (
                f"and this compile's {format_size(size)} would take it past its quota of {quota} "
                "(token_quota_bytes), so nothing was stored"
            )
        return (
            f"{who} has {format_size(used)} of artifacts it caused to be compiled in the store, {what}. "
            "They count until they are evicted or removed (kcache cache rm --server); ask an "
            "operator to raise the quota"
        )
