"""The ``mtp`` proposer on a tiny checkpoint with one DeepSeek-V3-style MTP layer: greedy output
is token for token what plain decoding gives, its KV pool returns to empty, its first draft equals
a reference written here from the DeepSeek-V3 report's formulas (with transformers' own
LlamaDecoderLayer as the transformer block), and a checkpoint without MTP layers fails at
start-up naming the config field."""

from __future__ import annotations

import pytest
import torch

from pdkv.config import ConfigError, KVCacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from pdkv.engine import LLMEngine, SamplingParams

K = 3


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    from pdkv.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("mtp"), seed=0, num_nextn_predict_layers=1)


def _engine(path, spec=True):
    return LLMEngine(ModelConfig(path=str(path)), KVCacheConfig(page_size=4, num_pages=1024), SchedulerConfig(),
                     speculative=SpeculativeConfig(method="mtp", num_tokens=K) if spec else None)


def _prompts():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in (5, 18, 41)]


def test_mtp_greedy_same_tokens_as_plain(mtp_dir, tiny_model_dir):
    plain, eng = _engine(mtp_dir, spec=False), _engine(mtp_dir)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = [o.output_token_ids for o in plain.generate(_prompts(), params)]
    assert [o.output_token_ids for o in eng.generate(_prompts(), params)] == want
    # The MTP layer's tensors are skipped by the target: the same weights as the plain model's.
    base = _engine(tiny_model_dir, spec=False)
    assert [o.output_token_ids for o in base.generate(_prompts(), params)] == want
    assert eng.spec.stats.num_draft_tokens > 20
    assert eng.spec.proposer.num_pages_used == 0 and eng.allocator.num_free == eng.allocator.num_total


def _reference_first_draft(path, engine, prompt, first_token):
    """DeepSeek-V3 MTP (its report, eq. 21-23) over the prompt's positions, written directly."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    import json
    cfg = json.loads((path / "config.json").read_text())
    L, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    w = {k[len(f"model.layers.{L}."):]: v for k, v in load_file(str(path / "model.safetensors")).items()
         if k.startswith(f"model.layers.{L}.")}
    hf_cfg = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    hf_cfg.num_hidden_layers = 1
    block = LlamaDecoderLayer(hf_cfg, 0)
    block.load_state_dict({k: v for k, v in w.items() if k.split(".")[0] in
                           ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")})
    rope = LlamaRotaryEmbedding(hf_cfg)

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    # The target's final hidden states at every prompt position (the plain engine's prefill).
    engine.add_request("ref", prompt, SamplingParams(max_tokens=1, temperature=0))
    engine.step()
    layout, hidden = engine.runner.last_forward
    h = hidden[:len(prompt)].float()
    emb = engine.loaded.model.model.embed_tokens.weight.float()
    nxt = torch.tensor(prompt[1:] + [first_token])  # t_{p+1} for p = 0 .. n-1
    x = torch.cat([rms(emb[nxt], w["enorm.weight"]), rms(h, w["hnorm.weight"])], -1) @ w["eh_proj.weight"].T
    pos = torch.arange(len(prompt))[None]
    with torch.no_grad():
        mask = torch.full((len(prompt), len(prompt)), float("-inf")).triu(1)[None, None]
        out = block(x[None], attention_mask=mask, position_ids=pos, position_embeddings=rope(x[None], pos))
        o = out[0] if isinstance(out, tuple) else out
        head = engine.loaded.model.lm_head.weight.float()
        logits = rms(o[0, -1], w["shared_head.norm.weight"]) @ head.T
    return logits


def test_mtp_first_draft_matches_the_report_formulas(mtp_dir):
    eng = _engine(mtp_dir)
    prompt = _prompts()[1]
    eng.add_request("a", prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    out = eng.step()[0]
    drafts = list(eng.requests["a"].spec_token_ids)
    ref = _reference_first_draft(mtp_dir, _engine(mtp_dir, spec=False), prompt, out.new_token_ids[0])
    mtp = eng.spec.proposer
    with torch.inference_mode():
        got = mtp.target.compute_logits(mtp.module.head_norm.forward(mtp.states["a"].last))[0]
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()
    assert drafts and drafts[0] == int(ref.argmax())


def test_mtp_on_a_checkpoint_without_mtp_layers_names_the_field(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"speculative.method mtp needs a checkpoint with MTP layers: .*"
                                          r"num_nextn_predict_layers=0"):
        _engine(tiny_model_dir)


def test_mtp_aborts_and_sampled_requests_free_its_pool(mtp_dir):
    eng = _engine(mtp_dir)
    for i, p in enumerate(_prompts()):
        eng.add_request(f"m{i}", p, SamplingParams(max_tokens=16, temperature=0.8, seed=i, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.spec.proposer.num_pages_used > 0
    eng.abort("m1")
    while eng.has_unfinished():
        eng.step()
    assert eng.spec.proposer.num_pages_used == 0 and eng.allocator.num_free == eng.allocator.num_total
