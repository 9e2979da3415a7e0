"""What ``KernelCache.get`` returns: verified bytes plus metadata, loadable through cuda.core."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kcache.artifact import ArtifactMeta
from kcache.recipe import Recipe

__all__ = ["Artifact"]


def _cuda_core() -> Any:
    """``cuda.core`` (newer releases) or ``cuda.core.experimental`` (older ones), imported lazily."""
    try:
        import cuda.core as core

        if hasattr(core, "ObjectCode"):
            return core
    except ImportError:
        pass
    try:
        import cuda.core.experimental as experimental
    except ImportError as exc:
        raise ImportError("Artifact.load() needs cuda.core: pip install cuda-core") from exc
    return experimental


@dataclass(frozen=True)
class Artifact:
    """A compiled kernel whose bytes have been checked against ``digest``.

    ``path`` is the blob in the node-local tier (read-only; copy it to modify it),
    ``metadata`` the server's record (target, toolchain, compile log, dependencies),
    ``recipe`` the concrete recipe (``auto`` and the toolchain filled in) it was keyed from.
    """

    recipe_key: str
    base_key: str
    digest: str
    data: bytes = field(repr=False)
    path: Path
    metadata: ArtifactMeta = field(repr=False)
    recipe: Recipe = field(repr=False)

    @property
    def lowered_names(self) -> dict[str, str]:
        """Name expression (``add<float, 256>``) -> mangled symbol, as NVRTC lowered it."""
        return dict(self.metadata.lowered_names)

    @property
    def kind(self) -> str:
        """``cubin``, ``ptx`` or ``ltoir``."""
        return self.metadata.kind

    def load_module(self, device: int | None = None) -> Any:
        """Load into ``device`` (default: the current one, else 0) and return cuda.core's ObjectCode.

        The stored lowered names are passed as the symbol mapping, so
        ``module.get_kernel("add<float, 256>")`` finds the mangled kernel.
        """
        core = _cuda_core()
        dev = core.Device(device) if device is not None else core.Device()
        dev.set_current()
        # cuda.core looks mangled names up as bytes (what NVRTC hands back), keys as given.
        mapping = {expr: mangled.encode() for expr, mangled in self.lowered_names.items()} or None
        name = self.metadata.kernel or self.recipe.name
        if self.kind == "cubin":
            return core.ObjectCode.from_cubin(self.data, name=name, symbol_mapping=mapping)
        if self.kind == "ptx":
            return core.ObjectCode.from_ptx(self.data, name=name, symbol_mapping=mapping)
        raise ValueError(
            f"a {self.kind} artifact cannot be loaded; link it into a cubin first (lto: true)"
        )

    def load(self, name: str | None = None, *, device: int | None = None) -> Any:
        """A launchable ``cuda.core`` Kernel.

        ``name`` is a name expression of the recipe (``add<float, 256>``) or an
        ``extern "C"`` kernel name; by default the recipe's only name expression, else
        the kernel the metadata names. Launch it with ``cuda.core.launch``.
        """
        if name is None:
            if len(self.recipe.name_expressions) > 1:
                raise ValueError(
                    f"the recipe has {len(self.recipe.name_expressions)} kernels; "
                    f"pass one of {list(self.recipe.name_expressions)} to load()"
                )
            name = (
                self.recipe.name_expressions[0]
                if self.recipe.name_expressions
                else self.metadata.kernel
            )
        return self.load_module(device).get_kernel(name)
