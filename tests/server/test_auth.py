"""``--api-key``: every route of the router but /health and /version answers 401 without
the key (enumerated from the app itself, not a hand-made list); path tricks never bypass
it; CORS preflights need no key."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from starlette.routing import Route

from pagedllm.entrypoints.openai.api_server import PUBLIC_PATHS, build_app, normalize_path
from pagedllm.entrypoints.openai.serving_base import ServingState
from pagedllm.metrics import EngineMetrics
from tests.server.harness import ServerProcess, running_server

KEY = "sk-test-0123456789"
ORIGIN = "http://example.test"


@pytest.fixture(scope="module")
def auth_server() -> Iterator[ServerProcess]:
    with running_server("--api-key", KEY, "--allowed-origins", ORIGIN) as s:
        s.auth_headers = {"Authorization": f"Bearer {KEY}"}  # type: ignore[attr-defined]
        yield s


def _routes() -> list[tuple[str, str]]:
    """(method, path) of every route the real app registers, path params filled in."""
    state = ServingState(engine=None, metrics=EngineMetrics("m"),  # type: ignore[arg-type]
                         served_model_names=["m"], max_model_len=1)
    app = build_app(state, api_keys=["k"])
    out = []
    for r in app.routes:
        if not isinstance(r, Route):
            continue
        path = r.path.replace("{request_id}", "abc")
        for m in sorted(r.methods or {"GET"}):
            if m != "HEAD":
                out.append((m, path))
    assert ("POST", "/v1/completions") in out and ("GET", "/openapi.json") in out
    return out


ROUTES = _routes()


@pytest.mark.parametrize("method,path", ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_every_route_needs_the_key(auth_server: ServerProcess, method: str,
                                   path: str) -> None:
    with auth_server.client() as c:
        r = c.request(method, path, json={})
        if path in PUBLIC_PATHS:
            assert r.status_code == 200
            return
        assert r.status_code == 401, (method, path, r.status_code)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        bad = c.request(method, path, json={}, headers={"Authorization": "Bearer sk-wrong"})
        assert bad.status_code == 401
        good = c.request(method, path, json={}, headers={"Authorization": f"Bearer {KEY}"})
        assert good.status_code != 401


def _raw_get(url: str, path: str, headers: dict[str, str] | None = None) -> int:
    """GET with the request target sent byte for byte (clients normalise paths)."""
    host, port = url.removeprefix("http://").split(":")
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        status_line = sock.makefile("rb").readline().decode()
    return int(status_line.split()[1])


@pytest.mark.parametrize("path", [
    "//v1/models", "/v1/models/", "/V1/MODELS", "/v1//models", "/%76%31/models",
    "/v1/models%2F", "/health/../v1/models", "/./v1/models", "/v1/./models",
    "/health/..%2Fv1/models", "/v1/models?x=/health", "/v1/models#/health",
    "/version/../metrics", "/metrics", "/metrics/", "/openapi.json", "/docs",
    "/v1/models%00", "/%68ealth/../v1/models", "\\v1\\models",
])
def test_path_tricks_do_not_bypass(auth_server: ServerProcess, path: str) -> None:
    status = _raw_get(auth_server.url, path)
    assert status in (401, 404), (path, status)
    if status == 404:
        # A 404 is fine only when nothing would have been served with the key either.
        assert _raw_get(auth_server.url, path, {"Authorization": f"Bearer {KEY}"}) == 404


def test_scheme_and_header_variants(auth_server: ServerProcess) -> None:
    with auth_server.client() as c:
        assert c.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}
                     ).status_code == 200
        for h in (KEY, f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer",
                  f"Bearer  {KEY[1:]}"):
            assert c.get("/v1/models", headers={"Authorization": h}).status_code == 401, h


def test_x_api_key_header(auth_server: ServerProcess) -> None:
    """Issue 46 item 18: Anthropic's SDKs send ``x-api-key``; it is accepted (on every
    route), a wrong one is not, and the real Anthropic client works."""
    import anthropic

    msg = {"model": "SmolLM2-135M-Instruct", "max_tokens": 1,
           "messages": [{"role": "user", "content": "Hi"}]}
    with auth_server.client() as c:
        assert c.post("/v1/messages", json=msg, headers={"x-api-key": KEY}
                      ).status_code == 200
        assert c.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
        for h in ("sk-wrong", KEY[:-1], f"Bearer {KEY}", ""):
            r = c.post("/v1/messages", json=msg, headers={"x-api-key": h})
            assert r.status_code == 401, h
        # A wrong Bearer token beside a right x-api-key: either key presented suffices.
        assert c.get("/v1/models", headers={"x-api-key": KEY,
                                            "Authorization": "Bearer nope"}
                     ).status_code == 200
    good = anthropic.Anthropic(base_url=auth_server.url, api_key=KEY, max_retries=0)
    out = good.messages.create(**msg)
    assert out.type == "message" and out.usage.output_tokens == 1
    bad = anthropic.Anthropic(base_url=auth_server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(**msg)


def test_public_routes_and_openai_client(auth_server: ServerProcess) -> None:
    import openai

    with auth_server.client() as c:
        assert c.get("/health").status_code == 200
        assert c.get("/version").status_code == 200
    good = openai.OpenAI(base_url=auth_server.url + "/v1", api_key=KEY, max_retries=0)
    assert good.models.list().data
    bad = openai.OpenAI(base_url=auth_server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=1)


def test_cors_preflight_needs_no_key(auth_server: ServerProcess) -> None:
    with auth_server.client() as c:
        r = c.options("/v1/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == ORIGIN
        other = c.options("/v1/completions", headers={
            "Origin": "http://evil.test", "Access-Control-Request-Method": "POST"})
        assert other.status_code == 400
        # The actual request still needs the key.
        r = c.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 401


def test_normalize_path_unit() -> None:
    assert normalize_path("//v1//models/") == "/v1/models"
    assert normalize_path("/HEALTH") == "/health"
    assert normalize_path("/v1/%2e%2e/health") == "/health"
    assert normalize_path("/%252Fhealth") == "/health"
    assert normalize_path("/health/../v1") == "/v1"
