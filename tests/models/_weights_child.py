"""A child process of test_shared_weights.py: ``owner DIR`` or ``attach DIR``; prints JSON lines."""
import json
import sys

import torch

from pdkv.config import load_config
from pdkv.engine import LLMEngine, SamplingParams
from pdkv.engine.factory import _fingerprint
from pdkv.models.loader import load_model
from pdkv.shared_weights import WeightShare, load_shared

PROMPTS = [list(range(3, 20)), [7] * 9, list(range(100, 131))]


def anon_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise RuntimeError("no RssAnon in /proc/self/status")


def say(**kw):
    print(json.dumps(kw), flush=True)


def tokens(path: str) -> list:
    cfg = load_config(overrides=[f"model.path={path}", "model.share_weights=auto", "kv_cache.page_size=4",
                                 "kv_cache.num_pages=64"])
    eng = LLMEngine.from_config(cfg, num_threads=1)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    return [o.output_token_ids for o in outs], eng


def warm_up(path: str) -> None:
    """What any load pays once per process, weights aside (torch's meta-device machinery, ~48 MB
    of imports here), so that the measurement below is the weights' cost alone."""
    from pdkv.models.config import parse_arch_config
    from pdkv.models.loader import read_json
    from pdkv.models.registry import MODEL_REGISTRY

    from pathlib import Path

    arch = parse_arch_config(read_json(Path(path) / "config.json"), path)
    with torch.device("meta"):
        MODEL_REGISTRY[arch.architecture](arch, torch.float32)
    float(torch.ones(1000).sum())


def main() -> None:
    torch.set_num_threads(1)
    role, path = sys.argv[1], sys.argv[2]
    warm_up(path)
    before = anon_kib()
    if role == "owner":  # a private load (what every process paid before), then served
        loaded = load_model(path, "float32", "cpu", 256)
        grew = anon_kib() - before
        keep = WeightShare(loaded.model, _fingerprint(loaded))
        size = keep.size
    else:
        loaded, keep = load_shared(path, "float32", "cpu", 256, None, True, _fingerprint)
        size = len(keep) if keep is not None and not hasattr(keep, "thread") else -1  # -1: not attached
    for p in loaded.model.parameters():  # fault every weight page in
        float(p.sum())
    say(role=role, anon_kib=grew if role == "owner" else anon_kib() - before, weight_bytes=size)
    got, eng = tokens(path)
    say(tokens=got)
    for line in sys.stdin:  # "again": generate once more (after the owner was killed)
        got = eng.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        say(tokens=[o.output_token_ids for o in got])


if __name__ == "__main__":
    main()
