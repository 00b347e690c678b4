"""A request's scheduler priority travels in PREFILL: a prefill node that schedules by priority
queues the prompt with the decode node's value, one running fcfs queues it at 0 (a priority
there would be refused: the decode node's policy is not the prefill node's). /load counts the
requests that wait for admission as waiting."""
from __future__ import annotations

import json
import urllib.request

import pytest

from pdkv.engine.loop import AddRequest
from pdkv.server.app import NODE

from _cluster import Cluster, post_completion, wait_for


def _capture_adds(coordinator) -> list:
    """The AddRequest commands the prefill coordinator gives its engine loop (the real loop runs them)."""
    seen, put = [], coordinator.commands

    def commands(cmd):  # the event loop's thread
        if isinstance(cmd, AddRequest):
            seen.append(cmd.priority)
        put(cmd)
    coordinator.commands = commands
    return seen


@pytest.mark.parametrize("prefill_policy,want", [("priority", [-4, 9]), ("fcfs", [0, 0])])
def test_priority_reaches_a_prefill_node_that_schedules_by_it(tiny_model_dir, prefill_policy, want):
    c = Cluster(tiny_model_dir, prefill_over={"scheduler__policy": prefill_policy},
                decode_over={"scheduler__policy": "priority"})
    try:
        seen = _capture_adds(c.prefill.app[NODE].coordinator)
        name = c.model_name()
        for first, prio in ((3, -4), (40, 9)):  # distinct prompts: no prefix-cache hit keeps one local
            status, body = post_completion(c.url, {"model": name, "prompt": list(range(first, first + 17)),
                                                   "max_tokens": 3,
                                                   "temperature": 0, "priority": prio})
            assert status == 200, body
            assert body["usage"]["completion_tokens"] == 3
        assert seen == want
        load = json.loads(urllib.request.urlopen(c.url + "/load").read())
        assert load["num_pending"] == 0 and load["num_waiting"] == 0
        wait_for(c.pools_full, 10, "both page pools back to full")
    finally:
        c.stop()
