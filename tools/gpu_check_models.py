"""Model-level GPU checks for tools/gpu_check.py: attention parity, decode speed, disaggregation.

Each check returns ``(one-line summary, data dict)`` or raises; ``Skip`` (from gpu_check) is raised
as ``SkipCheck`` here so this module imports nothing from the runner.

- :func:`check_flashinfer_parity`: FlashInfer and the torch backend on identical bf16 caches,
  decode-only and mixed prefill/decode batches in both layouts: same outputs (bf16 tolerance),
  same cache after the writes, and FlashInfer's plan + forward issue no device-to-host sync
  (``torch.cuda.set_sync_debug_mode("error")`` raises on one).
- :func:`check_decode_roofline`: a random bf16 model shaped like Qwen2.5-0.5B (494,032,768
  parameters) decodes one token per step at a 512-token context, eager and as a captured CUDA
  graph, each with and without the layer counter bumped after every layer; compared with the HBM
  roofline, weight bytes / the device bandwidth measured in the same run.
- :func:`check_decode_graphs` (and ``_flashinfer``): the engine's decode steps through
  pdkv.engine.cuda_graphs on the GPU vs eager: equal greedy tokens, ms/step with and without the
  layer counter captured (tools/gpu_check_graphs.py).
- :func:`check_disagg_gpu`: the disaggregated equality test with KV on the GPU. SKIPPED while
  pdkv.config refuses ``model.device: cuda`` for the prefill/decode roles (its GPU wiring is not
  done); once it accepts, this runs tests/disagg/test_equality.py with PDKV_TEST_DEVICE=cuda.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Qwen/Qwen2.5-0.5B's config.json, the fields that shape the model
QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
              "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 24,
              "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
              "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
              "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21,
              "hidden_act": "silu", "torch_dtype": "bfloat16", "eos_token_id": 151643}


class SkipCheck(Exception):
    """This check cannot run here, for the stated reason (not a failure)."""


def random_model(hf_config: dict, dtype, device):
    """The family's module with random weights (normal(0, 0.02), norms 1, biases 0), rope ready."""
    import torch

    from pdkv.models.config import parse_arch_config
    from pdkv.models.registry import MODEL_REGISTRY

    arch = parse_arch_config(hf_config, "Qwen2.5-0.5B shape")
    with torch.device("meta"):
        model = MODEL_REGISTRY[arch.architecture](arch, dtype)
    if torch.device(device).type == "meta":
        return model, arch
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    model.init_rope(4096, device)
    return model.eval(), arch


