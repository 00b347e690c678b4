"""The parts without servers: the hash ring, the prefix key, the load bound, the router config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdkv.config import ConfigError
from pdkv.config.router import load_router_config
from pdkv.router.nodes import Node, NodeHealth
from pdkv.router.policy import Choice, HashRing, Policy, prefix_key

ROOT = Path(__file__).resolve().parents[2]


def test_ring_moves_only_the_keys_of_a_node_that_leaves():
    ring = HashRing(64)
    members = [f"http://127.0.0.1:{8000 + i}" for i in range(3)]
    keys = [f"conversation {i}" for i in range(600)]
    before = {k: ring.owner(members, k) for k in keys}
    shares = [list(before.values()).count(m) for m in members]
    assert min(shares) > 120, shares  # 64 points per node: no node far below a third
    after = {k: ring.owner(members[:2], k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == members[2] for k in moved)  # only the leaver's keys moved
    assert {k: ring.owner(members, k) for k in keys} == before  # and they come back with it


def test_prefix_key_of_completions_and_chat():
    assert prefix_key({"prompt": "abcdef"}, 3) == "abc"
    assert prefix_key({"prompt": ["xyz", "q"]}, 2) == "xy"
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hello"}]}
    longer = {"messages": chat["messages"] + [{"role": "assistant", "content": "hi"}]}
    assert prefix_key(chat, 64) == "system:S\nuser:hello\n"
    assert prefix_key(longer, 12) == prefix_key(chat, 12)  # the next turn hashes like the first
    assert prefix_key({"max_tokens": 3}, 10) is None


def _nodes(loads):
    out = []
    for i, load in enumerate(loads):
        n = Node(f"http://n{i}:1", health=NodeHealth.UP)
        n.in_flight = load
        out.append(n)
    return out


def test_the_affine_node_is_kept_until_its_load_exceeds_the_mean_by_the_bound():
    p = Policy("cache_aware", 64, balance_abs=2)
    nodes = _nodes([0, 0, 0])
    owner, how = p.choose(nodes, "a conversation")
    assert how is Choice.AFFINE
    owner.in_flight = 3  # mean 1, bound 1 + 2 = 3: still kept
    assert p.choose(nodes, "a conversation") == (owner, Choice.AFFINE)
    owner.in_flight = 4  # mean 1.33, bound 3.33: passed over for the least loaded
    node, how = p.choose(nodes, "a conversation")
    assert how is Choice.OVERLOADED and node is not owner and node.load == 0


def test_router_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="nodes must list at least one node URL"):
        load_router_config(None)
    with pytest.raises(ConfigError, match=r"entries must be http://HOST:PORT .* got 'localhost:8001'"):
        load_router_config(None, ["nodes=[localhost:8001]"])
    f = tmp_path / "r.yaml"
    f.write_text("nodes: [http://127.0.0.1:1]\nbalance: 3\n")
    with pytest.raises(ConfigError, match=f"{f}: unknown field balance"):
        load_router_config(f)
    r = subprocess.run([sys.executable, "-m", "pdkv", "router", "-c", str(ROOT / "configs" / "router.yaml"),
                        "--set", "policy=random"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "policy must be one of cache_aware, least_load, round_robin, got 'random'" in r.stderr
