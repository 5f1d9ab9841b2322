"""minipd: co-located, chunked-prefill and disaggregated LLM serving on one engine."""

from typing import TYPE_CHECKING

from minipd.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minipd.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # lazy, so that torch-free parts (scheduler, block manager, server main process) stay torch-free
    if name in ("LLM", "RequestOutput"):
        import minipd.llm

        return getattr(minipd.llm, name)
    raise AttributeError(name)
