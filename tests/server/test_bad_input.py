"""Bad input gets a 4xx with a clear message, leaves the server healthy, and takes no page."""

from __future__ import annotations

import pytest

GOOD = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}


def assert_still_serving(api, served):
    status, body = api.http("GET", served.url + "/health")
    assert status == 200, body
    status, body = api.http("POST", served.url + "/v1/completions", GOOD)
    assert status == 200 and body["usage"]["completion_tokens"] >= 1, body
    served.wait_idle()


@pytest.mark.parametrize("path, raw, status, needle", [
    ("/v1/completions", b"{not json", 400, "the request body is not valid JSON"),
    ("/v1/chat/completions", b'{"messages": [', 400, "the request body is not valid JSON"),
    ("/v1/completions", b"\xff\xfe\x00", 400, "the request body is not valid JSON"),
    ("/v1/completions", b"", 400, "the request body is empty"),
    ("/v1/completions", b"[1, 2]", 400, "must be a JSON object, got list"),
])
def test_malformed_bodies(api, served, path, raw, status, needle):
    got, body = api.http("POST", served.url + path, raw=raw)
    assert got == status and needle in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    assert_still_serving(api, served)


@pytest.mark.parametrize("path, body, param, needle", [
    ("/v1/completions", {"max_tokens": 3}, "prompt", "'prompt' is required"),
    ("/v1/chat/completions", {"max_tokens": 3}, "messages", "'messages' is required"),
    ("/v1/completions", {"prompt": 42}, "prompt", "'prompt' must be"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "many"}, "max_tokens", "'max_tokens' must be an integer"),
    ("/v1/completions", {"prompt": "a", "temperature": [1]}, "temperature", "'temperature' must be a number"),
    ("/v1/completions", {"prompt": "a", "stop": {"x": 1}}, "stop", "'stop' must be a string or a list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, "messages[0].content",
     "must be a string or a list of text parts"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": [1, 2, 10 ** 9]}, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"prompt": "a", "priority": "high"}, "priority", "'priority' must be an integer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "priority": 1.5}, "priority",
     "'priority' must be an integer"),
    # as vLLM: a non-zero priority needs scheduler.policy priority (this server runs fcfs)
    ("/v1/completions", {"prompt": "a", "priority": 2}, "priority", "scheduler.policy is fcfs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "priority": -1}, "priority",
     "priority -1 needs priority scheduling"),
])
def test_missing_and_mistyped_fields(api, served, path, body, param, needle):
    status, got = api.http("POST", served.url + path, body)
    assert status == 400, got
    assert got["error"]["param"] == param and needle in got["error"]["message"]
    assert_still_serving(api, served)


def test_priority_zero_is_accepted_under_fcfs(api, served):
    status, body = api.http("POST", served.url + "/v1/completions", {**GOOD, "priority": 0})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1, body
    served.wait_idle()


def test_max_tokens_beyond_the_context(api, served):
    n = served.engine.max_model_len
    status, body = api.http("POST", served.url + "/v1/completions", {"prompt": "Hello", "max_tokens": n})
    assert status == 400
    msg = body["error"]["message"]
    assert "exceeds the model's context" in msg and str(n) in msg and body["error"]["param"] == "max_tokens"
    # A prompt that alone fills the context fails the same way on chat (default max_tokens).
    status, body = api.http("POST", served.url + "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "word " * (2 * n)}]})
    assert status == 400 and "exceeds the model's context" in body["error"]["message"]
    assert_still_serving(api, served)


def test_unknown_model(api, served):
    status, body = api.http("POST", served.url + "/v1/chat/completions",
                            {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert "'gpt-17' does not exist" in body["error"]["message"] and served.model in body["error"]["message"]
    assert_still_serving(api, served)


def test_unknown_route_and_method(api, served):
    status, body = api.http("GET", served.url + "/v1/nothing")
    assert status == 404 and "no route for GET /v1/nothing" in body["error"]["message"]
    status, body = api.http("GET", served.url + "/v1/completions")
    assert status == 405 and "method GET is not allowed" in body["error"]["message"]
    assert_still_serving(api, served)


@pytest.fixture(scope="module")
def strict(api, server_model_dir):
    """A server with an API key and a small body limit."""
    s = api.Served(api.make_config(server_model_dir, "server.api_key=s3cret", "server.max_body_bytes=4096"))
    yield s
    s.close()


def test_body_over_the_limit(api, strict):
    auth = {"Authorization": "Bearer s3cret"}
    big = {"prompt": "x" * 8000, "max_tokens": 2}
    status, body = api.http("POST", strict.url + "/v1/completions", big, headers=auth)
    assert status == 413 and "the limit is 4096 bytes (server.max_body_bytes)" in body["error"]["message"]

    async def chunked():  # no Content-Length: the limit holds while the body is read
        import aiohttp

        async def gen():
            for _ in range(10):
                yield b" " * 1000
        async with aiohttp.ClientSession() as s:
            async with s.post(strict.url + "/v1/completions", data=gen(), headers=auth) as r:
                return r.status, await r.json()
    import asyncio

    status, body = asyncio.run(chunked())
    assert status == 413 and "4096 bytes" in body["error"]["message"]
    status, body = api.http("POST", strict.url + "/v1/completions", GOOD, headers=auth)
    assert status == 200, body
    strict.wait_idle()


def test_api_key(api, strict):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        status, body = api.http("POST", strict.url + "/v1/completions", GOOD, headers=headers)
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert "Authorization: Bearer <key>" in body["error"]["message"]
    status, _ = api.http("GET", strict.url + "/v1/models")
    assert status == 401
    status, body = api.http("POST", strict.url + "/v1/completions", GOOD, headers={"Authorization": "Bearer s3cret"})
    assert status == 200, body
    assert api.http("GET", strict.url + "/health")[0] == 200  # probes and scrapers need no key
    assert api.http("GET", strict.url + "/metrics")[0] == 200
    strict.wait_idle()


@pytest.mark.parametrize("raw, needle", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),  # was a 500 (RecursionError)
    (b'{"prompt": "' + b"a" * 10 + b'\\ud800", "max_tokens": 2}', "lone UTF-16 surrogate"),  # was a 500
    (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "lone UTF-16 surrogate"),
])
def test_hostile_json_is_a_400(api, served, raw, needle):
    for path in ("/v1/completions", "/v1/chat/completions"):
        got, body = api.http("POST", served.url + path, raw=raw)
        assert got == 400 and needle in body["error"]["message"], body
    assert_still_serving(api, served)


def test_priority_reaches_the_engine_under_the_priority_policy(api, server_model_dir):
    from pdkv.engine import LLMEngine
    from pdkv.server import ServerThread

    cfg = api.make_config(server_model_dir, "scheduler.policy=priority")
    engine = LLMEngine.from_config(cfg)
    seen = []
    submit = engine.submit
    engine.submit = lambda rid, prompt, params, arrival=None, priority=0: (
        seen.append(priority), submit(rid, prompt, params, arrival, priority))
    thread = ServerThread(cfg, engine).start()
    try:
        status, body = api.http("POST", thread.url + "/v1/completions", {**GOOD, "priority": 5})
        assert status == 200, body
        status, body = api.http("POST", thread.url + "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": -3})
        assert status == 200, body
        status, body = api.http("POST", thread.url + "/v1/completions", {**GOOD, "priority": [1]})
        assert status == 400 and body["error"]["param"] == "priority", body
    finally:
        thread.stop()
    assert seen == [5, -3]
