"""tools/train_default_model.py's choice of the checkpoint to ship: validation prompts come from
the held-out files only (never the training files, never the 16 evaluation prompts), the
"validation" rule ships the checkpoint that parses most of them, and a tiny real run writes the
chosen checkpoint, with its validation record, as the shipped folder."""
from __future__ import annotations

import json
import re

import pytest
import torch

import train_default_model as trainer
from default_model_eval import eval_prompts, score


def _files(n: int) -> list[tuple[str, str]]:
    """Synthetic stdlib files whose function and class names say which file they come from."""
    out = []
    for i in range(n):
        out.append((f"pkg/mod{i}.py", f'''"""Module {i}."""


def top{i}(a, b=None):
    return a


def multi{i}(a,
             b):
    return b


def oneliner{i}(): return 1


def loop{i}(items):
    total = 0
    for item in items:
        total += item
    return total


def far{i}(items):
    a = 1
    b = 2
    c = 3
    d = 4
    e = 5
    for item in items:
        pass


class Cls{i}(object):
    def meth{i}(self, x):
        """Doc."""
        return x

    async def ameth{i}(self):
        await x
'''))
    return out


def _names(prompt: str) -> set[str]:
    return set(re.findall(r"(?:def|class) ([A-Za-z_]+\d+)", prompt))


