"""What a read token may see of another team's recipe in an explanation: no -D or specialization value.

The recorded recipe itself (``GET /v1/recipes/{key}/recipe``) needs the ``compile``
scope; an explanation of a miss used to print another team's macro values and
specialization values to any ``read`` token, through ``GET /v1/recipes/{key}/explain``,
``POST /v1/explain`` and ``/v1/stats``' ``last_miss_explanation``. Decided once
(:mod:`kcache.recipe_diff`): a caller below ``compile`` is told which macro or
specialization key differs, never its value; ``/v1/stats`` (read scope, the dashboard)
never carries values. One real server (uvicorn, NVRTC, SQLite, tokens) for the module.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kcache.recipe import Recipe
from tests.support import ServerThread, unique

#: The values a read token must never see. The specialization numbers are long and checked
#: as whole numbers: "99" was found inside an unrelated figure of a stats answer.
SECRETS = ("hunter2", "swordfish", "bfloat16", "float16", "=64", "=128", "7654321", "8765432")


@dataclass
class Explained:
    server: ServerThread
    tokens: dict[str, str]
    kernel: str
    base_key: str
    variant: dict[str, Any]
    variant_key: str


def _recipe(name: str, flags: list[str], specialization: dict[str, Any]) -> dict[str, Any]:
    return {
        "source": (
            f'extern "C" __global__ void {name}(float* x, int n) {{\n'
            "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
            "  if (i < n) x[i] *= 2.0f;\n"
            "}\n"
        ),
        "name": "k.cu",
        "flags": flags,
        "specialization": specialization,
        "target": "sm_80",
    }


@pytest.fixture(scope="module")
def explained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Explained]:
    from kcache_server import Settings

    data = tmp_path_factory.mktemp("explain-scopes") / "data"
    server = ServerThread(
        Settings(data_dir=data, compile_workers=1, audit={"flush_s": 0.05}, auth_cache_s=0.0)
    )
    try:
        tokens = {s: server.state.tokens.create(f"t-{s}", [s]) for s in ("read", "compile")}
        name = f"k_{unique().replace('-', '_')}"
        base = _recipe(name, ["-DKEY=hunter2", "-DTILE=64"], {"dtype": "float16", "N": 7654321})
        variant = _recipe(
            name, ["-DKEY=swordfish", "-DTILE=128"], {"dtype": "bfloat16", "N": 8765432}
        )
        engine = server.state.backends.engine
        with server.client(tokens["compile"]) as http:
            for recipe in (base, variant):  # the other team compiles both
                r = http.post("/v1/resolve", json={"recipe": recipe})
                assert r.status_code == 200 and r.json()["status"] == "compiled", r.text
        yield Explained(
            server,
            tokens,
            name,
            engine.prepare(Recipe.from_dict(base)).key(),
            variant,
            engine.prepare(Recipe.from_dict(variant)).key(),
        )
    finally:
        server.stop()


HIDDEN_LINES = [
    "flag -DKEY=… added",
    "flag -DTILE=… added",
    "flag -DKEY=… removed",
    "flag -DTILE=… removed",
    "specialization N changed",
    "specialization dtype changed",
]


def _no_secret(text: str) -> None:
    text = re.sub(r"[0-9a-f]{16,64}", "<key>", text)  # keys are hex: digits of their own
    for secret in SECRETS:
        whole = (
            rf"(?<![0-9.]){re.escape(secret)}(?![0-9])" if secret.isdigit() else re.escape(secret)
        )
        assert re.search(whole, text) is None, (secret, text)


def test_a_read_token_is_told_which_macros_differ_not_their_values(explained: Explained) -> None:
    with explained.server.client(explained.tokens["read"]) as http:
        by_key = http.get(f"/v1/recipes/{explained.variant_key}/explain")
        by_body = http.post("/v1/explain", json={"recipe": explained.variant})
    for answer in (by_key, by_body):
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["nearest_key"] == explained.base_key
        assert body["differences"] == HIDDEN_LINES
        _no_secret(answer.text)


def test_a_compile_token_sees_the_values(explained: Explained) -> None:
    with explained.server.client(explained.tokens["compile"]) as http:
        body = http.get(f"/v1/recipes/{explained.variant_key}/explain").json()
        assert http.get(f"/v1/recipes/{explained.variant_key}/recipe").status_code == 200
    assert body["differences"] == [
        "flag -DKEY=swordfish added",
        "flag -DTILE=128 added",
        "flag -DKEY=hunter2 removed",
        "flag -DTILE=64 removed",
        "specialization N 7654321 -> 8765432",
        "specialization dtype float16 -> bfloat16",
    ]


def test_stats_last_miss_explanation_carries_no_value(explained: Explained) -> None:
    """The dashboard's source: any read token reads it, so no token sees values there."""
    for scope in ("read", "compile"):
        with explained.server.client(explained.tokens[scope]) as http:
            stats = http.get("/v1/stats", params={"kernel": explained.kernel})
        assert stats.status_code == 200, stats.text
        (missed,) = stats.json()["top_missed"]
        assert missed["recipe_key"] == explained.variant_key
        assert missed["last_miss_explanation"] == (
            f"nearest {explained.base_key[:16]}: {'; '.join(HIDDEN_LINES)}"
        )
        _no_secret(stats.text)
