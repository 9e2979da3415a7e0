"""``kcache doctor``: each thing a kcache command depends on, checked, one line each, then a verdict.

Why a summary rather than a dump: the doctor is what a newcomer runs when something
does not work, and a page of JSON with ``"server": "ok: ..."`` buried in it (which
it said for a wrong token, since it only asked ``/healthz``) answered neither "is
anything wrong?" nor "what do I change?". So every check ends as ``ok``, ``warn``
(works, but not as one would expect: an unconfined sandbox, an open server taking
any token) or ``FAIL`` with what to change, and the last line says whether anything
failed. ``--json`` prints the same checks for scripts.

The server is asked twice at most: ``/healthz`` (does it answer at all), then
``GET /v1/toolchains`` with the token (the least a client needs: the read scope).
Only an answer to the second says the token works; when it is answered, the same
request without a token tells an open server (which accepts any token, so a wrong
one goes unnoticed until the server gets tokens) from one that checked it. Only
the standard library is used (the core does not depend on httpx).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from kcache.dirs import cache_dir, data_dir, directory_kind, toolchain_dir
from kcache.errors import KCacheError, ToolchainAbsentError

__all__ = ["Check", "as_json", "run_checks", "summary"]

Status = Literal["ok", "warn", "fail"]
_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Check:
    """One check's outcome: what was checked, how it went, and the detail (what to change)."""

    name: str
    status: Status
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


def _versions() -> Check:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    # The core is kcache-core; a checkout installed before the rename still says kcache.
    for dist in ("kcache-core", "kcache", "kcache-client", "kcache-server"):
        if dist == "kcache" and "kcache-core" in found:
            continue  # PyPI's `kcache` is an unrelated project's
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            continue
    found["python"] = platform.python_version()
    text = ", ".join(f"{k} {v}" for k, v in found.items())
    return Check("versions", "ok", text, found)


def _toolchain() -> list[Check]:
    from kcache.toolchain import load_toolchain

    try:
        toolchain = load_toolchain()
    except KCacheError as exc:
        if (
            isinstance(exc, ToolchainAbsentError)
            and importlib.util.find_spec("kcache_server") is None
        ):
            # A client-only install (the README's): kernels come from a server; only
            # local compiles (no server, or --local) need NVRTC here.
            return [
                Check(
                    "toolchain",
                    "warn",
                    f"no NVRTC here: kernels are fetched from a server, and a local compile "
                    f"(no server configured, or --local) fails until it is installed: {exc}",
                )
            ]
        return [Check("toolchain", "fail", f"unusable: {exc}")]
    described = toolchain.describe()
    targets = [f"sm_{sm}" for sm in toolchain.supported_sms]
    span = f"{targets[0]} .. {targets[-1]}" if targets else "no targets"
    checks = [
        Check(
            "toolchain",
            "ok",
            f"{toolchain.id} (NVRTC {toolchain.nvrtc_version}, nvJitLink "
            f"{toolchain.nvjitlink_version}; {span}), unpacked under {toolchain_dir()}",
            dict(described),
        )
    ]
    if (toolchain.include_dir / "cuda_fp16.h").is_file():
        checks.append(Check("headers", "ok", f"bundled headers in {toolchain.include_dir}"))
    else:
        checks.append(
            Check(
                "headers",
                "fail",
                f"no cuda_fp16.h in {toolchain.include_dir}: reinstall the NVRTC wheel "
                "(nvidia-cuda-nvrtc) or remove the directory to have it extracted again",
            )
        )
    return checks


def _sandbox() -> Check:
    from kcache.sandbox import probe

    if os.environ.get("KCACHE_COMPILE_SANDBOX", "").strip().lower() == "off":
        return Check(
            "sandbox", "warn", "KCACHE_COMPILE_SANDBOX=off: server compile workers are not confined"
        )
    status = probe()
    if status.abi > 0:
        return Check("sandbox", "ok", f"{status.detail}; server compile workers will be confined")
    return Check(
        "sandbox",
        "warn",
        f"unavailable: {status.detail}; `kcache serve` refuses a non-loopback address (unless "
        "KCACHE_COMPILE_SANDBOX=best-effort) and runs its compile workers unconfined on loopback",
    )


def _writable(root: Path) -> str | None:
    """None when files can be created in ``root`` (checked without creating it), else why not."""
    probe_dir = root
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        return f"{probe_dir} is not a directory"
    if not os.access(probe_dir, os.W_OK | os.X_OK):
        return f"{probe_dir} is not writable"
    return None


def _directory(name: str, root: Path, option: str) -> Check:
    problem = _writable(root)
    if problem is not None:
        return Check(name, "fail", f"{root}: {problem}; name another with {option}")
    kind = directory_kind(root)
    if name == "cache dir" and kind == "server":
        return Check(
            name,
            "fail",
            f"{root} is a kcache server's data directory, which client commands never write: "
            "name your cache directory with --cache-dir or KCACHE_CACHE_DIR",
        )
    where = "" if root.exists() else " (created on first use)"
    return Check(name, "ok", f"{root}{where}, writable", {"path": str(root), "kind": kind})


