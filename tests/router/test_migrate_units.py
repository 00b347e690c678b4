"""The router's migration bookkeeping (pdkv/router/migrate.py) on hand-made SSE: events split
anywhere, token ids taken out unless the client asked, ids kept from the first node, the new
node's role chunk dropped, usage counting the whole output, what a resume asks for."""

from __future__ import annotations

import json

from pdkv.router.migrate import StreamState, migratable


def _ev(d) -> bytes:
    return b"data: " + (d if isinstance(d, bytes) else json.dumps(d).encode()) + b"\n\n"


def _events(raw: bytes) -> list:
    return [json.loads(e[6:]) if e[6:] != b"[DONE]" else "[DONE]" for e in raw.split(b"\n\n") if e]


def test_completion_stream_split_anywhere_then_resumed():
    st = StreamState(chat=False, client_token_ids=False)
    raw = (_ev({"id": "a", "created": 1, "choices": [{"text": "He", "token_ids": [1], "prompt_token_ids": [9],
                                                      "finish_reason": None}]})
           + _ev({"id": "a", "created": 1, "choices": [{"text": "llo", "token_ids": [2, 3], "finish_reason": None}]}))
    out = b"".join(st.feed(raw[i:i + 7], False) for i in range(0, len(raw), 7))
    evs = _events(out)
    assert [e["choices"][0]["text"] for e in evs] == ["He", "llo"]
    assert all("token_ids" not in e["choices"][0] and "prompt_token_ids" not in e["choices"][0] for e in evs)
    assert st.token_ids == [1, 2, 3] and st.text_chars == 5 and not st.done
    body = st.resume_body({"prompt": "x", "max_tokens": 9, "stream": True})
    assert body["pdkv_resume"] == {"token_ids": [1, 2, 3], "text_chars": 5, "prompt_token_ids": [9]}
    assert body["return_token_ids"] is True
    out = st.feed(_ev({"id": "b", "created": 2, "choices": [{"text": " w", "token_ids": [4],
                                                             "prompt_token_ids": [9, 1, 2, 3], "finish_reason": None}]})
                  + _ev({"id": "b", "created": 2, "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1,
                                                                            "total_tokens": 5}})
                  + _ev(b"[DONE]"), True)
    evs = _events(out)
    assert evs[0]["id"] == "a" and evs[0]["created"] == 1 and evs[0]["choices"][0] == {"text": " w",
                                                                                       "finish_reason": None}
    assert evs[1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}
    assert evs[2] == "[DONE]" and st.done and st.token_ids == [1, 2, 3, 4]


def test_chat_role_chunk_of_the_new_node_is_dropped_and_errors_held():
    st = StreamState(chat=True, client_token_ids=True)
    st.feed(_ev({"id": "a", "created": 1, "choices": [{"delta": {"role": "assistant", "content": ""},
                                                       "finish_reason": None}]})
            + _ev({"id": "a", "created": 1, "choices": [{"delta": {"content": "Hi"}, "token_ids": [7],
                                                         "finish_reason": None}]}), False)
    assert st.feed(_ev({"error": {"message": "engine failed"}}), False) == b""
    assert st.error == "engine failed"
    st.resume_body({"messages": [], "stream": True})
    out = st.feed(_ev({"id": "b", "created": 2, "choices": [{"delta": {"role": "assistant", "content": ""},
                                                             "finish_reason": None}]})
                  + _ev({"id": "b", "created": 2, "choices": [{"delta": {"content": "!"}, "token_ids": [8],
                                                               "prompt_token_ids": [1], "finish_reason": "length"}]}),
                  True)
    evs = _events(out)
    assert len(evs) == 1 and evs[0]["choices"][0]["token_ids"] == [8]  # the client asked: kept
    assert "prompt_token_ids" not in evs[0]["choices"][0] and st.finished


def test_what_migrates():
    assert migratable({"stream": True, "prompt": "x"}, 3)
    assert not migratable({"stream": True, "prompt": "x"}, 0)
    assert not migratable({"prompt": "x"}, 3)
    assert not migratable({"stream": True, "n": 2}, 3)
    assert not migratable({"stream": True, "echo": True}, 3)
    # structured output migrates (the new node replays the matcher); a tool parser's state does not
    assert migratable({"stream": True, "response_format": {"type": "json_object"}}, 3)
    assert not migratable({"stream": True, "tools": [], "messages": []}, 3)
