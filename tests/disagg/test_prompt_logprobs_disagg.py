"""PROMPT_LOGPROBS as the decode node checks it (pdkv/disagg/prompt_logprobs.py): exactly one
entry per prompt token after the first, each naming that token, at most the N alternatives
asked, log-probabilities only; PREFILL's request fields as the prefill node checks them. The
pair over tcp is tests/disagg/test_structured_disagg.py; a hostile decode node,
tests/security/test_hostile_prefill.py."""
from __future__ import annotations

import math

import pytest

from pdkv.disagg import messages as M
from pdkv.disagg import prompt_logprobs as PL
from pdkv.engine.request import TokenLogprob

PROMPT = [5, 6, 7, 8]
PREFILL = {"type": "PREFILL", "req": "r", "tokens": [1, 2, 3], "pages": [0], "imm": 1, "hidden_off": 0}
GOOD = [TokenLogprob(6, -1.0, ((6, -1.0), (9, -2.0))), TokenLogprob(7, -0.5, ((7, -0.5), (1, -3.0))),
        TokenLogprob(8, -math.inf, ((2, -0.1), (3, -0.2)))]


def test_round_trip():
    assert PL.decode(PL.encode("r", GOOD), PROMPT, 2) == GOOD
    p = M.Prefill.parse({**PREFILL, "prompt_logprobs": 2, "last_token": 8},
                        M.PrefillLimits(max_prompt_logprobs_tokens=4))
    assert (p.prompt_logprobs, p.last_token) == (2, 8)
    p = M.Prefill.parse(PREFILL, M.PrefillLimits(max_prompt_logprobs_tokens=4))
    assert p.prompt_logprobs is None  # not asked (an older decode node): nothing computed


def _bad(mutate):
    msg = PL.encode("r", GOOD)
    mutate(msg["logprobs"])
    return msg


@pytest.mark.parametrize("msg,num_top,words", [
    (_bad(lambda rows: rows.append([8, -1.0, []])), 2,
     "must hold 3 entries (one per prompt token after the first), got 4"),
    (_bad(lambda rows: rows.pop()), 2, "must hold 3 entries"),
    ({"logprobs": "x" * 10}, 2, "must hold 3 entries"),
    (_bad(lambda rows: rows[1].__setitem__(0, 99)), 2, "logprobs[1] must be [prompt token 7"),
    (PL.encode("r", GOOD), 1, "logprobs[0] top must hold at most 1 alternatives (as asked), got 2"),
    (_bad(lambda rows: rows[2].__setitem__(1, 0.5)), 2, "logprobs[2] logprob must be a number <= 0"),
    (_bad(lambda rows: rows[2].__setitem__(1, math.nan)), 2, "logprobs[2] logprob must be"),
    (_bad(lambda rows: rows[0][2].__setitem__(0, ["a", -1.0])), 2, "top entries must be [token id, logprob]"),
])
def test_decode_refuses_what_was_not_asked_for(msg, num_top, words):
    with pytest.raises(ValueError) as e:
        PL.decode(msg, PROMPT, num_top)
    assert "PROMPT_LOGPROBS" in str(e.value) and words in str(e.value)


def test_prefill_side_bound_names_the_setting():
    with pytest.raises(ValueError, match="server.max_prompt_logprobs_tokens 4"):
        M.Prefill.parse({**PREFILL, "tokens": [1, 2, 3, 4], "prompt_logprobs": 0, "last_token": 1},
                        M.PrefillLimits(max_prompt_logprobs_tokens=4))


def test_staged_pair_carries_them_through_the_copy_in(tiny_model_dir):
    """With the KV staged (messenger.staging: cpu) the logprobs go with RemoteKVReady after the
    copy-in: the echoed prompt's logprobs equal a colocated engine's."""
    from _cluster import Cluster, make_engine, node_config, post_completion, wait_for
    from pdkv.engine import SamplingParams

    prompt = [7, 12, 99, 7, 12, 99, 31, 200, 7, 12, 5]
    colocated = make_engine(node_config(tiny_model_dir, "colocated"))
    want = colocated.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    staged = {"messenger__staging": "cpu"}
    c = Cluster(tiny_model_dir, prefill_over=staged, decode_over=staged)
    try:
        status, body = post_completion(c.url, {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                               "logprobs": 1, "echo": True})
        assert status == 200, body
        got = body["choices"][0]["logprobs"]["token_logprobs"][:len(prompt)]
        assert got[0] is None
        assert max(abs(g - w.logprob) for g, w in zip(got[1:], want.prompt_logprobs)) < 1e-4
        import urllib.request
        text = urllib.request.urlopen(c.url + "/metrics", timeout=10).read().decode()
        assert [x for x in text.splitlines() if x.startswith("pdkv_disagg_prefill_decisions_total{")
                and 'where="remote"' in x and float(x.split()[-1]) == 1.0], text  # prefilled remotely
        wait_for(c.pools_full, 10, "both page pools back to full")
        assert not c.coordinator._copy_lps
    finally:
        c.stop()
