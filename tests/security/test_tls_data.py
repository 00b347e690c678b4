"""messenger.tls_data: a real pair (tcp, loopback, a cluster secret) whose data streams are
AES-256-GCM records keyed from the control session (tests/messenger/test_tcp_sealed.py: what a
relay in the middle can then do): answers equal the colocated engine's. Both nodes must agree
(HELLO names the difference);
a node without a secret, or on verbs, refuses the setting by name."""

import pytest
from _cluster import (Cluster, assert_colocated_answer, make_engine, node_config, serve_node)

from pdkv._messenger import HAVE_CRYPTO
from pdkv.auth import write_secret_file
from pdkv.config import ConfigError
from pdkv.server.app import NODE

pytestmark = pytest.mark.skipif(not HAVE_CRYPTO, reason="pdkv built without libcrypto (libssl-dev)")


def test_sealed_pair_answers_as_colocated_and_a_plain_peer_is_refused(tiny_model_dir, tmp_path):
    f = tmp_path / "cluster.secret"
    write_secret_file(f)
    over = {"messenger__secret_file": str(f), "messenger__tls_data": True}
    c = Cluster(tiny_model_dir, prefill_over=over, decode_over=over)
    try:
        link = c.prefill.app[NODE].coordinator.links[0]
        assert link.channel.peer.transport.get("tls_data") is True
        assert_colocated_answer(c.url, c.model_name(), tiny_model_dir, list(range(5, 40)), 4)
        port = c.prefill.app[NODE].control_port
        plain = node_config(tiny_model_dir, "decode", messenger__prefill_peers=[f"127.0.0.1:{port}"],
                            messenger__secret_file=str(f), messenger__connect_timeout_s=3.0)
        with pytest.raises(Exception, match=r"transport.tls_data: this decode node has False, the prefill "
                                            r"node has True"):
            serve_node(plain, make_engine(plain)).start()
    finally:
        c.stop()


def test_tls_data_needs_a_secret_and_tcp(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("PDKV_CLUSTER_SECRET", raising=False)
    cfg = node_config(tiny_model_dir, "prefill", messenger__tls_data=True)
    with pytest.raises(Exception, match=r"messenger.tls_data needs a cluster secret"):
        serve_node(cfg, make_engine(cfg)).start()
    with pytest.raises(ConfigError, match=r"messenger.tls_data.*tcp"):
        node_config(tiny_model_dir, "prefill", messenger__tls_data=True, messenger__transport="verbs")
