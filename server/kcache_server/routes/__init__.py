"""One ``APIRouter`` per resource, and :data:`ROUTERS`: every one of them, the one list ``create_app`` mounts."""

from kcache_server.routes import (
    blobs,
    bundle,
    cache,
    dashboard,
    events,
    explain,
    foreign,
    health,
    jobs,
    keys,
    metrics,
    pins,
    recipe_bodies,
    recipes,
    resolve,
    stats,
    toolchains,
    verification,
    withdrawals,
)

#: Every router of the app; a new resource module adds its router here, nowhere else.
ROUTERS = [
    resolve.router,
    recipes.router,
    recipe_bodies.router,
    explain.router,
    blobs.router,
    toolchains.router,
    keys.router,
    health.router,
    events.router,
    stats.router,
    metrics.router,
    dashboard.router,
    pins.router,
    cache.router,
    verification.router,
    withdrawals.router,
    jobs.router,
    bundle.router,
    foreign.router,
]

__all__ = ["ROUTERS"]
