"""The engine: request state machine, scheduler, model runner, sampler, the LLMEngine API, the KV
connector it calls and the engine-thread loop that drives it (pdkv/engine/loop.py)."""

from pdkv.engine.connector import NOT_YET, RESERVE, Admission, Answer, BatchEntry, ForwardBatch, KVConnector, Verdict
from pdkv.engine.llm_engine import LLMEngine, build_engine
from pdkv.engine.params import SamplingParams
from pdkv.engine.request import RequestOutput, RequestStatus

__all__ = ["Admission", "Answer", "BatchEntry", "ForwardBatch", "KVConnector", "LLMEngine", "NOT_YET", "RESERVE",
           "RequestOutput", "RequestStatus", "SamplingParams", "Verdict", "build_engine"]
