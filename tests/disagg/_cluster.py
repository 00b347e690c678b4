"""In-process disaggregated clusters: a prefill node and a decode node on loopback (tcp), each an
aiohttp app on its own thread with its own engine and messenger (real sockets, real HTTP)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

from pdkv.config import config_from_dict
from pdkv.server.app import NODE


def post_completion(url, body, timeout=30, headers=False):
    """POST /v1/completions -> (HTTP status, JSON body), errors included; with ``headers``
    (HTTP status, JSON body, response headers)."""
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        out = e.code, json.loads(e.read()), e.headers
    return out if headers else out[:2]


def node_config(model_dir, role: str, **over):
    """A small config for ``role``; ``over``: dotted overrides like messenger__lease_s=2. A decode
    node sends every multi-token prompt to its prefill node (disagg__local_prefill_max_tokens=0)
    unless ``over`` says otherwise."""
    d = {"role": role, "model": {"path": str(model_dir)},
         "kv_cache": {"page_size": 4, "num_pages": 64},
         "scheduler": {"max_num_batched_tokens": 64, "chunk_size": 16, "max_num_seqs": 8},
         "server": {"port": 0},
         "messenger": {"heartbeat_s": 0.2, "lease_s": 1.5, "transfer_timeout_s": 20.0,
                       "connect_timeout_s": 10.0}}
    if role == "decode":  # these tests exercise the transfer: every multi-token prompt goes remote
        d["disagg"] = {"local_prefill_max_tokens": 0}
    for k, v in over.items():
        sec, _, name = k.partition("__")
        d.setdefault(sec, {})[name] = v
    return config_from_dict(d)


def serve_node(cfg, engine, node=None):
    """A ServerThread (not started) around the node of ``cfg.role`` (pdkv.disagg.node.build_node)."""
    from pdkv.disagg.node import build_node
    from pdkv.server.runner import ServerThread

    return ServerThread(cfg, engine, node or build_node(cfg, engine))


def make_engine(cfg):
    from pdkv.disagg.node import kv_buffer_factory
    from pdkv.engine import LLMEngine

    return LLMEngine.from_config(cfg, kv_buffer=kv_buffer_factory("cpu"), num_threads=1)


class Cluster:
    """prefill + decode ServerThreads; ``.url`` is the decode node's API."""

    def __init__(self, model_dir, prefill_over=None, decode_over=None, prefill_faults=(), decode_engine=make_engine,
                 prefill_engine=make_engine):
        """``prefill_faults``: (kind, first, count, delay_us) applied to the prefill node's writes;
        given, both nodes run on the FAKE in-process transport (fault injection), else on tcp.
        ``decode_engine(cfg)`` / ``prefill_engine(cfg)``: the nodes' engines (e.g. a DP group or
        a TP group, tests/dp)."""
        from pdkv.disagg.node import DecodeNode, PrefillNode
        from pdkv.server.runner import ServerThread

        pfactory = dfactory = None  # None: the nodes open a real tcp messenger
        if prefill_faults:
            from pdkv._messenger import Messenger

            def pfactory(cfg, node_id):
                m = Messenger("fake", node_id)
                for f in prefill_faults:
                    m.add_fault(*f)
                return m

            def dfactory(cfg, node_id):
                return Messenger("fake", node_id)

        pcfg = node_config(model_dir, "prefill", **(prefill_over or {}))
        self.prefill_engine = prefill_engine(pcfg)
        self.prefill = ServerThread(pcfg, self.prefill_engine,
                                    PrefillNode(pcfg, self.prefill_engine, pfactory)).start()
        port = self.prefill.app[NODE].control_port
        dcfg = node_config(model_dir, "decode", messenger__prefill_peers=[f"127.0.0.1:{port}"],
                           **(decode_over or {}))
        self.decode_engine = decode_engine(dcfg)
        self.decode = ServerThread(dcfg, self.decode_engine,
                                   DecodeNode(dcfg, self.decode_engine, messenger_factory=dfactory)).start()
        self.url = self.decode.url
        self.coordinator = self.decode.app[NODE].coordinator

    def stop(self):
        self.decode.stop()
        self.prefill.stop()

    def model_name(self) -> str:
        import json
        import urllib.request

        return json.loads(urllib.request.urlopen(self.url + "/v1/models").read())["data"][0]["id"]

    def pools_full(self) -> bool:
        a, b = self.prefill_engine.allocator, self.decode_engine.allocator
        return a.num_free == a.num_total and b.num_free == b.num_total


