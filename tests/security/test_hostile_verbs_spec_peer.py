"""An authenticated but hostile mtp prefill peer (_verbs_impostor.py MODE spec) of a real mtp
decode node on the loopback verbs device: the decode node grants each request's proposer
pages as MRs of their own in the peer's protection domain (pdkv/disagg/spec_handoff.py), so a
proposer write outside its range under the range's own key, or under CONNECT's ``spec_key``,
gets a remote access error and lands nothing; the decode node fails the request, keeps no
grant and no page, and redials."""
from __future__ import annotations

import json
import time
import urllib.request

import pytest
from _cluster import post_completion, wait_for
from _procs import NodeProc, free_port, node_dict
from test_hostile_verbs_peer import Impostor

from pdkv.auth import write_secret_file


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    from pdkv.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("mtp"), seed=0, num_nextn_predict_layers=1)


@pytest.mark.slow  # a node process and an impostor: ~30 s
def test_proposer_writes_outside_their_ranges_get_remote_access_errors(mtp_dir, tmp_path, loopback_verbs_dir):
    from _verbs_impostor import SPEC_TOKENS

    env = {"LD_LIBRARY_PATH": loopback_verbs_dir}
    secret = tmp_path / "cluster.secret"
    write_secret_file(secret)
    imp = Impostor(mtp_dir, secret, "spec", tmp_path, env)
    d = node_dict(mtp_dir, "decode", port=free_port(), transport="verbs", nics=["lo_verbs0"],
                  peers=[f"127.0.0.1:{imp.port}"])
    d["messenger"]["secret_file"] = str(secret)
    d["speculative"] = {"method": "mtp", "num_tokens": SPEC_TOKENS}
    dec = NodeProc(tmp_path, "decode", d, env)
    try:
        dec.wait_healthy()
        name = json.loads(urllib.request.urlopen(dec.url + "/v1/models").read())["data"][0]["id"]
        end = time.monotonic() + 60
        for i in range(2):  # one attack per connection; the impostor then closes it
            wait_for(lambda: dec.health()["prefill_peers"][0]["connected"], 30, "impostor (re)connected")
            status, body = post_completion(dec.url, {"model": name, "prompt": list(range(5 + i, 19 + i)),
                                                     "max_tokens": 4}, timeout=60)
            assert status != 200, body  # its KV never (all) landed: the client gets an error
            wait_for(lambda: len(imp.record()["attacks"]) > i or time.monotonic() > end, 30, "the attack")
        rec = imp.record()
        assert [a["kind"] for a in rec["attacks"]] == ["spec_foreign", "spec_region"], rec
        assert all(a["refused"] is True for a in rec["attacks"]), rec  # the NIC refused both
        assert dec.health()["refused_writes"] >= 2, dec.health()  # the decode side saw each access error
        wait_for(lambda: dec.health()["grants_held"] == 0, 15, "every grant revoked (no MR left)")
        wait_for(lambda: dec.health()["num_pages_free"] == dec.health()["num_pages_total"], 15, "pages back")
    finally:
        dec.stop()
        imp.stop()
