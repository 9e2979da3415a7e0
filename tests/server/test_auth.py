"""Tokens: scopes, hashing, revocation, and the refusal of unprotected public binds."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from kcache.cli import main
from tests.support import unique, vector_add


def _token(capsys: pytest.CaptureFixture[str], data_dir: Any, name: str, *scopes: str) -> str:
    argv = ["token", "create", name, "--data-dir", str(data_dir)]
    for scope in scopes:
        argv += ["--scope", scope]
    assert main(argv) == 0
    token = capsys.readouterr().out.strip()
    assert token.startswith("kc_")
    return token


def test_tokens_and_scopes(
    make_settings: Any, serve: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = make_settings()
    server = serve(settings)  # creates the database
    reader = _token(capsys, settings.data_dir, "reader", "read")
    compiler = _token(capsys, settings.data_dir, "builder", "compile")
    recipe = vector_add(unique())
    with server.client() as anonymous:
        missing = anonymous.post("/v1/resolve", json={"recipe": recipe})
        assert missing.status_code == 401 and missing.json()["error"] == "unauthorized"
        assert "Bearer" in missing.json()["detail"]
        assert anonymous.get("/v1/toolchains").status_code == 401
        assert anonymous.get("/healthz").status_code == 200  # probes need no token
    with server.client("kc_wrong") as wrong:
        response = wrong.post("/v1/resolve", json={"recipe": recipe})
        assert response.status_code == 401 and "unknown or revoked" in response.json()["detail"]
    with server.client(reader) as client:
        denied = client.post("/v1/resolve", json={"recipe": recipe})
        assert denied.status_code == 403 and denied.json()["error"] == "forbidden"
        assert "compile" in denied.json()["detail"]
        assert (
            client.post("/v1/resolve", json={"recipe": recipe, "compile": False}).status_code == 404
        )
        assert client.post("/v1/resolve/batch", json={"recipes": [recipe]}).status_code == 403
    with server.client(compiler) as client:
        body = client.post("/v1/resolve", json={"recipe": recipe}).json()
        assert body["status"] == "compiled"
    with server.client(reader) as client:
        assert client.get(f"/v1/recipes/{body['recipe_key']}/artifact").status_code == 200

    assert main(["token", "list", "--data-dir", str(settings.data_dir)]) == 0
    listing = capsys.readouterr().out
    assert "reader\tread" in listing and "builder\tcompile" in listing and reader not in listing

    assert main(["token", "revoke", "reader", "--data-dir", str(settings.data_dir)]) == 0
    with server.client(reader) as client:
        assert client.get("/v1/toolchains").status_code == 401
    assert "no active token" not in capsys.readouterr().err  # the builder's is left

    # Revoking the last token (a leaked one) never opens a server that needed tokens.
    assert main(["token", "revoke", "builder", "--data-dir", str(settings.data_dir)]) == 0
    assert "no active token is left" in capsys.readouterr().err
    with server.client() as anonymous:
        assert anonymous.get("/v1/toolchains").status_code == 401
        assert anonymous.post("/v1/resolve", json={"recipe": recipe}).status_code == 401
    with server.client(compiler) as client:
        assert client.get("/v1/toolchains").status_code == 401

    engine = sa.create_engine(settings.database_url)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT name, token_hash, scopes FROM tokens")).all()
    engine.dispose()
    stored = " ".join(" ".join(map(str, r)) for r in rows)
    assert reader not in stored and compiler not in stored  # only hashes are kept
    assert all(len(r.token_hash) == 64 for r in rows)


def test_a_server_started_with_tokens_needs_one_after_the_last_is_revoked(
    make_settings: Any, serve: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Guarded from its start, before any request came: revoking every token opens nothing."""
    settings = make_settings()
    assert main(["db", "upgrade", "--data-dir", str(settings.data_dir)]) == 0
    capsys.readouterr()
    _token(capsys, settings.data_dir, "only", "compile")
    server = serve(settings)
    assert main(["token", "revoke", "only", "--data-dir", str(settings.data_dir)]) == 0
    with server.client() as anonymous:
        assert anonymous.get("/v1/toolchains").status_code == 401
        assert anonymous.get("/metrics").status_code == 401


def test_public_bind_without_tokens_is_refused(
    make_settings: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from kcache_server import create_app
    from kcache_server.errors import InsecureBindError

    settings = make_settings(host="0.0.0.0")
    with pytest.raises(InsecureBindError, match="kcache token create"):
        create_app(settings)
    # The command says the same, as a clear exit rather than a traceback.
    assert (
        main(["serve", "--host", "0.0.0.0", "--port", "1", "--data-dir", str(settings.data_dir)])
        == 2
    )
    assert "--force-insecure" in capsys.readouterr().err
    create_app(make_settings(host="0.0.0.0", force_insecure=True))  # forced: allowed
    _token(capsys, settings.data_dir, "ops", "admin")
    create_app(settings)  # protected by a token: allowed
    create_app(make_settings(host="127.0.0.1"))


def test_token_list_escapes_control_characters_in_names(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A name stored before names were checked (or written to the table by hand) cannot drive the terminal."""
    data_dir = tmp_path / "data"
    assert main(["db", "upgrade", "--data-dir", str(data_dir)]) == 0
    capsys.readouterr()
    _token(capsys, data_dir, "placeholder", "read")
    hostile = "ops\x1b]0;owned\x07\x1b[2J\u202eexe.\u2028x"
    engine = sa.create_engine(f"sqlite:///{(data_dir / 'kcache.db').resolve()}")
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE tokens SET name = :n WHERE name = 'placeholder'"), {"n": hostile}
        )
    engine.dispose()
    assert main(["token", "list", "--data-dir", str(data_dir)]) == 0
    listing = capsys.readouterr().out
    assert not any(ch in listing for ch in "\x1b\x07\u202e\u2028")
    assert "ops\\x1b]0;owned\\x07\\x1b[2J\\u202eexe.\\u2028x\tread" in listing
