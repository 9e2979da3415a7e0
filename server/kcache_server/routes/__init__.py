"""One ``APIRouter`` per resource."""

from kcache_server.routes import blobs, health, recipes, resolve, toolchains

ROUTERS = [resolve.router, recipes.router, blobs.router, toolchains.router, health.router]

__all__ = ["ROUTERS"]
