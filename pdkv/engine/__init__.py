"""The engine: request state machine, scheduler, model runner, sampler, the LLMEngine API, the KV
connector it calls and the engine-thread loop that drives it (pdkv/engine/loop.py)."""

from pdkv.engine.connector import Admission, BatchEntry, ForwardBatch, KVConnector
from pdkv.engine.llm_engine import LLMEngine, build_engine
from pdkv.engine.params import SamplingParams
from pdkv.engine.request import RequestOutput, RequestStatus

__all__ = ["Admission", "BatchEntry", "ForwardBatch", "KVConnector", "LLMEngine", "RequestOutput",
           "RequestStatus", "SamplingParams", "build_engine"]
