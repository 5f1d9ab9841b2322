from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tqdm import tqdm

from minipd.config import EngineConfig
from minipd.detokenizer import TextStream
from minipd.engine.engine import Engine
from minipd.sampling_params import SamplingParams
from minipd.tokenizer import load_tokenizer


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None  # per token, when asked: {token id: logprob}, the sampled one and the best
    stop_reason: str | int | None = None  # the stop string or stop_token_ids token that ended it (vLLM's)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # when asked: per prompt token (the first None)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class LLM:
    """Offline batch inference, shaped like vLLM's `LLM`."""

    def __init__(self, model: str | None = None, dtype: str = "float32", policy: str = "prefill_first",
                 chunk_tokens: int = 512, **engine_kwargs):  # fmt: skip
        self.config = EngineConfig(model=model, dtype=dtype, policy=policy, chunk_tokens=chunk_tokens, **engine_kwargs)
        self.engine = Engine(self.config)
        self.tokenizer = load_tokenizer(model)
        self._ids = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:  # fmt: skip
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        token_lists = [self._encode(p) for p in prompts]
        return self._run(token_lists, params, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_lists = [self.apply_chat_template(c) for c in conversations]
        return self.generate(token_lists, sampling_params, use_tqdm)

    def get_tokenizer(self):
        return self.tokenizer

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        self._need_tokenizer()
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            self._need_tokenizer()
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")

    def _run(self, token_lists: list[list[int]], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        streams: dict[str, TextStream | None] = {}
        try:
            for ids, p in zip(token_lists, params):
                rid = str(next(self._ids))
                self.engine.add_request(rid, ids, p)
                results[rid] = RequestOutput(rid, ids, [CompletionOutput(0, "", [], None, None if p.logprobs is None else [])])
                streams[rid] = TextStream.of(self.tokenizer, p) if self.tokenizer else None
        except ValueError:
            for rid in results:  # one bad prompt: none of this call's requests stay behind
                self.engine.abort_request(rid)
            raise
        bar = tqdm(total=len(results), desc="Processed prompts", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                comp = results[out.request_id].outputs[0]
                comp.token_ids += out.new_token_ids
                if out.prompt_logprobs:
                    results[out.request_id].prompt_logprobs = [
                        None if e is None else {**dict(e[3]), e[0]: e[1]} for e in out.prompt_logprobs]  # fmt: skip
                if out.logprobs:
                    comp.logprobs += [{**dict(top), t: lp} for t, (lp, top) in zip(out.new_token_ids, out.logprobs)]
                stream = streams[out.request_id]
                stop_token = out.finished and out.finish_reason == "stop"  # eos or stop_token_ids
                if stream is not None:
                    comp.text += stream.push(out.new_token_ids, final=out.finished, stop_token=stop_token)
                    if stream.stopped and not out.finished:
                        self.engine.abort_request(out.request_id)
                        comp.finish_reason, comp.stop_reason = "stop", stream.stop_reason
                        bar.update()
                        continue
                if out.finished:
                    if stream is not None and stream.stopped:  # a stop string in its last tokens, as the server says
                        comp.finish_reason, comp.stop_reason = "stop", stream.stop_reason
                    else:
                        comp.finish_reason = out.finish_reason
                        comp.stop_reason = out.stop_reason
                    bar.update()
        bar.close()
        return list(results.values())
