"""The official ``openai`` Python client, pointed at the local server, works unchanged."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture()
def client(served):
    c = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def test_streamed_chat_completion(client, served, reference_engine):
    from pdkv.engine import SamplingParams

    messages = [{"role": "user", "content": "Hello, how are you today?"}]
    stream = client.chat.completions.create(model=served.model, messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    pieces, finish, usage, roles = [], None, None, []
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk" and chunk.model == served.model
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    prompt = reference_engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = reference_engine.tokenizer.encode(prompt, add_special_tokens=False)
    ref = reference_engine.generate([ids], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert "".join(pieces) == ref.text
    assert roles[0] == "assistant"
    assert finish == ref.finish_reason
    assert usage.prompt_tokens == len(ids) and usage.completion_tokens == ref.num_output_tokens
    served.wait_idle()


def test_completions_and_models(client, served):
    models = client.models.list()
    assert [m.id for m in models.data] == [served.model]
    out = client.completions.create(model=served.model, prompt="Paris is", max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6


def test_errors_surface_as_openai_exceptions(client, served):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert "no-such-model" in e.value.message and e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=served.model, prompt="x", max_tokens=10 ** 6)
    assert "exceeds the model's context" in e.value.message
    served.wait_idle()
