"""The lazy package faces: each lists its names once, in ``_LAZY``.

``__all__`` and ``__getattr__`` are made from that dict; the ``TYPE_CHECKING`` imports
restate it for type checkers (which do not run code), so this holds the two equal.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGES = ("kcache", "kcache_client", "kcache_server", "kcache_server.auditing")


def _type_checking_imports(init: Path) -> dict[str, str]:
    """``name -> module`` of the imports under ``if TYPE_CHECKING:`` in ``init``."""
    found: dict[str, str] = {}
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name):
            assert node.test.id == "TYPE_CHECKING"
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module
                for alias in imp.names:
                    assert alias.asname == alias.name, f"{alias.name}: re-exported as itself"
                    found[alias.name] = imp.module
    return found


@pytest.mark.parametrize("name", PACKAGES)
def test_the_type_checking_imports_are_the_lazy_names(name: str) -> None:
    package = importlib.import_module(name)
    assert package.__file__
    assert _type_checking_imports(Path(package.__file__)) == package._LAZY


@pytest.mark.parametrize("name", PACKAGES)
def test_every_exported_name_resolves(name: str) -> None:
    package = importlib.import_module(name)
    assert len(set(package.__all__)) == len(package.__all__)
    assert set(package._LAZY) <= set(package.__all__)
    assert dir(package) == sorted(package.__all__)
    for export in package.__all__:
        assert getattr(package, export) is not None, export
