"""The engine: request state machine, scheduler, model runner, sampler and the LLMEngine API."""

from pdkv.engine.llm_engine import LLMEngine
from pdkv.engine.params import SamplingParams
from pdkv.engine.request import RequestOutput, RequestStatus

__all__ = ["LLMEngine", "RequestOutput", "RequestStatus", "SamplingParams"]
