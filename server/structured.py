"""Compiling a request's output constraint off the event loop, bounded in time.

The server's one ``Grammars`` owns the engine's GrammarCache (pdkv/engine/structured.py, built
at the first constrained request: its vocabulary pass takes a second or two) and one worker
thread. A compile that outlasts ``server.grammar_compile_timeout_s`` is refused with a 400; the
worker finishes it in the background (xgrammar cannot be interrupted) and, being one thread,
bounds how much CPU such schemas can take.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from pdkv.errors import InvalidRequest
from pdkv.server.errors import APIError
from pdkv.server.protocol_structured import StructuredSpec


class Grammars:
    def __init__(self, engine, cache_size: int = 64, timeout_s: float = 10.0):
        self.engine, self.cache_size, self.timeout_s = engine, cache_size, timeout_s
        self.cache = None  # pdkv.engine.structured.GrammarCache, built on first use
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pdkv-grammar")

    def _build(self) -> None:
        if self.cache is None:
            from pdkv.engine.structured import GrammarCache  # noqa: PLC0415 - imports xgrammar

            self.cache = GrammarCache(self.engine.tokenizer, self.engine.vocab_size, self.cache_size)

    def _get(self, spec: StructuredSpec):
        self._build()
        return self.cache.get(spec.kind, spec.value, spec.field)

    async def constraint(self, spec: StructuredSpec):
        """The compiled constraint for ``spec``; APIError 400 naming ``spec.field`` otherwise.
        The cache's one-time build (the vocabulary pass: seconds on a loaded CPU) is waited for
        outside the time limit, which bounds what the request's own constraint costs."""
        loop = asyncio.get_running_loop()
        try:
            if self.cache is None:
                await loop.run_in_executor(self._executor, self._build)
            return await asyncio.wait_for(loop.run_in_executor(self._executor, self._get, spec), self.timeout_s)
        except InvalidRequest as e:
            raise APIError(str(e), 400, param=spec.field) from None
        except asyncio.TimeoutError:
            raise APIError(f"{spec.field}: compiling it took longer than {self.timeout_s} s "
                           f"(server.grammar_compile_timeout_s); simplify it", 400, param=spec.field) from None
        except ImportError:
            raise APIError(f"{spec.field}: structured output needs the xgrammar package, which this "
                           f"server does not have (pip install xgrammar)", 400, param=spec.field) from None

    def after_reasoning(self, constraint):
        """``constraint`` applied after the model's ``</think>`` (server.reasoning_parser on)."""
        from pdkv.engine.structured import AfterReasoning  # noqa: PLC0415
        from pdkv.server.reasoning import END, START  # noqa: PLC0415

        tok = self.engine.tokenizer
        return AfterReasoning(constraint, tok.encode(START, add_special_tokens=False),
                              tok.encode(END, add_special_tokens=False))

    @property
    def num_live_masks(self) -> int:
        return 0 if self.cache is None else self.cache.num_live_masks

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
