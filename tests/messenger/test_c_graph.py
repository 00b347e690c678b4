"""No cycle between the C files of pdkv/csrc: every file has a place in a one-way call order.

The graph is derived from the sources (c_graph.py): function definitions and the names each file
uses. A helper that several files call belongs in a leaf file, not in a transport's main file.
"""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from c_graph import (call_graph, capability_bits, check_registration, definitions, find_cycle, layers,  # noqa: E402
                     registration_table, strip)

CSRC = Path(__file__).resolve().parents[2] / "pdkv" / "csrc"


def test_the_parser_sees_the_real_functions_and_calls():
    # a parser that finds nothing would pass the cycle check trivially: pin what it must see
    defs = definitions(strip((CSRC / "tcp_net.c").read_text()))
    assert {"tcp_err", "tcp_send_all", "tcp_recv_all"} <= {n for n, ext in defs.items() if ext}
    assert definitions(strip("static int helper(int x) {\n  return x;\n}\n")) == {"helper": False}
    g = call_graph(CSRC)
    assert "tcp_conn.c" in g["tcp.c"] and "tcp_net.c" in g["tcp_accept.c"]  # calls and vtable references
    assert "verbs_conn.c" in g["verbs.c"] and "batch.c" in g["poller.c"]
    # several NICs: the multi-NIC transport sits above the single-NIC one, under transports.c
    assert "verbs_multi.c" in g["transports.c"] and "verbs.c" in g["verbs_multi.c"]
    assert {"verbs_multi_conn.c", "verbs_multi_mr.c"} <= g["verbs_multi.c"] and "verbs_mr.c" in g["verbs_multi_mr.c"]
    # GPUDirect: device memory registered above the region table; every MR of a region (own,
    # per-peer, grants) through the leaf that knows dma-buf regions
    assert "verbs_gpudirect.c" in g["verbs.c"] and "verbs_mr.c" in g["verbs_gpudirect.c"]
    assert all("verbs_memreg.c" in g[f] for f in ("verbs_gpudirect.c", "verbs_mr.c", "verbs_domain.c"))
    assert g["verbs_memreg.c"] == set()
    assert "fabric.c" in g["transports.c"] and "fabric_progress.c" in g["fabric.c"]  # libfabric
    assert "transports.c" not in set().union(*g.values())  # the entry point nobody calls back


def test_no_cycle_between_c_files():
    g = call_graph(CSRC)
    cycle = find_cycle(g)
    assert cycle is None, "C files call each other in a cycle: " + " -> ".join(cycle)
    assert len(layers(g)) >= 4  # a real order, not a flat set of unrelated files


@pytest.mark.parametrize("leaf, top, name", [("tcp_net.c", "tcp.c", "pdkv_tcp_create"),
                                              ("events.c", "core.c", "pdkv_core_destroy"),
                                              ("verbs_report.c", "verbs.c", "pdkv_verbs_create"),
                                              ("verbs.c", "verbs_multi.c", "pdkv_verbs_multi_create"),
                                              ("fabric_report.c", "fabric.c", "pdkv_libfabric_create")])
def test_a_back_call_from_a_leaf_is_a_cycle(tmp_path, leaf, top, name):
    # the check must fail when a leaf calls back into its transport's main file
    for p in CSRC.glob("*.c"):
        shutil.copy(p, tmp_path / p.name)
    with open(tmp_path / leaf, "a") as f:
        f.write(f"\nvoid back_call_for_the_test(void) {{ (void){name}; }}\n")
    cycle = find_cycle(call_graph(tmp_path))
    assert cycle is not None and leaf in cycle and top in cycle


# ---- the transport table: name -> constructor taking the transport's options, capabilities ----

def test_every_registered_constructor_exists_and_every_transport_is_registered():
    rows = registration_table(CSRC)
    assert {"tcp", "verbs", "libfabric", "fake"} <= {name for name, _, _ in rows}  # the parser sees the rows
    assert check_registration(CSRC) == []


def _copy(tmp_path):
    for p in list(CSRC.glob("*.c")) + list(CSRC.glob("*.h")):
        shutil.copy(p, tmp_path / p.name)
    return tmp_path


@pytest.mark.parametrize("change, problem", [
    # a transport file nobody registered
    (lambda s: s.replace('    {"fake", open_fake,', '    {"fake_gone", open_tcp,'), "fake.c defines transport 'fake', which has no row"),
    # a row whose constructor is not there
    (lambda s: s.replace('{"tcp", open_tcp,', '{"tcp", open_tcp_v2,'), "constructor open_tcp_v2 is not a function"),
    # a row whose constructor makes another transport
    (lambda s: s.replace('{"fake", open_fake,', '{"fake", open_tcp,'), "reaches no transport named 'fake'"),
    # a capability transport.h does not declare
    (lambda s: s.replace("PDKV_CAP_SAME_HOST_ONLY, NULL}", "PDKV_CAP_TELEPATHY, NULL}"), "['TELEPATHY'] are not in"),
])
def test_a_broken_table_is_caught(tmp_path, change, problem):
    d = _copy(tmp_path)
    src = (d / "transports.c").read_text()
    assert change(src) != src  # the edit applies to today's table
    (d / "transports.c").write_text(change(src))
    problems = check_registration(d)
    assert any(problem in p for p in problems), problems


def test_python_options_classes_match_the_registered_transports():
    """pdkv/transports.py mirrors the C table: the same names in the same order, the same
    capabilities per row and the same bits, and the compiled table says so at run time."""
    from pdkv import _messenger, transports

    rows = registration_table(CSRC)
    assert [name for name, _, _ in rows] == list(transports.OPTIONS)
    assert capability_bits(CSRC) == {c.name: c.value for c in transports.Capability if c.value}
    for name, _, caps in rows:
        cls = transports.OPTIONS[name]
        assert {c.name for c in transports.Capability if c.value and c in cls.capabilities} == caps, name
        assert _messenger.transport_capabilities(name) == cls.capabilities, name
    assert list(_messenger._KNOWN) == list(transports.OPTIONS)
