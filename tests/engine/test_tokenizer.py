"""Tokenizer, chat template and incremental detokenization of multi-byte characters."""

from __future__ import annotations

import pytest

from pdkv.errors import InvalidRequest
from pdkv.tokenizer import Tokenizer

TEXT = "Caffè, città — 日本語のテキスト 😀🚀 👍🏽 done."


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


def test_roundtrip_and_eos(tok):
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert tok.encode("<|im_end|>") and tok.eos_token_ids == {tok.encode("<|im_end|>")[0],
                                                              tok.encode("<|endoftext|>")[0]}


def test_incremental_never_emits_broken_characters(tok):
    ids = tok.encode(TEXT)
    d = tok.detokenizer(tok.encode("Hello"))
    pieces = []
    for i in ids:
        d.add(i)
        piece = d.flush(finished=False)
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(d.flush(finished=True))
    assert "".join(pieces) == TEXT
    # Some tokens end mid-character, so some steps must have emitted nothing.
    assert any(p == "" for p in pieces[:-1])


def test_stop_string_spanning_tokens_is_held_back(tok):
    d = tok.detokenizer([], stop=["brown fox"])
    sent = ""
    for i in tok.encode("the quick brown fox jumps"):
        d.add(i)
        sent += d.flush(finished=d.stopped_on is not None)
        assert "brown" not in sent
    assert d.stopped_on == "brown fox" and sent == "the quick "


def test_chat_template(tok):
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert not tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False).endswith(
        "assistant\n")
    tok.chat_template, saved = None, tok.chat_template
    try:
        with pytest.raises(InvalidRequest, match="chat_template"):
            tok.apply_chat_template([{"role": "user", "content": "x"}])
    finally:
        tok.chat_template = saved
