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
            out["tokens"].append(text)
            self.offset += len(text)
            if lp is None:  # an echoed prompt's first token: nothing comes before it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(max(lp, FLOOR))
            best = {self.token_text(i): max(v, FLOOR) for i, v in top}
            best.setdefault(text, max(lp, FLOOR))  # the sampled token is always among them, as in vLLM
            out["top_logprobs"].append(best)
        return out

    def echoed(self, prompt_ids: list[int], prompt_logprobs: list) -> dict:
        """Completions' echo: the prompt's tokens as the reply's first ones (the first has no logprob)."""
        return self._completion([[t, None, None] if e is None else [t, e[1], e[3]] for t, e in zip(prompt_ids, prompt_logprobs)])


def vllm_prompt_logprobs(entries: list, token_text: Callable[[int], str]) -> list:
    """vLLM's prompt_logprobs: per prompt token (the first: None), {token id: {logprob, rank,
    decoded_token}} for the token itself and the best others."""
    out = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        token, lp, rank, top = e
        row = {str(i): {"logprob": max(v, FLOOR), "rank": r, "decoded_token": token_text(i)}
               for r, (i, v) in enumerate(top, start=1)}  # fmt: skip
        row.setdefault(str(token), {"logprob": max(lp, FLOOR), "rank": rank, "decoded_token": token_text(token)})
        out.append(row)
    return out
