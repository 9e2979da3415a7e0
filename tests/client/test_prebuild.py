"""GPU-less prebuild (issue 34 item 5): a job's manifest compiled on the server for other targets.

One real ``kcache serve`` for the module (real NVRTC and SQLite, no GPU); a job compiles
three small kernels for sm_90 and its manifest is saved; ``kcache prebuild`` (a real
process) then builds them for sm_80 and sm_100. The server must hold a cubin of each
(kernel, target) whose ELF names that SM, a second prebuild must compile nothing, and
what cannot be built (a recipe the server never recorded, a target NVRTC refuses or a
kernel that does not compile for it) is named, with a non-zero exit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kcache_client import ClientSettings, KernelCache

from kcache import Recipe
from kcache.cli import main as kcache_main
from kcache.job_manifest import JobManifest, ManifestKernel
from tests.cli_harness import kcache, user_env
from tests.support import FAST, ServerProcess, unique

JOB = "prebuild-job-34"
JOB_TARGET = "sm_90"
TARGETS = ("sm_80", "sm_100")
#: Compiles for sm_80 and up; for an older target its own #error stops NVRTC.
NEEDS_SM80 = """
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error this kernel needs sm_80 or newer
#endif
extern "C" __global__ void {name}(float* x) {{ x[threadIdx.x] += 1.0f; }}
"""


@dataclasses.dataclass
class Fleet:
    server: ServerProcess
    home: Path
    recipes: list[Recipe]  # concrete, as the job compiled them (sm_90)
    manifest_path: Path
    manifest: JobManifest


def _kernels(tag: str) -> list[Recipe]:
    plain = [
        Recipe(
            source=f'extern "C" __global__ void k{tag}_{i}(float* x) '
            f"{{ x[threadIdx.x] *= {i + 2}.0f; }}\n",
            target=JOB_TARGET,
        )
        for i in range(2)
    ]
    guarded = Recipe(source=NEEDS_SM80.format(name=f"k{tag}_sm80"), target=JOB_TARGET)
    return [*plain, guarded]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    home = tmp_path_factory.mktemp("prebuild")
    env = {
        **os.environ,
        "KCACHE_COMPILE_WORKERS": "2",
        "KCACHE_AUDIT_FLUSH_S": "0.05",
        "KCACHE_VERIFY_ENABLED": "false",  # no sampled recompiles competing for the two cores
    }
    env.pop("KCACHE_TOKEN", None)
    server = ServerProcess(home / "data", env=env).start()
    try:
        settings = ClientSettings.from_env(retry=FAST, send_events=False, job_id=JOB)
        with KernelCache(server.url, cache_dir=home / "job-tier", settings=settings) as cache:
            recipes = [cache.prepare(r) for r in _kernels(unique("pb").replace("-", "_"))]
            arts = cache.get_many(recipes)
            assert all(not isinstance(a, Exception) for a in arts), arts
            manifest = cache.job_manifest(JOB)
        assert len(manifest) == 3 and {k.target for k in manifest.kernels} == {JOB_TARGET}
        path = manifest.save(home / "job.manifest.json")
        yield Fleet(server, home, recipes, path, manifest)
    finally:
        server.stop()


def run(fleet: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    """``kcache prebuild ARGS`` against the fleet's server, as a user with no settings."""
    env = user_env(Path(tempfile.mkdtemp(dir=fleet.home)))
    return kcache("prebuild", "--server", fleet.server.url, *args, env=env, timeout=240)


def prebuild_here(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    """``kcache prebuild ARGS`` in this process (its exit status, stdout, stderr): the server
    is the real process; a command process per check would double the module's time."""
    capsys.readouterr()
    code = kcache_main(["prebuild", "--server", fleet.server.url, *args])
    out, err = capsys.readouterr()
    return code, out, err


def compiled_so_far(fleet: Fleet) -> float:
    """``kcache_lookups_total{outcome="compiled"}`` of the server's /metrics."""
    text = httpx.get(f"{fleet.server.url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kcache_lookups_total{") and 'outcome="compiled"' in line
    )


def cubin_sm(data: bytes) -> int:
    """The SM an ELF cubin is built for: bits 8-15 of ``e_flags`` (ELF64, offset 48)."""
    assert data[:4] == b"\x7fELF" and data[4] == 2, "an ELF64 file"
    (machine,) = struct.unpack_from("<H", data, 18)
    assert machine == 190, "EM_CUDA"
    flags: int = struct.unpack_from("<I", data, 48)[0]
    return (flags >> 8) & 0xFF


