"""Finding 3: every per-request resource is reserved at admission, so many concurrent clients
against a disaggregated pair all get their answers (nobody a 500 while pages are free): more
clients than the decode node has hidden-state rows (64) wait for one instead of failing."""

import asyncio

import aiohttp
from _cluster import Cluster, wait_for

N_CLIENTS = 100


def test_more_clients_than_hidden_rows_all_succeed(tiny_model_dir):
    over = {"kv_cache__num_pages": 1024, "scheduler__max_num_seqs": 32}
    c = Cluster(tiny_model_dir, prefill_over=over, decode_over=over)
    try:
        assert c.coordinator.rows.num_rows < N_CLIENTS
        name = c.model_name()
        rows, refused = c.coordinator.rows, []
        take = rows.take

        def counting_take():  # observes (does not change) how often a request had to wait for a row
            row = take()
            if row is None:
                refused.append(1)
            return row
        rows.take = counting_take

        async def one(s, i):
            body = {"model": name, "prompt": list(range(5 + i % 7, 25 + i % 7)), "max_tokens": 3, "temperature": 0}
            async with s.post(c.url + "/v1/completions", json=body) as r:
                return r.status, await r.json()

        async def main():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                             connector=aiohttp.TCPConnector(limit=N_CLIENTS)) as s:
                return await asyncio.gather(*(one(s, i) for i in range(N_CLIENTS)))
        results = asyncio.run(main())
        bad = [(st, b) for st, b in results if st != 200]
        assert not bad, bad[:3]
        assert all(b["usage"]["completion_tokens"] == 3 for _, b in results)
        wait_for(c.pools_full, 15, "every page back in both pools")
        assert refused, "no request ever waited for a hidden-state row: the test did not load the rows"
        wait_for(lambda: len(rows._free) == rows.num_rows, 10, "every hidden-state row back")
    finally:
        c.stop()
