"""The disagg-shm architecture: configs/ab/disagg.yaml on the shm transport with shared weights."""
from __future__ import annotations

from pdkv.bench.ab import archs as A
from pdkv.config import load_config


def test_disagg_shm_is_disagg_with_shm_and_shared_weights(tmp_path):
    import yaml

    shm, tcp = A.builtin("disagg-shm"), A.builtin("disagg")
    assert (shm.kind, shm.num_prefill, shm.num_decode) == (tcp.kind, tcp.num_prefill, tcp.num_decode)
    nodes = A.node_specs(shm, [0, 1])
    assert [n.role for n in nodes] == ["prefill", "decode"]
    for n in nodes:  # each node's role config is valid, and differs from disagg's only there
        n.config.setdefault("messenger", {})["prefill_peers"] = ["127.0.0.1:1"]
        f = tmp_path / f"{n.name}.yaml"
        f.write_text(yaml.safe_dump(n.config))
        cfg = load_config(f)
        assert (cfg.messenger.transport, cfg.model.share_weights) == ("shm", "auto")
    plain = {n.role: n.config for n in A.node_specs(tcp, [0, 1])}
    for n in nodes:
        a, b = dict(n.config), dict(plain[n.role])
        a["messenger"] = {k: v for k, v in a["messenger"].items() if k not in ("transport", "prefill_peers")}
        b["messenger"] = {k: v for k, v in b["messenger"].items() if k not in ("transport", "prefill_peers")}
        a["model"] = {k: v for k, v in a["model"].items() if k != "share_weights"}
        assert a == b
