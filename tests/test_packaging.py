"""The three distributions as users get them: an sdist and a wheel each, of the one version.

``python -m build`` builds each distribution's sdist and then its wheel from that sdist,
in a copy of the sources (without build isolation: setuptools comes from this
environment), so the ``build/`` directories that editable installs leave behind cannot
leak stale modules into a wheel, and a file an sdist forgot breaks its wheel here. The
tests read the archives and their metadata, run ``twine check --strict``, and run the
server's migrations from an installed (``pip install --target``) copy, not the checkout.

Then the README's install lines run as written, in a copy of the sources: its ``pip wheel``
line builds ``dist``, its ``pip install --find-links dist ...`` lines make fresh virtual
environments, one of them a GPU image with torch 2.11's pinned CUDA wheels (NVRTC and
nvJitLink 13.0.88) from the package index, and its clone line installs all three from the
sources. Those environments serve, compile and fetch with their installed ``kcache``
commands; beside torch's older nvJitLink, plain recipes compile and LTO ones are refused by
name, locally and by the server.
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from dataclasses import dataclass
from email.message import Message
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from kcache._version import __version__ as VERSION
from kcache.toolchain import nvrtc_install_advice
from tests.support import copy_sources

ROOT = Path(__file__).resolve().parents[1]
# distribution -> (its directory, its package's directory), relative to the repository
DISTRIBUTIONS = {
    "kcache-core": (".", "kcache"),
    "kcache-client": ("client", "client/kcache_client"),
    "kcache-server": ("server", "server/kcache_server"),
}
# What users already have in a training image: never pinned, always a lower bound.
USER_SIDE = re.compile(r"torch|httpx|filelock|cryptography|tqdm|numpy|cupy.*|cuda-.*|nvidia-.*")
SERVER_ONLY = re.compile(r"fastapi|uvicorn|sqlalchemy|alembic|pydantic.*|prometheus-client|psycopg")


@dataclass(frozen=True)
class Built:
    """One distribution's sdist and wheel, and the wheel's METADATA."""

    sdist: Path
    wheel: Path
    metadata: Message

    @property
    def requirements(self) -> list[Requirement]:
        return [Requirement(text) for text in self.metadata.get_all("Requires-Dist") or []]

    def base_requirements(self) -> dict[str, Requirement]:
        """The requirements every install gets (no ``extra ==`` marker)."""
        return {r.name: r for r in self.requirements if r.marker is None}

    def extra(self, name: str) -> dict[str, Requirement]:
        """The requirements the extra ``name`` adds."""
        return {
            r.name: r
            for r in self.requirements
            if r.marker is not None and r.marker.evaluate({"extra": name})
        }

    def wheel_files(self) -> set[str]:
        with zipfile.ZipFile(self.wheel) as archive:
            return set(archive.namelist())


@dataclass(frozen=True)
class Build:
    """The copy of the sources that was built, and what came of it."""

    sources: Path
    dists: dict[str, Built]


def _walk(root: Path) -> list[Path]:
    """Every file under ``root``, linked directories followed (the server's migrations/ is one)."""
    return [Path(d) / f for d, _, files in os.walk(root, followlinks=True) for f in files]


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    sources = tmp_path_factory.mktemp("sources")
    copy_sources(sources)
    out = tmp_path_factory.mktemp("dist")
    dists = {}
    for project, (where, _) in DISTRIBUTIONS.items():
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "build",
                "--no-isolation",
                "--outdir",
                str(out / project),
                str(sources / where),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        assert run.returncode == 0, f"building {project}:\n{run.stdout}\n{run.stderr}"
        (sdist,) = (out / project).glob("*.tar.gz")
        (wheel,) = (out / project).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            (meta,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            metadata = email.parser.Parser().parsestr(archive.read(meta).decode())
        dists[project] = Built(sdist, wheel, metadata)
    return Build(sources, dists)


@pytest.fixture(scope="module")
def built(build: Build) -> dict[str, Built]:
    return build.dists


def test_each_distribution_is_an_sdist_and_a_wheel_of_the_one_version(
    built: dict[str, Built],
) -> None:
    for project, dist in built.items():
        stem = project.replace("-", "_")
        assert dist.wheel.name == f"{stem}-{VERSION}-py3-none-any.whl"
        assert dist.sdist.name == f"{stem}-{VERSION}.tar.gz"
        assert (dist.metadata["Name"], dist.metadata["Version"]) == (project, VERSION)
        with tarfile.open(dist.sdist) as archive:
            pkg_info = archive.extractfile(f"{stem}-{VERSION}/PKG-INFO")
            assert pkg_info is not None
            assert f"\nVersion: {VERSION}\n" in pkg_info.read().decode()


def test_metadata_is_complete_and_twine_check_passes(built: dict[str, Built]) -> None:
    for project, dist in built.items():
        meta = dist.metadata
        assert meta["License-Expression"] == "Apache-2.0", project
        assert meta.get_all("License-File") == ["LICENSE"], project
        assert meta["Requires-Python"] == ">=3.10", project
        assert meta["Description-Content-Type"] == "text/markdown", project
        assert project in meta.get_payload(), project  # the README is the long description
        classifiers = meta.get_all("Classifier") or []
        assert (
            "Typing :: Typed" in classifiers and "Operating System :: POSIX :: Linux" in classifiers
        )
    files = [str(p) for d in built.values() for p in (d.sdist, d.wheel)]
    run = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *files],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("PASSED") == len(files), run.stdout


def test_client_and_server_need_the_core_of_their_own_release_series(
    built: dict[str, Built],
) -> None:
    this = Version(VERSION)
    same_series = f"{this.major}.{this.minor}.{this.micro + 7}"
    next_series = f"{this.major}.{this.minor + 1}.0"
    older = f"{this.major}.{this.minor}.0.dev0"
    for project, extras in (("kcache-client", set()), ("kcache-server", {"nvrtc"})):
        core = built[project].base_requirements()["kcache-core"]
        assert core.extras == extras, project
        assert core.specifier.contains(VERSION), (project, core)
        assert core.specifier.contains(same_series), (project, core)
        assert not core.specifier.contains(next_series, prereleases=True), (project, core)
        assert not core.specifier.contains(older, prereleases=True), (project, core)


def test_dependencies_are_ranges_never_pins(built: dict[str, Built]) -> None:
    pinned = []
    unbounded = []
    for project, dist in built.items():
        for req in dist.requirements:
            if any(spec.operator in ("==", "===") for spec in req.specifier):
                pinned.append(f"{project}: {req}")
            if USER_SIDE.fullmatch(req.name) and not any(
                spec.operator == ">=" for spec in req.specifier
            ):
                unbounded.append(f"{project}: {req}")
    assert pinned == []
    assert unbounded == []  # a lower bound says which releases were tested


def test_the_client_brings_no_torch_nvrtc_or_server_packages_unless_asked(
    built: dict[str, Built],
) -> None:
    client = built["kcache-client"]
    assert set(client.base_requirements()) == {"kcache-core", "httpx", "filelock", "tqdm"}
    assert {"torch", "gpu", "compile"} <= set(client.metadata.get_all("Provides-Extra") or [])
    assert set(client.extra("torch")) == {"torch"}
    assert set(client.extra("gpu")) == {"cuda-bindings", "cuda-core"}
    compile_extra = client.extra("compile")["kcache-core"]
    assert compile_extra.extras == {"nvrtc"}
    for req in client.requirements:
        assert not SERVER_ONLY.fullmatch(req.name), req
        if req.name == "torch" or req.name.startswith(("cuda-", "nvidia-")):
            assert req.marker is not None and "extra" in str(req.marker), req

    core = built["kcache-core"]
    assert set(core.base_requirements()) == {"filelock", "cryptography"}
    nvrtc = core.extra("nvrtc")
    assert set(nvrtc) == {
        "cuda-bindings",
        "cuda-pathfinder",
        "nvidia-cuda-nvrtc",
        "nvidia-nvjitlink",
    }
    for name in ("cuda-bindings", "nvidia-cuda-nvrtc"):
        # Bundled headers (nvrtcInstallBundledHeaders) start at 13.3; CUDA 13 only.
        assert not nvrtc[name].specifier.contains("13.2.99"), nvrtc[name]
        assert nvrtc[name].specifier.contains("13.3"), nvrtc[name]
        assert not nvrtc[name].specifier.contains("14.0"), nvrtc[name]
    # nvJitLink: any CUDA 13, so torch 2.11's pinned 13.0.88 stays (only LTO needs a newer one).
    assert nvrtc["nvidia-nvjitlink"].specifier.contains("13.0.88"), nvrtc["nvidia-nvjitlink"]
    assert not nvrtc["nvidia-nvjitlink"].specifier.contains("14.0"), nvrtc["nvidia-nvjitlink"]


def test_the_old_nvrtc_advice_names_the_extra_that_installs_it(built: dict[str, Built]) -> None:
    found = re.fullmatch(r"pip install '([^']+)'", nvrtc_install_advice())
    assert found is not None, nvrtc_install_advice()
    advised = Requirement(found.group(1))
    assert (advised.name, advised.extras) == ("kcache-core", {"nvrtc"})
    assert advised.specifier.contains(VERSION) and len(list(advised.specifier)) == 1
    assert "nvrtc" in (built["kcache-core"].metadata.get_all("Provides-Extra") or [])


def test_wheels_hold_every_module_and_data_file(build: Build) -> None:
    for project, (_, package) in DISTRIBUTIONS.items():
        source = build.sources / package
        prefix = source.name
        wheel = build.dists[project].wheel_files()
        expected_py = {
            f"{prefix}/{p.relative_to(source).as_posix()}"
            for p in _walk(source)
            if p.suffix == ".py" and "__pycache__" not in p.parts
        }
        assert {n for n in wheel if n.endswith(".py")} == expected_py, project
        assert f"{prefix}/py.typed" in wheel, project
        stem = project.replace("-", "_")
        with zipfile.ZipFile(build.dists[project].wheel) as archive:
            licence = archive.read(f"{stem}-{VERSION}.dist-info/licenses/LICENSE")
        assert licence == (ROOT / "LICENSE").read_bytes(), project
    server_source = build.sources / "server/kcache_server"
    data = {
        f"kcache_server/{p.relative_to(server_source).as_posix()}"
        for p in [
            *_walk(server_source / "static"),
            *_walk(server_source / "migrations"),
        ]
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert "kcache_server/migrations/script.py.mako" in data
    assert "kcache_server/static/dashboard/index.html" in data
    assert data <= build.dists["kcache-server"].wheel_files()


def test_sdists_carry_the_license_and_the_version_as_files_not_links(
    built: dict[str, Built],
) -> None:
    for project, dist in built.items():
        base = f"{project.replace('-', '_')}-{VERSION}"
        with tarfile.open(dist.sdist) as archive:
            members = {m.name: m for m in archive.getmembers()}
            assert members[f"{base}/LICENSE"].isfile(), project
            licence = archive.extractfile(f"{base}/LICENSE")
            assert licence is not None and licence.read() == (ROOT / "LICENSE").read_bytes()
            if project != "kcache-core":
                package = DISTRIBUTIONS[project][1].split("/")[-1]
                version_file = members[f"{base}/{package}/_version.py"]
                assert version_file.isfile(), project
                copied = archive.extractfile(version_file)
                assert copied is not None
                assert copied.read() == (ROOT / "kcache/_version.py").read_bytes()
        assert not any(name.startswith(f"{base}/tests/") for name in members), project


INSTALLED_MIGRATION = """
import json, sys
import sqlalchemy as sa
import kcache, kcache_client, kcache_server, kcache_server.migrate as migrate
url = sys.argv[1]
migrate.upgrade(url)
engine = sa.create_engine(url)
print(json.dumps({
    "modules": [kcache.__file__, kcache_client.__file__, kcache_server.__file__],
    "migrations": str(migrate.migrations_dir()),
    "current": sorted(migrate.current_revisions(engine)),
    "head": sorted(migrate.head_revisions(url)),
    "tables": sorted(sa.inspect(engine).get_table_names()),
}))
"""


@pytest.fixture(scope="module")
def installed(built: dict[str, Built], tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("installed")
    wheels = [str(d.wheel) for d in built.values()]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--target",
            str(target),
            *wheels,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return target


def test_an_installed_server_runs_its_migrations_from_the_package(
    installed: Path, tmp_path: Path
) -> None:
    # -S: no site processing, so the checkout's editable installs (.pth finders) stay out;
    # the third-party dependencies come from this environment's site-packages, after
    # the installed copy.
    site = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    env = {k: v for k, v in os.environ.items() if k != "KCACHE_MIGRATIONS_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(installed), *sorted(site)])
    url = f"sqlite:///{tmp_path / 'kcache.db'}"
    run = subprocess.run(
        [sys.executable, "-S", "-c", INSTALLED_MIGRATION, url],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        check=False,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    for module in result["modules"]:
        assert Path(module).is_relative_to(installed), module
    assert Path(result["migrations"]) == installed / "kcache_server" / "migrations"
    assert result["current"] == result["head"] and result["head"], result
    assert {"alembic_version", "artifacts", "audit_events"} <= set(result["tables"])


# ------------------------------------------------------------------ the README's install lines
README = ROOT / "README.md"
# What torch 2.11's CUDA 13 wheel asks for (its METADATA), and so what a GPU image with it
# has: NVRTC and nvJitLink 13.0.88, older than the 13.3 that compiling needs.
TORCH_CUDA_PIN = "cuda-toolkit[nvrtc,nvjitlink]==13.0.2"
PINNED_NVJITLINK = "13.0.88"
# The README's wheel lines, by (distribution, extras); `[torch]` is checked, not run (below).
WHEEL_LINES = {
    ("kcache-client", frozenset()),
    ("kcache-client", frozenset({"gpu"})),
    ("kcache-client", frozenset({"torch"})),
    ("kcache-client", frozenset({"compile"})),
    ("kcache-server", frozenset({"postgres"})),
}


def _readme_install_blocks() -> tuple[list[list[str]], list[list[str]]]:
    """The README's install commands: ``## Install``'s two console blocks (a clone's, then wheels').

    Each command is its words, the comment after it left out.
    """
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```console\n(.*?)^```$", section, re.M | re.S)
    assert len(blocks) == 2, "## Install has a clone's block, then the wheels' block"
    clone, wheels = (
        [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]
        for block in blocks
    )
    return clone, wheels


def _user_env() -> dict[str, str]:
    """Only what a user's shell would have: no PYTHONPATH into the checkout, no KCACHE_*."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("KCACHE_", "PYTHON"))}


def _pip(python: Path, words: list[str], *, cwd: Path) -> None:
    """Run a README ``pip ...`` line as written, with ``python``'s pip, in ``cwd``."""
    assert words[0] == "pip", words
    run = subprocess.run(
        [str(python), "-m", "pip", *words[1:]],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_user_env(),
        check=False,
    )
    assert run.returncode == 0, f"{shlex.join(words)}:\n{run.stdout}\n{run.stderr}"


def _new_venv(where: Path) -> Path:
    """A fresh virtual environment; its bin directory."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    return where / "bin"


@dataclass(frozen=True)
class Installs:
    """Virtual environments made by the README's install lines (their bin directories).

    - ``image``: a GPU image with torch's pinned CUDA wheels (``TORCH_CUDA_PIN``, without
      torch itself), then the README's ``kcache-server[postgres]``, ``kcache-client[compile]``
      and ``kcache-client[gpu]`` lines;
    - ``client``: the README's ``kcache-client`` line alone;
    - ``clone``: the README's first clone line (all three, built from the sources).
    """

    sources: Path
    image: Path
    client: Path
    clone: Path


@pytest.fixture(scope="module")
def installs(tmp_path_factory: pytest.TempPathFactory) -> Installs:
    """The README's lines run as written in a copy of a clone: its ``pip wheel`` line builds
    ``dist`` (with build isolation, as a user's pip does); the wheels' requirements come from
    the package index (pip's cache makes a second run quick).

    Not run: the ``[torch]`` line, which would download a CUDA torch of several GiB (its
    metadata is checked above: it adds torch and nothing else), and the second clone line,
    a part of the first (the core from ``./`` and the client from ``./client``)."""
    clone_lines, wheel_lines = _readme_install_blocks()
    sources = tmp_path_factory.mktemp("clone")
    copy_sources(sources)
    build_line, *install_lines = wheel_lines
    assert build_line[:2] == ["pip", "wheel"] and "dist" in build_line, build_line
    _pip(Path(sys.executable), build_line, cwd=sources)
    built = {w.name.split("-")[0] for w in (sources / "dist").glob("*.whl")}
    assert built == {"kcache_core", "kcache_client", "kcache_server"}, built
    by_extras: dict[tuple[str, frozenset[str]], list[str]] = {}
    for words in install_lines:
        assert words[:-1] == ["pip", "install", "--find-links", "dist"], words
        req = Requirement(words[-1])
        by_extras[(req.name, frozenset(req.extras))] = words
    assert set(by_extras) == WHEEL_LINES

    root = tmp_path_factory.mktemp("venvs")
    image = _new_venv(root / "image")
    _pip(image / "python", ["pip", "install", TORCH_CUDA_PIN], cwd=sources)
    for key in (
        ("kcache-server", frozenset({"postgres"})),
        ("kcache-client", frozenset({"compile"})),
        ("kcache-client", frozenset({"gpu"})),
    ):
        _pip(image / "python", by_extras[key], cwd=sources)
    client = _new_venv(root / "client")
    _pip(client / "python", by_extras[("kcache-client", frozenset())], cwd=sources)

    all_three, client_only = clone_lines
    assert all_three == ["pip", "install", "./", "./client", "./server"], all_three
    assert client_only[:2] == ["pip", "install"] and set(client_only[2:]) < set(all_three[2:])
    clone = _new_venv(root / "clone")
    _pip(clone / "python", all_three, cwd=sources)
    return Installs(sources, image, client, clone)


def _kcache(bin_dir: Path, *args: str, env: dict[str, str], cwd: Path) -> str:
    """Run the installed ``kcache`` command; what it printed."""
    run = _kcache_run(bin_dir, *args, env=env, cwd=cwd)
    assert run.returncode == 0, f"kcache {' '.join(args)}:\n{run.stdout}\n{run.stderr}"
    return run.stdout


def _kcache_run(
    bin_dir: Path, *args: str, env: dict[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(bin_dir / "kcache"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        check=False,
        timeout=300,
    )


def _json_line(text: str) -> dict[str, object]:
    line: dict[str, object] = json.loads(text.strip().splitlines()[-1])
    return line


def _python(bin_dir: Path, code: str) -> str:
    run = subprocess.run(
        [str(bin_dir / "python"), "-c", code],
        capture_output=True,
        text=True,
        env=_user_env(),
        cwd=bin_dir.parent,  # not a checkout: `-c` puts the working directory on sys.path
        check=False,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


DIST_VERSIONS = """
import importlib.metadata as m, json
names = ("kcache-core", "kcache-client", "kcache-server", "cuda-toolkit", "nvidia-cuda-nvrtc",
         "nvidia-nvjitlink", "cuda-bindings", "cuda-core")
found = {}
for name in names:
    try:
        found[name] = m.version(name)
    except m.PackageNotFoundError:
        pass
print(json.dumps(found))
"""

ADD = (
    'extern "C" __global__ void add(float* o, const float* a, int n) {\n'
    "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
    "  if (i < n) o[i] += a[i];\n}\n"
)


def _lto_recipe(where: Path) -> Path:
    """A recipe linked by nvJitLink (``lto: true``), as a recipe file."""
    path = where / "lto.json"
    path.write_text(json.dumps({"source": ADD, "target": "sm_90", "lto": True}))
    return path


def test_an_image_with_torchs_cuda_pins_keeps_its_nvjitlink(installs: Installs) -> None:
    """``[compile]`` upgrades NVRTC (13.3 at least: bundled headers) and keeps the image's
    nvJitLink, so torch's own pin on it still holds."""
    versions = json.loads(_python(installs.image, DIST_VERSIONS))
    assert versions["cuda-toolkit"] == "13.0.2", versions  # the image's pins, untouched
    assert versions["nvidia-nvjitlink"] == PINNED_NVJITLINK, versions
    assert Version(versions["nvidia-cuda-nvrtc"]) >= Version("13.3"), versions
    assert Version(versions["cuda-bindings"]) >= Version("13.3"), versions
    assert {"kcache-core", "kcache-client", "kcache-server", "cuda-core"} <= set(versions)
    assert versions["kcache-core"] == versions["kcache-server"] == VERSION


def test_the_clone_line_installs_all_three_from_the_sources(installs: Installs) -> None:
    versions = json.loads(_python(installs.clone, DIST_VERSIONS))
    assert (versions["kcache-core"], versions["kcache-client"], versions["kcache-server"]) == (
        VERSION,
        VERSION,
        VERSION,
    )
    files = json.loads(
        _python(
            installs.clone,
            "import json, kcache, kcache_client, kcache_server; "
            "print(json.dumps([m.__file__ for m in (kcache, kcache_client, kcache_server)]))",
        )
    )
    site = installs.clone.parent / "lib"
    for module in files:  # installed copies, not links back into the clone
        assert Path(module).is_relative_to(site), module


def test_wheels_serve_and_a_client_only_venv_compiles_and_fetches(
    installs: Installs, tmp_path: Path
) -> None:
    """The smoke test of a real install: the server from the GPU image's venv (NVRTC 13.3+
    beside torch's nvJitLink 13.0), a client venv with only kcache-client and the core (no
    FastAPI, no SQLAlchemy), then ``db upgrade``, ``serve``, a compile and a ``get`` through
    the server, ``stats``, and an LTO recipe refused by name, each with the installed
    commands, never the checkout."""
    import httpx

    from tests.support import free_port

    server_bin, client_bin = installs.image, installs.client
    probe = _python(
        client_bin,
        "import importlib.util as u; print([m for m in ('fastapi', 'sqlalchemy', 'uvicorn', "
        "'kcache_server', 'cuda') if u.find_spec(m)])",
    )
    assert probe == "[]", probe

    work = tmp_path / "work"
    work.mkdir()
    env = _user_env()
    # The doctor of a client-only install passes: NVRTC is only for local compiles (it
    # said "FAIL toolchain unusable"); a warning says what is missing and for what.
    doctor = _kcache_run(client_bin, "doctor", env=env, cwd=work)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert re.search(r"^warn\s+toolchain\s+no NVRTC here", doctor.stdout, re.M), doctor.stdout
    env["KCACHE_CACHE_DIR"] = str(tmp_path / "node-tier")
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")  # pinned server keys stay in this test
    data = tmp_path / "data"
    _kcache(server_bin, "db", "upgrade", "--data-dir", str(data), env=env, cwd=work)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("wb")
    server = subprocess.Popen(
        [str(server_bin / "kcache"), "serve", "--port", str(port), "--data-dir", str(data)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=work,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        assert httpx.get(f"{url}/readyz", timeout=10).json()["version"] == VERSION
        (tc,) = httpx.get(f"{url}/v1/toolchains", timeout=10).json()["toolchains"]
        assert tc["nvjitlink_version"] == "13.0", tc
        assert Version(tc["nvrtc_version"]) >= Version("13.3"), tc
        (work / "add.cu").write_text(ADD)
        compile_args = ("add.cu", "--target", "sm_90", "--server", url)
        first = _json_line(_kcache(client_bin, "compile", *compile_args, env=env, cwd=work))
        assert first["status"] == "compiled", first
        again = _json_line(_kcache(client_bin, "get", *compile_args, env=env, cwd=work))
        assert again["digest"] == first["digest"], again
        stats = httpx.get(f"{url}/v1/stats", timeout=10).json()
        assert stats["totals"].get("compiled") == 1, stats
        shown = _kcache_run(server_bin, "stats", "--server", url, env=env, cwd=work)
        assert shown.returncode == 0 and "compiled" in shown.stdout, shown.stdout + shown.stderr
        lto = _kcache_run(
            client_bin, "compile", str(_lto_recipe(work)), "--server", url, env=env, cwd=work
        )
        assert lto.returncode != 0, lto.stdout
        assert "LTO recipes are not compiled on this server" in lto.stderr, lto.stderr
        assert f"pip install 'nvidia-nvjitlink>={tc['nvrtc_version']},<14'" in lto.stderr
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


def test_local_compiles_beside_torchs_nvjitlink_refuse_only_lto(
    installs: Installs, tmp_path: Path
) -> None:
    """No server: the image's venv compiles a plain recipe with its NVRTC, and refuses an LTO
    one by name, with the pip command that installs an nvJitLink able to link it."""
    env = {
        **_user_env(),
        "KCACHE_CACHE_DIR": str(tmp_path / "cache"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
    }
    (tmp_path / "add.cu").write_text(ADD)
    args = ("compile", "add.cu", "--target", "sm_90")
    done = _json_line(_kcache(installs.image, *args, env=env, cwd=tmp_path))
    assert done["status"] == "compiled", done
    lto = _kcache_run(installs.image, "compile", str(_lto_recipe(tmp_path)), env=env, cwd=tmp_path)
    assert lto.returncode != 0 and "Traceback" not in lto.stderr, lto.stderr
    assert "nvJitLink 13.0 is older than NVRTC" in lto.stderr, lto.stderr
    assert re.search(r"pip install 'nvidia-nvjitlink>=13\.\d+,<14'", lto.stderr), lto.stderr


def test_no_install_line_names_the_unrelated_pypi_kcache() -> None:
    """``kcache`` on PyPI is another project: every pip command the project prints or
    documents names ``kcache-core`` (or the client or server) instead."""
    wrong = re.compile(r"""pip install[^\n`]*?(?<![\w-])['"]?kcache(\[[\w,]+\])?(==|>=|['"\s]|$)""")
    files = [
        README,
        ROOT / "client" / "README.md",
        ROOT / "server" / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(p for p in (ROOT / "deploy").rglob("*") if p.is_file()),
        *(ROOT / "scripts").iterdir(),
        *(ROOT / "kcache").rglob("*.py"),
        *(ROOT / "client" / "kcache_client").rglob("*.py"),
        *(ROOT / "server" / "kcache_server").rglob("*.py"),
    ]
    found = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in files
        if path.suffix != ".pyc"
        for match in wrong.finditer(path.read_text(encoding="utf-8", errors="replace"))
    ]
    assert found == []
    assert re.search(r"\bkcache-core\b", nvrtc_install_advice())