def _get(url: str, token: str | None) -> tuple[int, bytes, str]:
    """(status, body, error text) of a GET; status 0 when nothing answered."""
    headers = {"Accept": "application/json", "User-Agent": "kcache-doctor"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
            return int(response.status), response.read(1 << 20), ""
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read(1 << 16), ""
    except (urllib.error.URLError, OSError) as exc:
        return 0, b"", str(getattr(exc, "reason", exc))


def _detail(body: bytes) -> str:
    try:
        return str(json.loads(body).get("detail", "")) or "no detail"
    except (ValueError, AttributeError):
        return "no detail"


def _server(url: str, token: str | None, token_from: str) -> list[Check]:
    base = url.rstrip("/")
    status, body, error = _get(f"{base}/healthz", None)
    if status == 0:
        hint = (
            f"; the server may speak plain HTTP: try http://{base[len('https://') :]}"
            if base.startswith("https://") and ("SSL" in error or "record" in error)
            else "; start it, or check --server / KCACHE_URL"
        )
        return [Check("server", "fail", f"unreachable at {url}: {error}{hint}")]
    if status != 200:
        return [Check("server", "fail", f"{url} answers, but /healthz gave HTTP {status}")]
    version = ""
    answered, spec, _ = _get(f"{base}/openapi.json", None)
    if answered == 200:
        try:
            version = str(json.loads(spec)["info"]["version"])
        except (ValueError, KeyError, TypeError):
            version = ""
    shown = f" (kcache-server {version})" if version else ""
    checks = [Check("server", "ok", f"{url} answers{shown}", {"version": version or None})]
    status, body, error = _get(f"{base}/v1/toolchains", token)
    if status == 200:
        default = ""
        with contextlib.suppress(ValueError, AttributeError):  # an answer without one
            default = str(json.loads(body).get("default", ""))
        compiles = f"; it compiles with {default}" if default else ""
        if token and _get(f"{base}/v1/toolchains", None)[0] == 200:
            checks.append(
                Check(
                    "token",
                    "warn",
                    f"the server is open (it has no tokens), so it accepts any token and the one "
                    f"from {token_from} was not checked{compiles}",
                )
            )
        elif token:
            checks.append(Check("token", "ok", f"the token from {token_from} may read{compiles}"))
        else:
            checks.append(Check("token", "ok", f"none needed: the server is open{compiles}"))
    elif status == 401:
        fix = (
            f"the token from {token_from} is refused: check it, or ask the server's operator "
            "for one (kcache token create NAME --scope compile)"
            if token
            else "the server needs a token: pass --token or set KCACHE_TOKEN"
        )
        checks.append(Check("token", "fail", f"{fix} ({_detail(body)})"))
    elif status == 403:
        checks.append(
            Check(
                "token",
                "fail",
                f"the token from {token_from} may not read (the least a client needs): ask for "
                f"one with the read or compile scope ({_detail(body)})",
            )
        )
    elif status == 501:  # a fetch-only server (docs/operations.md): the token was accepted
        checks.append(
            Check(
                "token",
                "warn",
                f"accepted, but the server cannot compile and serves fetches only: {_detail(body)}",
            )
        )
    else:
        why = error or f"HTTP {status}: {_detail(body)}"
        checks.append(Check("token", "fail", f"GET /v1/toolchains failed: {why}"))
    return checks


def run_checks(
    *,
    cache: str | None,
    data: str | None,
    url: str | None,
    token: str | None,
    token_from: str,
) -> list[Check]:
    """Every check, in the order they are printed."""
    checks = [_versions(), *_toolchain(), _sandbox()]
    checks.append(_directory("cache dir", cache_dir(cache).resolve(), "--cache-dir"))
    if data or os.environ.get("KCACHE_DATA_DIR"):
        checks.append(_directory("data dir", data_dir(data).resolve(), "--data-dir"))
    if url:
        checks += _server(url, token, token_from)
    return checks


def summary(checks: list[Check]) -> str:
    """One line per check, then the verdict."""
    width = max(len(c.name) for c in checks)
    lines = [
        f"{c.status.upper() if c.status == 'fail' else c.status:<4}  {c.name:<{width}}  {c.detail}"
        for c in checks
    ]
    failed = [c.name for c in checks if c.status == "fail"]
    warned = [c.name for c in checks if c.status == "warn"]
    if failed:
        lines.append(
            f"kcache doctor: {len(failed)} of {len(checks)} checks failed: {', '.join(failed)}"
        )
    else:
        note = f" ({len(warned)} with a warning: {', '.join(warned)})" if warned else ""
        lines.append(f"kcache doctor: all {len(checks)} checks passed{note}")
    return "\n".join(lines)


def as_json(checks: list[Check]) -> str:
    """The checks for a script: ``{"ok": bool, "checks": [{name, status, detail, data}]}``."""
    return json.dumps(
        {"ok": all(c.status != "fail" for c in checks), "checks": [asdict(c) for c in checks]},
        indent=2,
    )
