"""kcache-server's dependencies, which name the core (kcache-core) of the server's own release series.

pyproject.toml declares everything else. This is the one field it cannot write down
without repeating the version: ``kcache_server/_version.py`` (a link to the core's
``kcache/_version.py``, the one place the version is written) computes the range.
"""

import runpy
from pathlib import Path

from setuptools import setup

_version = runpy.run_path(str(Path(__file__).parent / "kcache_server" / "_version.py"))

setup(
    install_requires=[
        _version["core_requirement"]("nvrtc"),  # the server compiles: NVRTC/nvJitLink wheels
        "fastapi>=0.110",
        "uvicorn[standard]>=0.29",
        "sqlalchemy>=2.0",
        "alembic>=1.13",
        "pydantic>=2.6",
        "pydantic-settings>=2.2",
        "prometheus-client>=0.20",
        "anyio>=4",
    ],
)
