"""Package attributes imported on first use, so importing a package stays cheap.

``kcache_client`` and ``kcache_server`` export names whose modules pull in httpx,
FastAPI or SQLAlchemy; ``kcache --help`` must not pay for those. A package lists
``name -> module`` and installs the two module-level hooks this returns.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, lazy: Mapping[str, str], namespace: MutableMapping[str, Any], names: Sequence[str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: each name in ``lazy`` is imported from its
    module on first access and kept in ``namespace`` (the package's globals), so the hook
    runs once per name; ``__dir__`` lists ``names`` (the package's ``__all__``)."""

    def getattr_(name: str) -> object:
        module = lazy.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(names)

    return getattr_, dir_