def weight_bytes(model) -> int:
    """Bytes a decode step reads: every parameter once (a tied LM head reads the embedding)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def check_decode_roofline(device: int = 0, context: int = 512, steps: int = 50) -> tuple[str, dict]:
    import torch

    from pdkv.models.attention.base import AttentionBatch
    from pdkv.models.attention.torch_backend import TorchAttentionBackend
    from pdkv.gpu.layer_counter import CudaLayerCounter
    from gpu_check_copy import measure_device_bandwidth
    from pdkv.kv.cache import KVCache

    dev = torch.device("cuda", device)
    torch.cuda.set_device(dev)
    model, arch = random_model(QWEN25_05B, torch.bfloat16, dev)
    P = 16
    pages = list(range(-(-context // P)))
    cache = KVCache(arch.num_layers, len(pages), P, arch.num_kv_heads, arch.head_dim, torch.bfloat16, "HND", dev)
    backend = TorchAttentionBackend(cache, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim ** -0.5)
    meta = backend.plan(AttentionBatch([1], [context], [pages], 1))
    ids = torch.tensor([1234], device=dev)
    pos = torch.tensor([context - 1], device=dev)
    counter = CudaLayerCounter(device)
    bump = lambda layer: counter.bump()  # noqa: E731 - the runner's layer hook
    timings: dict[str, float] = {}
    try:
        with torch.inference_mode():
            def step(hook):
                return model.compute_logits(model.forward(ids, pos, backend, meta, hook))

            for name, hook in (("eager", None), ("eager_counter", bump)):
                timings[name] = _per_call(torch, lambda h=hook: step(h), steps)
            for name, hook in (("graph", None), ("graph_counter", bump)):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        step(hook)  # warm-up off the capture stream (cuBLAS handles, workspaces)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step(hook)
                timings[name] = _per_call(torch, graph.replay, steps)
                del graph
        torch.cuda.synchronize()
        bumps = counter.value()
        kind = counter.bump_kind.name
    finally:
        counter.close()
    nbytes = weight_bytes(model)
    hbm = measure_device_bandwidth(torch, device)
    roof = nbytes / hbm
    data = {"weight_bytes": nbytes, "hbm_GBps": hbm / 1e9, "roofline_ms": roof * 1e3,
            **{f"{k}_ms": v * 1e3 for k, v in timings.items()},
            **{f"{k}_of_roofline": roof / v for k, v in timings.items()},
            "graph_counter_vs_graph": timings["graph_counter"] / timings["graph"], "bump_kind": kind,
            "counter_bumps": bumps, "context": context, "device_name": torch.cuda.get_device_name(dev)}
    # eager_counter: a warm-up call + steps; graph_counter: 3 warm-ups + a warm-up replay + steps
    expected = arch.num_layers * (2 * steps + 5)
    assert bumps == expected, f"the counter reached {bumps}, expected {expected} (one per layer per step run)"
    return (f"Qwen2.5-0.5B-shaped bf16 ({nbytes / 1e9:.2f} GB of weights), context {context}: "
            f"eager {timings['eager'] * 1e3:.2f} ms/step, CUDA graph {timings['graph'] * 1e3:.2f} ms "
            f"({data['graph_of_roofline']:.0%} of the {roof * 1e3:.3f} ms HBM roofline at {hbm / 1e9:.0f} GB/s); "
            f"graph with the {kind} counter {timings['graph_counter'] * 1e3:.2f} ms "
            f"(x{data['graph_counter_vs_graph']:.3f})"), data


def _per_call(torch, fn, steps: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def _parity_batches(rng: random.Random, P: int, num_pages: int):
    from pdkv.models.attention.base import AttentionBatch

    free = list(range(num_pages))
    rng.shuffle(free)

    def seq(kv_len):
        return [free.pop() for _ in range(-(-kv_len // P))]

    dec = [rng.randint(1, 300) for _ in range(6)]
    yield "decode", AttentionBatch([1] * 6, dec, [seq(n) for n in dec], 6)
    free[:] = list(range(num_pages))
    rng.shuffle(free)
    kv = [rng.randint(1, 300) for _ in range(3)] + [200, 64, 137]
    q = [1, 1, 1, 200, 17, 40]  # a first chunk, and two later chunks over earlier keys
    yield "mixed", AttentionBatch(q, kv, [seq(n) for n in kv], 3)


def check_flashinfer_parity(device: int = 0) -> tuple[str, dict]:
    import torch

    try:
        import flashinfer  # noqa: F401
    except ImportError as e:
        raise SkipCheck(f"flashinfer is not installed ({e}); `pip install flashinfer-python ninja` "
                        "(docs/GPU.md)") from None
    from pdkv.models.attention.flashinfer_backend import FlashInferBackend
    from pdkv.models.attention.torch_backend import TorchAttentionBackend
    from pdkv.kv.cache import KVCache

    dev = torch.device("cuda", device)
    Hq, Hkv, D, P, num_pages = 16, 2, 128, 16, 256
    rng, worst, cases = random.Random(19), 0.0, []
    for layout in ("HND", "NHD"):
        caches = [KVCache(1, num_pages, P, Hkv, D, torch.bfloat16, layout, dev) for _ in range(2)]
        caches[0].layer(0).normal_()
        caches[1].layer(0).copy_(caches[0].layer(0))
        ref = TorchAttentionBackend(caches[0], Hq, Hkv, D, D ** -0.5)
        try:
            fib = FlashInferBackend(caches[1], Hq, Hkv, D, D ** -0.5)
        except Exception as e:  # noqa: BLE001 - building needs the JIT toolchain the first time
            _skip_without_toolchain(e)
            raise
        for name, batch in _parity_batches(rng, P, num_pages):
            T = batch.num_tokens
            q = torch.randn(T, Hq, D, device=dev, dtype=torch.bfloat16)
            k, v = (torch.randn(T, Hkv, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
            want = ref.forward(0, q, k, v, ref.plan(batch))
            try:
                fib.forward(0, q, k, v, fib.plan(batch))  # first run: JIT builds, may sync; not checked
            except Exception as e:  # noqa: BLE001
                _skip_without_toolchain(e)
                raise
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # from here a device-to-host sync raises
            try:
                got = fib.forward(0, q, k, v, fib.plan(batch))
            finally:
                torch.cuda.set_sync_debug_mode("default")
            err = float((got.float() - want.float()).abs().max())
            scale = float(want.float().abs().max())
            worst = max(worst, err)
            cases.append({"layout": layout, "batch": name, "tokens": T, "max_abs_err": err})
            assert err <= 2e-2 + 1e-2 * scale, f"{layout} {name}: flashinfer differs from torch by {err} (max |out| {scale})"
            assert torch.equal(caches[0].layer(0), caches[1].layer(0)), f"{layout} {name}: the caches differ after the writes"
    return (f"{len(cases)} batches (HND/NHD x decode/mixed, bf16, GQA 16/2, head_dim 128): max |flashinfer - torch| "
            f"{worst:.4f}; plan + forward ran with no device-to-host sync"), {"cases": cases, "max_abs_err": worst}


def _skip_without_toolchain(error: Exception) -> None:
    import shutil

    missing = [tool for tool in ("nvcc", "ninja") if shutil.which(tool) is None]
    if missing and not os.environ.get("CUDA_HOME"):
        raise SkipCheck(f"FlashInfer could not build its kernels ({type(error).__name__}: {str(error)[:200]}); "
                        f"its JIT needs {' and '.join(missing)}, not found on PATH (docs/GPU.md: pre-warming)") from None


def check_disagg_gpu(timeout: float = 240.0) -> tuple[str, dict]:
    """A prefill and a decode process sharing the GPU, tcp + staging, tokens equal colocated
    (tools/gpu_check_disagg.py; ``--dry-run`` runs the same flow on the CPU copy engine)."""
    import gpu_check_disagg  # noqa: PLC0415 - tools/ is on sys.path (gpu_check.py)

    return gpu_check_disagg.run_disagg(os.environ.get("PDKV_GPU_CHECK_DEVICE", "cuda"), timeout)


def check_sm_split() -> tuple[str, dict]:
    """Two role processes on one GPU, every SM shared vs split by parallel.gpu_sm_percent
    (tools/gpu_check_sm_split.py; SKIP naming what is missing without MPS or green contexts)."""
    import gpu_check_sm_split  # noqa: PLC0415 - tools/ is on sys.path (gpu_check.py)

    return gpu_check_sm_split.run_sm_split(os.environ.get("PDKV_GPU_CHECK_DEVICE", "cuda"))


def check_weights_ipc() -> tuple[str, dict]:
    """model.share_weights on on the GPU: a second process attaches to the owner's weights through
    CUDA IPC and outlives it (tools/gpu_check_weights.py)."""
    import gpu_check_weights  # noqa: PLC0415 - tools/ is on sys.path (gpu_check.py)

    return gpu_check_weights.run_weights_ipc(os.environ.get("PDKV_GPU_CHECK_DEVICE", "cuda:0"))


def check_decode_graphs() -> tuple[str, dict]:
    """The engine's decode steps under CUDA graphs vs eager, with and without the layer counter
    (tools/gpu_check_graphs.py; ``--dry-run``: the CPU stand-in capture)."""
    import gpu_check_graphs  # noqa: PLC0415 - tools/ is on sys.path (gpu_check.py)

    return gpu_check_graphs.run_graphs(os.environ.get("PDKV_GPU_CHECK_DEVICE", "cuda"))


def check_structured_masks() -> tuple[str, dict]:
    """Structured output's masks on the device (tools/gpu_check_structured.py; ``--dry-run``:
    the same torch ops on the CPU)."""
    import gpu_check_structured  # noqa: PLC0415 - tools/ is on sys.path (gpu_check.py)

    return gpu_check_structured.run_structured(os.environ.get("PDKV_GPU_CHECK_DEVICE", "cuda"))


def check_decode_graphs_flashinfer() -> tuple[str, dict]:
    """The same with attention_backend flashinfer (its use_cuda_graph decode wrappers)."""
    try:
        import flashinfer  # noqa: F401
    except ImportError as e:
        raise SkipCheck(f"flashinfer is not installed ({e})") from None
    import gpu_check_graphs  # noqa: PLC0415

    try:
        return gpu_check_graphs.run_graphs("cuda", backend="flashinfer", steps=20)
    except Exception as e:  # noqa: BLE001 - the first use builds kernels with the JIT toolchain
        _skip_without_toolchain(e)
        raise
