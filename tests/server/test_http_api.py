"""The OpenAI endpoints over real HTTP against a real engine: shapes, streaming, usage, metrics."""

from __future__ import annotations

from pdkv.engine import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. A decode node reserves pages"


def greedy_output(engine, prompt, max_tokens: int, **kw):
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))[0]


def greedy(engine, prompt, max_tokens: int, **kw) -> list[int]:
    return greedy_output(engine, prompt, max_tokens, **kw).output_token_ids


def test_health_and_models(api, served):
    status, body = api.http("GET", served.url + "/health")
    assert status == 200 and body["status"] == "ok" and body["role"] == "colocated"
    status, body = api.http("GET", served.url + "/v1/models")
    assert status == 200 and body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == served.model and card["object"] == "model"
    assert card["max_model_len"] == served.engine.max_model_len
    status, body = api.http("GET", served.url + "/version")
    assert status == 200 and body["version"]


def test_streamed_completion_tokens_equal_engine_greedy(api, served, reference_engine):
    ref = greedy_output(reference_engine, PROMPT, 24, ignore_eos=True)
    want = ref.output_token_ids
    events = api.stream(served.url, "/v1/completions", {"model": served.model, "prompt": PROMPT, "max_tokens": 24,
                                                    "temperature": 0, "ignore_eos": True,
                                                    "return_token_ids": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["model"] == served.model for c in chunks)
    got = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert got == want
    assert len(chunks) > 1  # really streamed: one chunk per step, not one blob at the end
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text
    assert chunks[0]["choices"][0]["prompt_token_ids"] == reference_engine.tokenizer.encode(PROMPT)
    served.wait_idle()


def test_non_streamed_completion_and_usage(api, served, reference_engine):
    ref = greedy_output(reference_engine, PROMPT, 12, ignore_eos=True)
    want = ref.output_token_ids
    status, body = api.http("POST", served.url + "/v1/completions",
                        {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                         "return_token_ids": True})
    assert status == 200, body
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["token_ids"] == want and choice["finish_reason"] == "length"
    assert choice["text"] == ref.text
    n_prompt = len(reference_engine.tokenizer.encode(PROMPT))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 12, "total_tokens": n_prompt + 12}


def test_token_id_prompt_and_several_prompts(api, served, reference_engine):
    ids = reference_engine.tokenizer.encode("Hello, world!")
    status, body = api.http("POST", served.url + "/v1/completions",
                        {"prompt": [ids, "Paris is"], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                         "return_token_ids": True})
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["token_ids"] == greedy(reference_engine, ids, 5, ignore_eos=True)
    assert body["choices"][1]["token_ids"] == greedy(reference_engine, "Paris is", 5, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 10


def test_chat_streaming_and_non_streaming_agree(api, served, reference_engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}]
    prompt = reference_engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    want = greedy(reference_engine, reference_engine.tokenizer.encode(prompt, add_special_tokens=False), 10)
    req = {"messages": messages, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    status, body = api.http("POST", served.url + "/v1/chat/completions", req)
    assert status == 200, body
    assert body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and body["choices"][0]["token_ids"] == want
    events = api.stream(served.url, "/v1/chat/completions", {**req, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == body["usage"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1])
    assert text == msg["content"]
    assert [t for c in chunks[1:-1] for t in c["choices"][0]["token_ids"]] == want
    assert chunks[-2]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]


def test_stop_string_and_max_tokens(api, served, reference_engine):
    full = reference_engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0,
                                                              ignore_eos=True))[0].text
    # Pick a stop string from the middle of the greedy text: the answer must end right before it.
    stop = full[6:9]
    status, body = api.http("POST", served.url + "/v1/completions",
                        {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [stop]})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == full[:full.index(stop)]


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_choices(api, served):
    req = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "top_p": 0.95, "top_k": 50, "seed": 1234,
           "ignore_eos": True, "n": 2, "return_token_ids": True}
    _, a = api.http("POST", served.url + "/v1/completions", req)
    _, b = api.http("POST", served.url + "/v1/completions", req)
    ids_a = [c["token_ids"] for c in a["choices"]]
    assert ids_a == [c["token_ids"] for c in b["choices"]]
    assert ids_a[0] != ids_a[1]  # seed + choice index: the two choices differ


def test_metrics_report_latencies_tokens_and_pages(api, served):
    before = api.metric(served.url, "pdkv_generation_tokens_total")
    prompt_before = api.metric(served.url, "pdkv_prompt_tokens_total")
    ttft_before = api.metric(served.url, "pdkv_time_to_first_token_seconds_count")
    api.http("POST", served.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 7, "temperature": 0,
                                                  "ignore_eos": True})
    served.wait_idle()
    assert api.metric(served.url, "pdkv_generation_tokens_total") == before + 7
    assert api.metric(served.url, "pdkv_prompt_tokens_total") > prompt_before
    assert api.metric(served.url, "pdkv_time_to_first_token_seconds_count") == ttft_before + 1
    assert api.metric(served.url, "pdkv_inter_token_latency_seconds_count") >= 6
    assert api.metric(served.url, "pdkv_request_queue_time_seconds_count") >= 1
    assert api.metric(served.url, "pdkv_request_success_total", finished_reason="length") >= 1
    assert api.metric(served.url, "pdkv_kv_cache_pages_total") == served.engine.allocator.num_total
    assert api.metric(served.url, "pdkv_kv_cache_pages_used") == 0
    assert api.metric(served.url, "pdkv_num_requests_running") == 0
    assert api.metric(served.url, "pdkv_num_requests_waiting") == 0


def test_prefix_cache_metrics_count_tokens(api, served):
    """vLLM's counting: each request's prompt tokens are queried, the repeat's whole cached pages hit."""
    req = {"prompt": "Prefix cache metrics: " + PROMPT * 3, "max_tokens": 2, "temperature": 0}

    def counts():
        return (api.metric(served.url, "pdkv_prefix_cache_queries_total"),
                api.metric(served.url, "pdkv_prefix_cache_hits_total"))

    _, first = api.http("POST", served.url + "/v1/completions", req)
    served.wait_idle()
    q1, h1 = counts()
    _, second = api.http("POST", served.url + "/v1/completions", req)
    served.wait_idle()
    q2, h2 = counts()
    n = first["usage"]["prompt_tokens"]
    assert n > 32 and second["choices"][0]["text"] == first["choices"][0]["text"]
    assert q2 - q1 == n
    assert h2 - h1 == (n - 1) // 16 * 16  # whole pages, the last token always computed
    assert served.engine.stats()["prefix_cache_hits"] == h2
