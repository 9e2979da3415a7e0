"""kcache-client's dependencies, which name the core (kcache-core) of the client's own release series.

pyproject.toml declares everything else. This is the one field it cannot write down
without repeating the version: ``kcache_client/_version.py`` (a link to the core's
``kcache/_version.py``, the one place the version is written) computes the range.
"""

import runpy
from pathlib import Path

from setuptools import setup

_version = runpy.run_path(str(Path(__file__).parent / "kcache_client" / "_version.py"))

setup(
    install_requires=[
        _version["core_requirement"](),  # the core without NVRTC: the `compile` extra adds it
        # Ranges, never pins: a training image already has its own. Each floor is the
        # oldest release the client's tests were run with (Python 3.10, when it was set).
        "httpx>=0.23",
        "filelock>=3.12",  # thread_local= (the node tier's eviction lock)
        "tqdm>=4.60",
    ],
)
