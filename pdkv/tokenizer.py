"""Tokenizer of a model folder: ``tokenizer.json`` through the ``tokenizers`` package, the chat
template from ``tokenizer_config.json`` rendered with jinja2 (sandboxed, as transformers does),
and the eos ids from tokenizer_config.json, generation_config.json and config.json.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from pdkv.detokenizer import IncrementalDetokenizer
from pdkv.errors import InvalidRequest, ModelLoadError
from pdkv.tokenizer_healing import TokenHealer


def _token_str(value) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, folder: str | Path, model_eos_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer as HFTokenizer  # noqa: PLC0415

        folder = Path(folder)
        tok_path = folder / "tokenizer.json"
        if not tok_path.is_file():
            raise ModelLoadError(f"{tok_path}: file is missing")
        try:
            self._tok = HFTokenizer.from_file(str(tok_path))
        except Exception as e:  # tokenizers raises a plain Exception for bad JSON
            raise ModelLoadError(f"{tok_path}: cannot load tokenizer ({e})") from e
        self.config = self._read_optional(folder / "tokenizer_config.json")
        gen = self._read_optional(folder / "generation_config.json")
        self.chat_template: str | None = self.config.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        eos = set(model_eos_ids)
        gen_eos = gen.get("eos_token_id")
        eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            eos.add(self._tok.token_to_id(self.eos_token))
        self.eos_token_ids: set[int] = eos
        self.vocab_size = self._tok.get_vocab_size()
        self._template = None
        # How token strings spell bytes (tokenizer.json's decoder): "ByteLevel" (GPT-2's byte
        # alphabet), "ByteFallback" (sentencepiece's <0xNN>), or "" (plain text).
        decoder = json.dumps(json.loads(self._tok.to_str()).get("decoder"))
        self.byte_encoding = next((k for k in ("ByteLevel", "ByteFallback") if k in decoder), "")
        self._healer: TokenHealer | None = None

    @staticmethod
    def _read_optional(path: Path) -> dict:
        if not path.exists():
            return {}
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: malformed JSON ({e})") from e
        if not isinstance(data, dict):
            raise ModelLoadError(f"{path}: expected a JSON object")
        return data

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def healer(self) -> TokenHealer:
        """The vocabulary index token healing uses (pdkv.tokenizer_healing), built on first use:
        a server that never heals never pays for it."""
        if self._healer is None:
            self._healer = TokenHealer.for_tokenizer(self._tok)
        return self._healer

    def detokenizer(self, prompt_ids: list[int] | None = None, stop: list[str] | None = None,
                    skip_special_tokens: bool = True, skip_prefix: str = "") -> IncrementalDetokenizer:
        """A per-request incremental detokenizer (see pdkv.detokenizer)."""
        return IncrementalDetokenizer(self, prompt_ids or [], stop or [], skip_special_tokens, skip_prefix)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Renders ``messages`` ([{"role": ..., "content": ...}]) to the prompt text."""
        if not self.chat_template:
            raise InvalidRequest("this model's tokenizer_config.json has no chat_template; "
                                 "use /v1/completions with a plain prompt")
        if self._template is None:
            from jinja2.exceptions import TemplateError  # noqa: PLC0415
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

            def raise_exception(message):
                raise TemplateError(message)

            # As transformers renders templates: loop controls on, trim/lstrip blocks.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                         **kwargs)
        except Exception as e:  # a template's raise_exception means the messages are invalid
            raise InvalidRequest(f"chat template rejected the messages: {e}") from e
