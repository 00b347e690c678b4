"""Disaggregated prefill and decode: KV connectors that plug into the engine, and the
coordinators that drive the messenger and the control channel.

    writes.py             which pages a prefill chunk completes (plan_batch); per-layer batches
    grants.py             decode side: the page ranges a prefill peer may write per request (verbs: MRs)
    range_keys.py         prefill side: the write key of the granted range each page falls in
    messages.py           every control message as a frozen dataclass: to_wire / parse (each field checked once)
    protocol.py           what the control messages mean (their type names) and the HELLO
    prompt_logprobs.py    echo + logprobs: PROMPT_LOGPROBS entries (checked against what was asked)
    jobs.py               the prefill node's job table (state machine, answers), no threads
    prefill_connector.py  PrefillConnector: a forward pass's layout -> page + hidden-state writes
    prefill_memory.py     PrefillMemory: KV regions, hidden staging rows, the layer counter, the hand-off
    prefill.py            PrefillCoordinator: control listener, messenger events, job table driver
    load.py               a prefill node's load, as its heartbeats carry it (checked on arrival)
    choice.py             PrefillChooser: prefill here or remotely, and on which prefill node
    decode_connector.py   DecodeConnector: where to prefill (admission), hidden-state rows
    decode_memory.py      DecodeMemory: what prefill nodes may write here (KV / landing ring, rows, grants)
    reservation.py        Reservation: one remote request's row, landing slots, grants, pages; one release
    decode.py             DecodeCoordinator: prefill peers, slots (immediates), counts, quarantine
    staged.py             which way KV travels (direct, staged, GPUDirect), the staging rings' shapes
    staged_prefill.py     StagedSender: a layer's pages -> copy engine -> ring slot -> writes
    staged_decode.py      Landing: writes land in ring slots, copied into the KV pages before ready
    node.py               PrefillNode / DecodeNode, build_node(cfg, engine): what the server is handed
    launcher.py           `pdkv up`: a local prefill + decode cluster as subprocesses
    metrics.py            transfer metrics of both roles

Nothing here imports ``server``: a node plugs into the engine (its connector) and the engine
loop (typed commands), and the server only serves HTTP around the node it is handed.
"""
