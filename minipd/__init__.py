from minipd.llm import LLM, RequestOutput
from minipd.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
