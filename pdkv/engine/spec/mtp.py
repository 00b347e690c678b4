"""The ``mtp`` proposer: a DeepSeek-V3-style multi-token-prediction module drafting from the
target's own hidden states (DeepSeek-V3 report, section 2.2):

    h'_p = eh_proj([enorm(Emb(t_{p+1})) ; hnorm(h_p)])      h_p: the target's final hidden state
    o_p  = TransformerBlock(h'_p)                            one decoder layer, its own paged KV
    P(t_{p+2}) = softmax(Head(shared_head.norm(o_p)))        the target's embedding and LM head

The module is the checkpoint's extra layer ``model.layers.{num_hidden_layers}`` (config.json
``num_nextn_predict_layers``), which the target's loader skips. Its KV at position p needs h_p
and t_{p+1}: ``observe`` feeds every position whose pair is known after each step (prompt
positions as their prefill chunks run, accepted positions after a verification) from the step's
hidden states (pdkv.engine.runner ``last_forward``, what the connector's after_forward sees);
``propose`` then drafts k tokens by running the module on its own output (o_p as the next h),
as SGLang and vLLM do with one MTP layer. Draft positions' KV is overwritten next step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from pdkv.models.cpu_kernels import linear
from pdkv.config import ConfigError, SpeculativeConfig
from pdkv.engine.request import Request
from pdkv.engine.spec.paged import PagedProposer
from pdkv.kv import KVCache


NUM_MTP_LAYERS = 1  # drafts chain the checkpoint's first MTP layer (SGLang's and vLLM's default)


class MTPModule(nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        from pdkv.models.layers import DecoderLayer, RMSNorm  # noqa: PLC0415

        H = cfg.hidden_size
        self.enorm, self.hnorm = RMSNorm(H, cfg.rms_norm_eps, dtype), RMSNorm(H, cfg.rms_norm_eps, dtype)
        self.eh_proj = nn.Linear(2 * H, H, bias=False, dtype=dtype)
        self.layer = DecoderLayer(cfg, dtype)
        self.head_norm = RMSNorm(H, cfg.rms_norm_eps, dtype)

    def forward(self, embeds, h_prev, cos, sin, backend, meta) -> torch.Tensor:
        """embeds, h_prev: [T, H] → o [T, H] (before the head's norm)."""
        x = linear(torch.cat([self.enorm.forward(embeds), self.hnorm.forward(h_prev)], -1), self.eh_proj.weight)
        return self.layer.forward(0, x, cos, sin, backend, meta, None)


def load_mtp(path: Path, arch, dtype, device, cpu_kernels: bool = True) -> MTPModule:
    """The first MTP layer of the checkpoint at ``path`` (q/k/v and gate/up fused as the target's),
    its weights laid out as the loader lays out the target's (models/loader.py)."""
    from pdkv.models.loader import (CPU_KERNELS_AVAILABLE, disable_cpu_kernels, transpose_linear_weights,  # noqa: PLC0415
                               weight_files)
    from safetensors import safe_open  # noqa: PLC0415

    prefix = f"model.layers.{arch.num_layers}."
    t = {}
    for f in weight_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as h:
            t.update({k[len(prefix):]: h.get_tensor(k) for k in h.keys() if k.startswith(prefix)})
    fp8 = sorted(k for k, v in t.items() if v.dtype == getattr(torch, "float8_e4m3fn", None))
    if fp8:  # copying them as plain values would drop their block scales
        raise ConfigError(f"{path}: MTP layer tensor {prefix}{fp8[0]} is FP8 (block-quantized); "
                          "speculative.method mtp loads bf16 / float32 MTP layers only")
    cfg1 = dataclasses.replace(arch, num_layers=1)
    with torch.device("meta"):
        m = MTPModule(cfg1, dtype)
    m = m.to_empty(device=device)
    a, mlp = "self_attn.", "mlp."
    want = {"enorm.weight": t.get("enorm.weight"), "hnorm.weight": t.get("hnorm.weight"),
            "eh_proj.weight": t.get("eh_proj.weight"), "head_norm.weight": t.get("shared_head.norm.weight")}
    for n in ("input_layernorm.weight", "post_attention_layernorm.weight", a + "o_proj.weight", mlp + "down_proj.weight"):
        want["layer." + n] = t.get(n)
    qkv = [t.get(a + f"{x}_proj.weight") for x in "qkv"]
    gu = [t.get(mlp + f"{x}_proj.weight") for x in ("gate", "up")]
    want["layer.self_attn.qkv_proj.weight"] = torch.cat(qkv) if all(x is not None for x in qkv) else None
    want["layer.mlp.gate_up_proj.weight"] = torch.cat(gu) if all(x is not None for x in gu) else None
    params = dict(m.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if want.get(name) is None or tuple(want[name].shape) != tuple(p.shape):
                raise ConfigError(f"{path}: MTP layer {prefix}* lacks or misshapes the tensor for {name}")
            p.copy_(want[name].to(dtype))
    if torch.device(device).type == "cpu" and not (cpu_kernels and CPU_KERNELS_AVAILABLE):
        transpose_linear_weights(m)
        disable_cpu_kernels(m)
    return m.eval()


@dataclass
class _MTPState:
    num_valid: int = 0  # positions whose KV was fed a real (h_p, t_{p+1}) pair
    pages: list[int] = field(default_factory=list)
    last: torch.Tensor | None = None  # o at position num_valid - 1: drafts t_{num_valid + 1}


class MTPProposer(PagedProposer):
    def __init__(self, module: MTPModule, target, backend, kv: KVCache, k: int, device):
        # handoff(req) -> (pages, n - 1, o [H]): the MTP KV of req's prompt positions 0..n-2 and
        # o_{n-2}, computed by the prefill node
        super().__init__(kv)
        self.module, self.target, self.backend, self.k = module, target, backend, k
        self.device = torch.device(device)
        self.states: dict[str, _MTPState] = {}

    @classmethod
    def build(cls, sc: SpeculativeConfig, parts) -> MTPProposer:
        from pdkv.models.attention import get_backend  # noqa: PLC0415

        # the whole model's shapes: with tensor parallelism (a prefill node's hand-off) rank 0
        # runs the one MTP layer alone, unsharded
        arch, path = parts.loaded.full_arch or parts.loaded.arch, parts.loaded.path
        if arch.num_nextn_predict_layers < 1:
            raise ConfigError(f"speculative.method mtp needs a checkpoint with MTP layers: {path}/config.json "
                              f"has num_nextn_predict_layers={arch.num_nextn_predict_layers}")
        mc = parts.model_config
        module = load_mtp(Path(path), arch, parts.loaded.dtype, torch.device(mc.device), mc.cpu_kernels)
        kv = KVCache(NUM_MTP_LAYERS, parts.kv.num_pages, parts.kv.page_size, arch.num_kv_heads, arch.head_dim,
                     parts.loaded.dtype, parts.kv.layout, torch.device(mc.device))
        backend = get_backend(mc.attention_backend)(kv, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                                    arch.head_dim ** -0.5, arch.sliding_window)
        backend.use_cpu_kernel &= mc.cpu_kernels
        return cls(module, parts.loaded.model, backend, kv, sc.num_tokens, mc.device)

    def run_over(self, items) -> list[torch.Tensor]:
        """items: (page ids, first position, token ids [n], h [n, H]) → each one's o [n, H]; the
        module's KV for those positions goes into the given pages of this cache (a prefill node's
        hand-off: its MTP pages are the request's own target page ids)."""
        return self._run([(_MTPState(pages=list(p)), start, toks, h) for p, start, toks, h in items])

    def _adopt(self, req: Request) -> _MTPState | None:
        """The state the prefill node computed for ``req`` (positions 0..n-2 and o_{n-2}), if any."""
        got = self.handoff(req) if self.handoff is not None else None
        if got is None:
            return None
        pages, num_valid, last = got
        st = self.states[req.request_id] = _MTPState(num_valid, list(pages), last.to(self.device).reshape(1, -1))
        if not self._grow_to(st, st.num_valid + self.k):
            st.last = None  # no room for the drafts' KV now: no drafts until observe finds some
        return st

    def _run(self, items) -> list[torch.Tensor]:
        """items: (state, first position, token ids [n], h [n, H]) → each one's o rows [n, H]."""
        from pdkv.models.attention import AttentionBatch  # noqa: PLC0415

        order = sorted(range(len(items)), key=lambda j: items[j][2].shape[0] != 1)  # decodes first
        toks = torch.cat([items[j][2] for j in order])
        h = torch.cat([items[j][3] for j in order])
        pos = torch.cat([torch.arange(items[j][1], items[j][1] + items[j][2].shape[0]) for j in order])
        batch = AttentionBatch([items[j][2].shape[0] for j in order],
                               [items[j][1] + items[j][2].shape[0] for j in order],
                               [items[j][0].pages for j in order], sum(1 for j in order if items[j][2].shape[0] == 1))
        meta = self.backend.plan(batch)
        cos, sin = self.target.rotary.table(pos.to(self.device), h.dtype)
        o = self.module.forward(self.target.model.embed_tokens(toks.to(self.device)), h, cos, sin, self.backend, meta)
        out, row = [None] * len(items), 0
        for j in order:
            n = items[j][2].shape[0]
            out[j], row = o[row:row + n], row + n
        return out

    def _draft(self, o: torch.Tensor) -> list[int]:
        return self.target.compute_logits(self.module.head_norm.forward(o)).argmax(-1).tolist()

    @torch.inference_mode()
    def observe(self, layout, hidden) -> None:
        """Feeds the module every (h_p, t_{p+1}) pair the step's forward pass made known."""
        items = []
        for e in layout.entries:
            req = e.request
            if req.status.is_done or req.prefill_only:
                continue
            st = self.states.setdefault(req.request_id, _MTPState())
            st.num_valid = min(st.num_valid, e.start)  # recomputed or rolled-back positions
            end = min(e.start + e.num_tokens, req.num_computed_tokens, req.num_tokens - 1)
            if st.num_valid < e.start or end <= st.num_valid or not self._grow_to(st, end + self.k):
                continue  # a gap (no hidden state for it) or nothing new: no drafts from it
            lo = st.num_valid
            h = hidden[e.row + lo - e.start:e.row + end - e.start]
            toks = torch.tensor(req.token_ids(lo + 1, end + 1), dtype=torch.long)
            items.append((st, lo, toks, h))
        if not items:
            return
        for (st, lo, toks, _), o in zip(items, self._run(items)):
            st.num_valid, st.last = lo + toks.shape[0], o[-1:]

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        live = []
        for i, req in enumerate(requests):
            st = self.states.get(req.request_id) or self._adopt(req)
            if st is None or st.last is None or st.num_valid != req.num_computed_tokens:
                continue
            drafts[i].append(self._draft(st.last)[0])
            live.append((i, st, st.last))
        for step in range(1, max(num_drafts)):
            live = [(i, st, o) for i, st, o in live if len(drafts[i]) < num_drafts[i]]
            if not live:
                break
            outs = self._run([(st, st.num_valid + step - 1, torch.tensor([drafts[i][-1]]), o)
                              for i, st, o in live])
            nxt = self._draft(torch.cat(outs))
            live = [(i, st, o) for (i, st, _), o in zip(live, outs)]
            for (i, _, _), t in zip(live, nxt):
                drafts[i].append(t)
        return drafts