@pytest.fixture(scope="module")
def prebuilt(fleet: Fleet) -> dict[str, Any]:
    """The first prebuild for sm_80,sm_100 (its JSON, and what it wrote with -o)."""
    before = compiled_so_far(fleet)
    out_path = fleet.home / "prebuilt.manifest.json"
    done = run(
        fleet,
        "--manifest",
        str(fleet.manifest_path),
        "--target",
        ",".join(TARGETS),
        "--jobs",
        "2",
        "-o",
        str(out_path),
        "--json",
    )
    assert done.returncode == 0, done.stderr
    return {
        "body": json.loads(done.stdout),
        "stderr": done.stderr,
        "out": out_path,
        "compiles": compiled_so_far(fleet) - before,
    }


def test_no_target_offers_the_fleets_targets_and_the_command(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = prebuild_here(fleet, capsys, "--manifest", str(fleet.manifest_path))
    assert code == 2 and out == "", err
    assert "needs --target" in err and "Traceback" not in err
    assert f"{JOB_TARGET} (" in err  # the job's lookups, counted
    assert f"built for: {JOB_TARGET}" in err
    run_line = next(line for line in err.splitlines() if line.startswith("kcache: run: "))
    command = f"kcache prebuild --manifest {fleet.manifest_path} --server {fleet.server.url}"
    assert run_line.startswith(f"kcache: run: {command} --target sm_")
    suggested = run_line.rsplit(" ", 1)[1].split(",")
    assert suggested and JOB_TARGET not in suggested  # building the job's own target is no news


def test_prebuild_for_two_targets_compiles_each_kernel_for_each(
    fleet: Fleet, prebuilt: dict[str, Any]
) -> None:
    body = prebuilt["body"]
    assert body["complete"] and body["targets"] == list(TARGETS) and body["kernels"] == 3
    items = body["items"]
    assert len(items) == 6 and {i["outcome"] for i in items} <= {"compiled", "waited"}
    assert prebuilt["compiles"] == 6  # the server compiled each (kernel, target) once
    assert prebuilt["stderr"].count("kcache: [") == 6  # one progress line per kernel x target
    # Only the target changed: each key is that of the job's recipe for the other target.
    expected = {
        (r.key(), t): Recipe.from_dict({**r.to_dict(), "target": t}).key()
        for r in fleet.recipes
        for t in TARGETS
    }
    assert {(i["source_key"], i["target"]): i["recipe_key"] for i in items} == expected
    # The server holds a cubin of each, built for that SM.
    with httpx.Client(base_url=fleet.server.url, timeout=30) as http:
        for item in items:
            reply = http.get(f"/v1/recipes/{item['recipe_key']}/artifact")
            assert reply.status_code == 200, reply.text
            assert cubin_sm(reply.content) == int(item["target"].removeprefix("sm_"))
            meta = http.get(f"/v1/recipes/{item['recipe_key']}").json()
            assert meta["target"] == item["target"] and meta["digest"] == item["digest"]
    # -o: a manifest of the prebuilt kernels.
    out = JobManifest.load(prebuilt["out"])
    assert sorted(out.recipe_keys) == sorted(expected.values())
    assert {k.target for k in out.kernels} == set(TARGETS)


def test_a_second_prebuild_compiles_nothing_and_its_manifest_bundles(
    fleet: Fleet, prebuilt: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    before = compiled_so_far(fleet)
    targets = ",".join(TARGETS)
    code, out, err = prebuild_here(
        fleet, capsys, "--manifest", str(fleet.manifest_path), "--target", targets
    )
    assert code == 0, err
    assert compiled_so_far(fleet) == before
    table = out.splitlines()
    assert table[0].split() == ["kernel", *TARGETS]
    assert sum(line.split()[1:] == ["cached", "cached"] for line in table[2:-1]) == 3
    assert table[-1].startswith("3 kernels x 2 targets: 0 compiled, 6 already cached, 0 failed")
    # The manifest the first one wrote is what a bundle bakes into an image.
    kcb = fleet.home / "prebuilt.kcb"
    bundle = ["--manifest", str(prebuilt["out"]), "-o", str(kcb), "--server", fleet.server.url]
    code = kcache_main(["bundle", "create", *bundle])
    assert code == 0 and json.loads(capsys.readouterr().out)["entries"] == 6


def test_a_kernel_whose_recipe_the_server_lacks_is_named(
    fleet: Fleet, prebuilt: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    known = fleet.manifest.kernels[0]
    stranger = ManifestKernel("e" * 64, "f" * 64, "kstranger", JOB_TARGET, known.toolchain)
    path = JobManifest.of([known, stranger]).save(tmp_path / "m.json")
    code, out, err = prebuild_here(
        fleet, capsys, "--manifest", str(path), "--target", "sm_80", "--json"
    )
    assert code == 1, err
    items = {i["label"]: i for i in json.loads(out)["items"]}
    assert items[f"kstranger@{JOB_TARGET}"]["outcome"] == "missing"
    assert items[known.label]["outcome"] == "hit"  # prebuilt already: not compiled again
    assert f"kcache: no recipe: kstranger@{JOB_TARGET} (recipe {'e' * 64})" in err
    assert "holds no recipe" in err


def test_a_failing_target_is_named_with_its_log_and_a_non_zero_exit(
    fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    guarded = next(k for k in fleet.manifest.kernels if k.kernel.endswith("_sm80"))
    path = JobManifest.of([guarded]).save(tmp_path / "m.json")
    code, out, err = prebuild_here(
        fleet, capsys, "--manifest", str(path), "--target", "sm_75,sm_70", "--json"
    )
    assert code == 1, err
    by_target = {i["target"]: i for i in json.loads(out)["items"]}
    assert {i["outcome"] for i in by_target.values()} == {"failed"}
    assert "needs sm_80 or newer" in by_target["sm_75"]["reason"]  # NVRTC's log, first lines
    assert "sm_70 is not supported" in by_target["sm_70"]["reason"]  # refused by the server
    for target, item in by_target.items():
        assert f"failed: {guarded.label} for {target} (recipe {item['recipe_key']})" in err
    assert "needs sm_80 or newer" in err


def test_bad_input_is_told_with_its_fix(
    fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def told(*args: str) -> tuple[int, str]:
        code, _, err = prebuild_here(fleet, capsys, *args)
        return code, err

    manifest = str(fleet.manifest_path)
    code, err = told("--manifest", manifest, "--target", "sm90")
    assert code == 2 and "--target: 'sm90' is not a target; use sm_XX" in err
    code, err = told("--manifest", manifest, "--target", ",")
    assert code == 2 and "--target: no target named" in err
    code, err = told("--manifest", manifest, "--target", "auto")
    assert code == 2 and "--target" in err and "sm_90,sm_100" in err
    body = json.loads(fleet.manifest_path.read_text())
    body["kernels"] = body["kernels"][1:]
    damaged = tmp_path / "damaged.json"
    damaged.write_text(json.dumps(body))
    code, err = told("--manifest", str(damaged), "--target", "sm_80")
    assert code == 2 and str(damaged) in err and "edited by hand or damaged" in err
    code, err = told("--manifest", str(tmp_path / "absent.json"), "--target", "sm_80")
    assert code == 2 and "no such file" in err and "absent.json" in err
    code, err = told("--manifest", manifest, "--target", "sm_80", "--dry-run", "-o", "x.json")
    assert code == 2 and "--dry-run" in err


def test_a_dry_run_compiles_nothing_and_a_job_id_names_its_manifest(
    fleet: Fleet, prebuilt: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    before = compiled_so_far(fleet)
    args = ["--manifest", JOB, "--target", "sm_80,sm_86", "--dry-run", "--json"]
    code, out, _ = prebuild_here(fleet, capsys, *args)
    body = json.loads(out)
    assert code == 0 and body["dry_run"] and body["kernels"] == 3
    outcomes = {(i["label"].split("@")[0], i["target"]): i["outcome"] for i in body["items"]}
    assert set(outcomes.values()) == {"hit", "planned"}
    assert [t for (_, t), o in outcomes.items() if o == "hit"] == ["sm_80"] * 3
    assert compiled_so_far(fleet) == before


def test_the_jobs_help_states_the_librarys_bounds() -> None:
    from kcache_client._prebuild import DEFAULT_JOBS, MAX_JOBS
    from kcache_client._prebuild_cli import _JOBS_HELP

    stated = f"requests in flight, 1 to {MAX_JOBS} (default {DEFAULT_JOBS})"
    assert stated == _JOBS_HELP


def test_a_recorded_recipe_is_given_back_to_compile_tokens_only(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``GET /v1/recipes/{key}/recipe`` holds another team's source: ``read`` is not enough."""
    from kcache_server import Settings
    from kcache_server.settings import VerificationSettings

    from tests.support import ServerThread

    data = tmp_path_factory.mktemp("recipe-scope") / "data"
    server = ServerThread(
        Settings(data_dir=data, compile_workers=1, verify=VerificationSettings(enabled=False))
    )
    try:
        tokens = {s: server.state.tokens.create(f"p-{s}", [s]) for s in ("read", "compile")}
        path = f"/v1/recipes/{'d' * 64}/recipe"  # the scope is checked before the key is looked up
        with server.client(tokens["read"]) as http:
            refused = http.get(path)
        assert refused.status_code == 403 and "'compile'" in refused.json()["detail"]
        with server.client(tokens["compile"]) as http:
            unknown = http.get(path)
        assert unknown.status_code == 404 and "holds no recipe" in unknown.json()["detail"]
    finally:
        server.stop()


def test_retarget_changes_the_target_only_as_the_recipe_says() -> None:
    """Cubins take the target; PTX/LTO-IR of a virtual target its virtual form; links follow."""
    from kcache_client._prebuild import parse_targets, retarget

    from kcache.errors import RecipeError
    from kcache.targets import parse_target

    sm100 = parse_target("sm_100")
    cubin = Recipe(source="x", target="sm_90", flags=["-lineinfo"], toolchain="tc-a")
    moved = retarget(cubin, sm100)
    assert moved.to_dict() == {**cubin.to_dict(), "target": "sm_100"}
    ptx = Recipe(source="x", target="compute_90", output="ptx", toolchain="tc-a")
    assert retarget(ptx, sm100).to_dict() == {**ptx.to_dict(), "target": "compute_100"}
    lto = Recipe.from_dict(
        {
            "source": "x",
            "target": "sm_90",
            "lto": True,
            "toolchain": "tc-a",
            "link": [
                {"recipe": {"source": "a", "target": "compute_90", "output": "ltoir"}},
                {"recipe": {"source": "b", "target": "compute_80", "output": "ltoir"}},
                {"digest": "c" * 64},
            ],
        }
    )
    linked = retarget(lto, parse_target("sm_100a"), toolchain="tc-b").to_dict()
    assert (linked["target"], linked["toolchain"], linked["lto"]) == ("sm_100a", "tc-b", True)
    own, other, blob = linked["link"]
    assert (own["recipe"]["target"], own["recipe"]["output"]) == ("compute_100a", "ltoir")
    assert other["recipe"]["target"] == "compute_80"  # another architecture: kept
    assert own["recipe"]["toolchain"] == other["recipe"]["toolchain"] == "tc-b"
    assert blob == {"digest": "c" * 64}
    with pytest.raises(RecipeError, match="a cubin needs sm_XX"):
        retarget(cubin, parse_target("compute_100"))
    assert [t.text for t in parse_targets(["sm_90, sm_100,sm_90", "compute_90"])] == [
        "sm_90",
        "sm_100",
        "compute_90",
    ]


def test_a_large_manifest_reports_its_first_kernel_before_reading_every_recipe(
    fleet: Fleet,
) -> None:
    """A 100,000-kernel dry run printed nothing for 180 s (and held 300 MB): every recorded
    recipe was fetched before the first (kernel, target) ran. Now a window of kernels is in
    flight, so the first progress line comes while most recipes are still unread."""
    from kcache_client._prebuild import prebuild

    from tests.support import requests_counted

    route = "/v1/recipes/{recipe_key}/recipe"

    def recipes_read() -> float:
        metrics = httpx.get(f"{fleet.server.url}/metrics", timeout=30).text
        return sum(requests_counted(metrics, route, "GET", s) for s in ("200", "404"))

    unknown = [ManifestKernel(f"{i:064x}", "ab" * 32, f"k{i}") for i in range(40)]
    manifest = JobManifest.of([*fleet.manifest.kernels, *unknown])
    before = recipes_read()
    at_first: list[float] = []

    def progress(item: object, done: int, total: int) -> None:
        if not at_first:
            at_first.append(recipes_read() - before)

    settings = ClientSettings.from_env(retry=FAST, send_events=False)
    with KernelCache(fleet.server.url, cache_dir=fleet.home / "dry", settings=settings) as cache:
        result = prebuild(cache, manifest, ["sm_80"], jobs=1, dry_run=True, progress=progress)
    assert len(result.items) == 43 and result.counts["missing"] == 40
    assert recipes_read() - before == 43  # each read once
    assert at_first and at_first[0] <= 8, at_first  # jobs=1: a window of 4 kernels, not 43
