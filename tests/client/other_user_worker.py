"""Another user of a node: a real process that drops root for a uid of its own, then uses a tier.

    python other_user_worker.py CONFIG.json

Started as root; everything it will import is imported first (the interpreter's own files
may be where the other uid cannot read them), then it takes the config's uid and gid
(``os.setgid``/``os.setuid``: what a second user's job is), a home of that user's, and
opens a ``KernelCache`` on the shared tier: ``prefetch(manifest)`` when the config names one,
then ``freeze("error")`` and ``get`` for every recipe. It writes to ``out`` (as JSON) what
it did: the prefetch's result, each get's origin (or the error's class and message), the
cache's counters, and whether ``check()`` accepted every artifact ``get`` returned.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import kcache_client._bundle
import kcache_client._jobs  # a job step's modules, which the cache imports on first use
import kcache_client._lean_http
import kcache_client._tier_publish
import kcache_client._tier_size
import kcache_client._trust_cli  # noqa: F401  (imported while the interpreter can be read)
from kcache_client import ClientSettings, KernelCache, RetryPolicy

from kcache import Recipe
from kcache.job_manifest import JobManifest
from kcache.signing import verifier


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    verifier()  # OpenSSL through ctypes (or cryptography), loaded as root
    recipes = [Recipe.from_dict(r) for r in cfg["recipes"]]
    manifest = JobManifest.load(cfg["manifest"]) if cfg.get("manifest") else None
    home = Path(cfg["home"])
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
    os.environ.update(
        HOME=str(home), XDG_CACHE_HOME=str(home / "cache"), XDG_CONFIG_HOME=str(home / "config")
    )
    settings = ClientSettings.from_env(
        retry=RetryPolicy(attempts=3, base_s=0.05, cap_s=0.2, budget_s=2.0),
        send_events=False,
        trusted_keys=cfg.get("trusted_keys"),
        known_servers=home / "config" / "known_servers.json",
    )
    out: dict[str, object] = {"uid": os.getuid()}
    with KernelCache(cfg.get("url"), cache_dir=cfg["tier"], settings=settings) as cache:
        out["standing"] = cache.tier.standing.kind
        if manifest is not None:
            done = cache.prefetch(manifest)
            out["prefetch"] = {"requests": done.requests, "fetched": done.fetched}
        cache.freeze("error")
        origins: list[object] = []
        checked = True
        for recipe in recipes:
            try:
                art = cache.get(recipe)
            except Exception as exc:  # reported, not raised: the test reads what happened
                origins.append({"error": type(exc).__name__, "message": str(exc)})
                continue
            origins.append(art.origin)
            try:
                art.check()
            except Exception:
                checked = False
        out["origins"] = origins
        out["checked"] = checked
        out["bundle_requests"] = cache.stats.bundle_requests
        out["server_fetches"] = cache.stats.server_fetches
        out["requests"] = cache.requests
    Path(cfg["out"]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
