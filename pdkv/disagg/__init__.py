"""Disaggregated prefill and decode: the coordinators that drive the engine and the messenger.

    writes.py         which pages a prefill chunk completes; per-layer batches on the layer counter
    protocol.py       control messages (PREFILL, CANCEL, CANCEL_ACK, FAIL, DONE_AT) and the HELLO
    prefill.py        PrefillCoordinator: control listener, engine thread, page + hidden-state writes
    decode.py         DecodeCoordinator: prefill peers, slots (immediates), counts, quarantine
    decode_engine.py  DecodeAsyncEngine: server.AsyncEngine + remote-KV admission
    node.py           PrefillNode / DecodeNode (start/stop with their aiohttp app), build_prefill_app
    launcher.py       `pdkv up`: a local prefill + decode cluster as subprocesses
    metrics.py        transfer metrics of both roles
"""
