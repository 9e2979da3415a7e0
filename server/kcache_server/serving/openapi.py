"""The published API contract: ``/openapi.json``, as this server enforces it.

FastAPI writes the document from the routes and their pydantic models; this
module completes it with what only the running server knows, so that the
document states every limit the server enforces:

- the ``Recipe`` schema (:mod:`kcache_server.recipe_schema`) for this server's
  toolchain, targets and include sets, where a model marks it
  (:data:`~kcache_server.schemas.RECIPE_MARK`); on a server that cannot compile
  (:mod:`kcache_server.compiler_presence`), any target of the core's grammar and any
  toolchain id, named (it has no default): such a server looks recipes up only;
- bounds that are settings (``max_batch``, ``audit.max_events_per_batch``, ...),
  where a model marks them (:data:`~kcache_server.schemas.SETTING_MARK`), and
  settings named in a description's text as ``{setting:NAME}`` (:data:`SETTING_TEXT`);
- every setting that bounds a request, under ``info.x-limits`` (the body size
  too, which no schema keyword states: over it is a 413);
- an optional parameter's schema without FastAPI's ``null`` branch (``anyOf: [X,
  {"type": "null"}]`` for ``X | None``): a query string, header or path has no null,
  leaving the parameter out is how it is not given, and a branch no request can take
  made schema-driven clients and fuzzers mistake valid requests for invalid ones.

The document is built once per app, on the first request for it, and versioned
with the API (``/v1``): ``info.version`` is the server's version, the paths carry
the API version.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kcache.targets import target_regex
from kcache_server.recipe_schema import recipe_components
from kcache_server.schemas import RECIPE_MARK, SETTING_MARK
from kcache_server.settings import Settings
from kcache_server.state import ServerState

__all__ = [
    "REQUEST_LIMITS",
    "SETTING_TEXT",
    "install_openapi",
    "openapi_document",
    "setting_value",
]

#: The settings that bound a request, published under ``info.x-limits``.
REQUEST_LIMITS = (
    "max_request_bytes",
    "max_request_values",
    "max_batch",
    "audit.max_events_per_batch",
    "audit.max_clock_skew_s",
    "audit.max_reported_per_minute",
)


#: A setting named in a description's text (``{setting:audit.max_clock_skew_s}``): its value.
SETTING_TEXT = re.compile(r"\{setting:([a-z_][a-z0-9_.]*)\}")


def _format(value: Any) -> str:
    """A setting's value as text (``86400``, not ``86400.0``)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def setting_value(settings: Settings, name: str) -> Any:
    """The setting ``name`` (``max_batch``, or dotted into a section: ``audit.max_events_per_batch``)."""
    value: Any = settings
    for part in name.split("."):
        value = getattr(value, part)
    return value


def _complete(node: Any, settings: Settings) -> Any:
    """``node`` with every mark replaced by what it stands for on this server."""
    if isinstance(node, str):
        return SETTING_TEXT.sub(lambda m: _format(setting_value(settings, m.group(1))), node)
    if isinstance(node, list):
        return [_complete(item, settings) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _complete(value, settings) for key, value in node.items()}
    if out.pop(RECIPE_MARK, False):
        # The model's own field schema said "a JSON object"; the Recipe schema says which.
        return {"$ref": "#/components/schemas/Recipe"}
    for keyword, name in out.pop(SETTING_MARK, {}).items():
        out[keyword] = setting_value(settings, name)
    return out


def _without_null_branch(schema: dict[str, Any]) -> dict[str, Any]:
    """A parameter's ``schema`` without the ``{"type": "null"}`` branch of an ``anyOf``.

    The one branch left is merged into the schema; the schema's own keywords (its
    ``pattern``, ``items``, ``description``) win over the branch's.
    """
    branches = schema.get("anyOf")
    if not isinstance(branches, list) or {"type": "null"} not in branches:
        return schema
    rest = [branch for branch in branches if branch != {"type": "null"}]
    outer = {key: value for key, value in schema.items() if key != "anyOf"}
    if len(rest) != 1:
        return {**outer, "anyOf": rest}
    return {**rest[0], **outer}


def _drop_parameter_null_branches(document: dict[str, Any]) -> None:
    """Every operation's parameters' schemas through :func:`_without_null_branch`, in place."""
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                if isinstance(parameter.get("schema"), dict):
                    parameter["schema"] = _without_null_branch(parameter["schema"])


def _lookup_only_recipes(components: dict[str, Any]) -> None:
    """The recipe components of a server that cannot compile, in place: it keys what it is
    sent against what other servers compiled, so any target the core parses and any
    toolchain id, which the recipe must name (there is no default here)."""
    components["Target"]["pattern"] = f"^(?:{target_regex()})$"
    components["CubinTarget"]["pattern"] = f"^(?:{target_regex(families=('sm',))})$"
    components["Target"]["description"] = components["CubinTarget"]["description"] = (
        "a target of the server that compiled the recipe (this server cannot compile)"
    )
    components["RecipeToolchain"] = {
        "type": "string",
        "description": "the toolchain id of the server that compiled the recipe: required here, "
        "as this server cannot compile and has no default (omitted: 501 cannot_compile)",
    }


def openapi_document(app: FastAPI, state: ServerState) -> dict[str, Any]:
    """The OpenAPI document of ``app`` with this server's recipe schema and limits filled in."""
    document = get_openapi(
        title=app.title,
        version=app.version,
        summary=app.summary,
        description=app.description,
        routes=app.routes,
    )
    toolchain = state.backends.toolchain
    components = document.setdefault("components", {}).setdefault("schemas", {})
    components.update(
        recipe_components(
            sms=toolchain.supported_sms,
            toolchains=[toolchain.id],
            include_sets=state.backends.compiler.include_sets.names,
        )
    )
    if not toolchain.compiles:
        _lookup_only_recipes(components)
    _drop_parameter_null_branches(document)
    document["info"]["x-limits"] = {
        name: setting_value(state.settings, name) for name in REQUEST_LIMITS
    }
    completed: dict[str, Any] = _complete(document, state.settings)
    return completed


def install_openapi(app: FastAPI, state: ServerState) -> None:
    """Serve :func:`openapi_document` as ``app``'s ``/openapi.json`` (built on first use, then kept)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, state)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise it
