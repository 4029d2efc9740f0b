"""tokenfleet: a multi-tenant LLM serving platform."""
from tokenfleet.engine.request import SamplingParams
from tokenfleet.engine.llm import LLM

__all__ = ["LLM", "SamplingParams"]
