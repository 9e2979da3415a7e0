"""Unknown query parameters are refused on every route (issue 45, item 4).

``GET /v1/stats?job=J`` (the parameter is ``job_id``) answered 200 with the whole
fleet's numbers, as if filtered. Now every route, the fast paths in front of the app
included, answers a parameter it does not take with a 422 naming the parameter and
the ones it takes. One real server (uvicorn, SQLite, NVRTC workers, an admin token)
for the module.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support import ServerThread, unique, vector_add

BOGUS = "zz_not_a_parameter"


@dataclass
class Served:
    server: ServerThread
    admin: str
    warm_key: str
    digest: str


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from kcache_server import Settings

    data = tmp_path_factory.mktemp("query-params") / "data"
    server = ServerThread(Settings(data_dir=data, compile_workers=1, audit={"flush_s": 0.05}))
    try:
        admin = server.state.tokens.create("admin", ["admin"])
        with server.client(admin) as http:
            answer = http.post("/v1/resolve", json={"recipe": vector_add(unique("qp"))}).json()
        yield Served(server, admin, answer["recipe_key"], answer["artifact"]["digest"])
    finally:
        server.stop()


def _refused(response: httpx.Response, name: str) -> dict[str, Any]:
    assert response.status_code == 422, (response.request.url, response.text)
    body: dict[str, Any] = response.json()
    assert body["error"] == "invalid_request"
    assert body["field"] == f"query.{name}"
    assert f"unknown query parameter {name!r}" in body["detail"]
    return body


def test_stats_refuses_job_and_names_job_id(served: Served) -> None:
    with served.server.client(served.admin) as http:
        body = _refused(http.get("/v1/stats", params={"job": "J"}), "job")
        assert "job_id" in body["detail"] and "group_by" in body["detail"]
        assert http.get("/v1/stats", params={"job_id": "J"}).status_code == 200


def _operations(spec: dict[str, Any], served: Served) -> Iterator[tuple[str, str]]:
    """Every documented (method, path) with its path parameters filled in."""
    values = {
        "recipe_key": served.warm_key,
        "digest": served.digest,
        "job_id": "job",
        "name": "dashboard.js",
    }
    for template, item in spec["paths"].items():
        path = re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), "x"), template)
        for method in item:
            if method in ("get", "post", "delete", "put", "head"):
                yield method.upper(), path


def test_every_route_refuses_a_parameter_it_does_not_take(served: Served) -> None:
    with served.server.client(served.admin) as http:
        spec = http.get("/openapi.json").json()
        operations = set(_operations(spec, served))
        # Routes outside the published contract: the page, its files, the redirect.
        operations |= {("GET", "/"), ("GET", "/dashboard"), ("GET", "/dashboard/dashboard.js")}
        assert len(operations) >= 25
        for method, path in sorted(operations):
            response = http.request(method, path, params={BOGUS: "1"}, json={})
            if method == "HEAD":  # no body to name it in
                assert response.status_code == 422, path
            else:
                _refused(response, BOGUS)


def test_the_fast_paths_leave_a_query_to_the_app(served: Served) -> None:
    """A warm fetch and a resolve hit are answered below the framework; with a query they are not."""
    with served.server.client(served.admin) as http:
        path = f"/v1/recipes/{served.warm_key}/artifact"
        assert http.get(path).status_code == 200  # warm: the fast path answers
        _refused(http.get(path, params={"download": "1"}), "download")
        recipe = {"recipe": {**vector_add("x"), "source": "x"}, "compile": False}
        _refused(http.post("/v1/resolve", params={"compile": "false"}, json=recipe), "compile")


def test_known_parameters_and_a_401_come_first(served: Served) -> None:
    with served.server.client() as anonymous:  # no token: the gate answers before the query is read
        assert anonymous.get("/v1/stats", params={"job": "J"}).status_code == 401
    with served.server.client(served.admin) as http:
        listed = http.get("/v1/withdrawals", params={"after": "0", "limit": "5"})
        assert listed.status_code == 200
        # A path no route serves stays a 404, whatever its query.
        assert http.get("/v1/nothing-here", params={BOGUS: "1"}).status_code == 404