def wait_for(pred, timeout: float = 10.0, what: str = "condition") -> None:
    import time

    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.02)


def colocated_tokens(model_dir, prompt, max_tokens: int) -> list[int]:
    """Greedy token ids of a colocated engine for ``prompt`` (the reference for disaggregated)."""
    from pdkv.engine import SamplingParams

    eng = make_engine(node_config(model_dir, "colocated"))
    (out,) = eng.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return out.output_token_ids


def read_kv(cache, pages, num_tokens: int) -> list:
    """The KV of a request's first ``num_tokens`` positions, read page by page in its logical
    order (``pages``), per layer as one [2, num_tokens, heads, head_dim] tensor whatever the layout."""
    idx = list(pages)
    out = []
    for i in range(cache.num_layers):
        t = cache.layer(i)[idx].clone()  # HND [n, 2, H, P, D] | NHD [n, 2, P, H, D]
        if cache.layout == "HND":
            t = t.permute(1, 0, 3, 2, 4)  # [2, n, P, H, D]
        else:
            t = t.permute(1, 0, 2, 3, 4)
        out.append(t.reshape(t.shape[0], -1, *t.shape[3:])[:, :num_tokens])
    return out


def colocated_kv(model_dir, prompts, **over) -> dict:
    """prompt tuple -> read_kv of a colocated engine, taken right after the forward pass that
    wrote the prompt's last position (``over``: config overrides, as for node_config)."""
    from pdkv.engine import SamplingParams

    eng = make_engine(node_config(model_dir, "colocated", **over))
    got = {}

    def listen(batch, hidden):
        for e in batch.entries:
            r = e.request
            if e.start + e.num_tokens == r.num_prompt_tokens:
                got[tuple(r.prompt_token_ids)] = read_kv(eng.kv, r.pages, r.num_prompt_tokens)
    eng.connector.after_forward = listen  # the colocated engine's no-op connector, observed
    eng.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return got


def keep_landed_hidden(coordinator) -> dict:
    """rid -> a copy of the hidden row of each request whose KV lands from now on (the decode
    coordinator's ``on_landed``; the serving path copies nothing without it)."""
    rows = {}
    coordinator.on_landed = lambda rid, row: rows.__setitem__(rid, row.clone())
    return rows


def hold_kv_on_landing(coordinator, engine, caches=None) -> dict:
    """Wraps a decode coordinator's engine commands: when a request's KV has landed, before the
    engine hears RemoteKVReady (so before its last prompt token runs), read its pages from every
    cache in ``caches`` (default: the engine's own). Returns rid -> (prompt, [read_kv per cache]);
    ``.restore()`` on the returned dict puts the coordinator's own commands back."""
    from pdkv.engine.loop import RemoteKVReady

    caches = caches or [engine.kv]
    put, conn = coordinator.commands, engine.connector
    admit, admitted = conn.admit, {}

    class Seen(dict):
        def restore(self):
            coordinator.commands, conn.admit = put, admit
    seen = Seen()

    def on_admit(req):  # engine thread, before the connector posts PREFILL (so before any landing)
        admitted[req.request_id] = req
        return admit(req)

    def commands(cmd):
        # NOTE: not engine.requests: the KV can land before add_request has filed the request
        req = admitted.get(cmd.request_id) if isinstance(cmd, RemoteKVReady) else None
        if req is not None:  # parked in WAITING_FOR_REMOTE_KV: nothing writes its pages
            n = req.num_prompt_tokens - 1
            seen[cmd.request_id] = (tuple(req.prompt_token_ids), [read_kv(c, req.pages, n) for c in caches])
        put(cmd)
    coordinator.commands, conn.admit = commands, on_admit
    return seen


_COLOCATED: dict = {}


def assert_colocated_answer(url, name, model_dir, prompt, max_tokens: int) -> None:
    """POST a greedy request and assert its token ids equal the colocated engine's (cached per prompt)."""
    key = (str(model_dir), tuple(prompt), max_tokens)
    if key not in _COLOCATED:
        _COLOCATED[key] = colocated_tokens(model_dir, list(prompt), max_tokens)
    status, body = post_completion(url, {"model": name, "prompt": list(prompt), "max_tokens": max_tokens,
                                         "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == _COLOCATED[key], (prompt, body)
