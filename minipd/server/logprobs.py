"""OpenAI's logprobs shapes, built from what the workers report for each output token:
[token id, its log probability, [[id, log probability] of the best ones, best first]]."""

from __future__ import annotations

from collections.abc import Callable

FLOOR = -9999.0  # as vLLM: JSON has no -Infinity (a token the model gives no chance at all)


class LogprobsWriter:
    """One request's logprobs, a chunk (or the whole reply) at a time. Completions count each
    token's text offset from the start of the reply, across the chunks of a stream."""

    def __init__(self, token_text: Callable[[int], str], chat: bool):
        self.token_text, self.chat = token_text, chat
        self.offset = 0

    def __call__(self, entries: list) -> dict:
        return self._chat(entries) if self.chat else self._completion(entries)

    def _chat(self, entries: list) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": max(logprob, FLOOR), "bytes": list(text.encode("utf-8"))}

        return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]} for t, lp, top in entries]}

    def _completion(self, entries: list) -> dict:
        out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for t, lp, top in entries:
            text = self.token_text(t)
            out["text_offset"].append(self.offset)
            out["token_logprobs"].append(max(lp, FLOOR))
            out["tokens"].append(text)
            best = {self.token_text(i): max(v, FLOOR) for i, v in top}
            best.setdefault(text, max(lp, FLOOR))  # the sampled token is always among them, as in vLLM
            out["top_logprobs"].append(best)
            self.offset += len(text)
        return out