def test_validation_prompts_come_from_held_out_files_only():
    files = _files(400)
    train, held = trainer.split(files)
    assert held and train and not {p for p, _ in train} & {p for p, _ in held}
    held_ids = {re.search(r"\d+", p).group() for p, _ in held}
    n = 2 * len(held)  # five usable headers per file (top, loop, far, meth, ameth), one block
    val = trainer.validation_prompts(held, n, seed=0)
    assert len(val["line_end"]) == len(val["after_newline"]) == n // 2
    assert not any(p.endswith("\n") for p in val["line_end"])
    assert all(p.endswith("\n") and not p.endswith("\n\n") for p in val["after_newline"])
    prompts = val["line_end"] + val["after_newline"]
    assert len(set(prompts)) == n  # no header twice
    blocks = 0
    for p in prompts:
        ids = {re.search(r"\d+", name).group() for name in _names(p)}
        assert ids and ids <= held_ids, p  # nothing from a training file
        assert "multi" not in p and "oneliner" not in p, p  # one-line headers with a body below only
        if "meth" in p:  # a method follows its class's header, indented
            assert re.fullmatch(r"class Cls(\d+)\(object\):\n    (async )?def a?meth\1\(self(, x)?\):\n?", p), p
        elif "for item" in p:  # a function down to the block opener in its body, as written
            blocks += 1
            assert re.fullmatch(r"def loop\d+\(items\):\n    total = 0\n    for item in items:\n?", p), p
        else:  # far's loop is more than BLOCK_SPAN lines below its header: only the header
            assert re.fullmatch(r"def (top\d+\(a, b=None\)|loop\d+\(items\)|far\d+\(items\)):\n?", p), p
    # the evaluation's share of block openers: 3 in 8 of each group
    assert blocks == 2 * (n // 2 * 3 // 8)
    assert sum("for item" in p for p in val["after_newline"]) == n // 2 * 3 // 8
    # seeded: the same seed gives the same prompts, another seed another order
    assert trainer.validation_prompts(held, n, seed=0) == val
    assert trainer.validation_prompts(held, n, seed=1) != val
    # the evaluation prompts are not among them (they are the test set)
    real_train, real_held = trainer.split(trainer.stdlib_files())
    real = trainer.validation_prompts(real_held, 64, seed=0)
    evaluation = {p for g in eval_prompts().values() for p in g}
    assert not evaluation & set(real["line_end"] + real["after_newline"])
    assert not {p for p, _ in real_train} & {p for p, _ in real_held}


def test_validation_prompts_refuse_a_bad_count():
    _, held = trainer.split(_files(400))
    with pytest.raises(ValueError, match="even number"):
        trainer.validation_prompts(held, 7, seed=0)
    with pytest.raises(ValueError, match="block openers, fewer than Recipe.validation_prompts=100000"):
        trainer.validation_prompts(held, 100_000, seed=0)


def _ckpt(step, total, loss):
    return dict(step=step, heldout_loss=loss, validation=dict(total=total))


def test_pick_checkpoint():
    run = [_ckpt(250, 3, 4.0), _ckpt(500, 9, 3.5), _ckpt(750, 12, 3.3), _ckpt(1000, 12, 3.2), _ckpt(1250, 11, 3.1)]
    assert trainer.pick_checkpoint(run, "validation")["step"] == 1000  # 12 parse; of the two, lower loss
    assert trainer.pick_checkpoint(run, "last")["step"] == 1250
    assert trainer.pick_checkpoint([_ckpt(1, 5, 3.0), _ckpt(2, 5, 3.0)], "validation")["step"] == 2  # then later
    with pytest.raises(ValueError, match="'best'"):
        trainer.pick_checkpoint(run, "best")
    with pytest.raises(ValueError, match="no checkpoint"):
        trainer.pick_checkpoint([], "validation")


def test_score_reports_each_group(shipped_dir):
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer.from_file(str(shipped_dir / "tokenizer.json"))
    torch.manual_seed(0)
    noise = LlamaForCausalLM(LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()
    groups = {"a": ["def f(x):", "def g(y):\n"], "b": ["class C:\n    def m(self):"]}
    s = score(noise, tok, groups=groups)
    assert set(s) == {"a", "b", "total", "parsed"} and set(s["parsed"]) == {p for g in groups.values() for p in g}
    assert s["a"] == sum(s["parsed"][p] for p in groups["a"]) and s["total"] == s["a"] + s["b"]
    with pytest.raises(ValueError, match="'b' is empty"):
        score(noise, tok, groups={"a": ["def f(x):"], "b": []})


def test_a_bad_ship_is_refused_before_training(tmp_path):
    with pytest.raises(SystemExit, match="ship=best: expected one of validation, last"):
        trainer.main(["--out", str(tmp_path / "out"), "--recipe", "ship=best"])
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # tokenizes a small corpus, trains a tiny model 6 steps: ~1 min (loaded machine)
def test_a_tiny_run_ships_the_checkpoint_validation_picks(tmp_path, monkeypatch):
    files = trainer.stdlib_files()
    train, held = trainer.split(files)
    monkeypatch.setattr(trainer, "stdlib_files", lambda: train[:30] + held)  # a small corpus: fast
    out, ckpts = tmp_path / "shipped", tmp_path / "ckpt"
    recipe = ["tokenizer_chars=200000", "vocab_size=600", "hidden_size=32", "num_layers=1", "num_heads=2",
              "num_kv_heads=1", "intermediate_size=64", "context=64", "warmup_steps=2", "validation_prompts=4"]
    assert trainer.main(["--out", str(out), "--checkpoints", str(ckpts), "--loss-png", "", "--steps", "6",
                         "--eval-every", "2", *sum((["--recipe", x] for x in recipe), [])]) == 0
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00002", "step-00004", "step-00006"]
    rec = json.loads((out / "training.json").read_text())
    v = rec["validation"]
    assert [s for s, *_ in v["evals"]] == [2, 4, 6] and [s for s, _ in rec["evals"]] == [2, 4, 6]
    assert v["prompts"] == trainer.validation_prompts(held, 4, seed=0)
    # the shipped folder is the chosen checkpoint's: same weights, its own step and losses
    losses = dict((s, h) for s, h in rec["evals"])
    run = [_ckpt(s, a + b, losses[s]) for s, a, b in v["evals"]]
    chosen = trainer.pick_checkpoint(run, "validation")["step"]
    assert v["chosen_step"] == rec["steps_done"] == chosen
    assert (out / "model.safetensors").read_bytes() == (ckpts / f"step-{chosen:05d}" / "model.safetensors").read_bytes()
    assert rec["heldout_loss"] == losses[chosen]
    card = (out / "README.md").read_text()
    assert f"step {chosen}" in card and "4 validation prompts" in card and f"{rec['heldout_loss']:.4f}" in card
