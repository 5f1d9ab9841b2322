from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back bytes of a multi-byte
    character until it is complete (the prefix/read-offset method of TGI and vLLM)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_ids: list[int]) -> str:
        self.token_ids += token_ids
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)  # noqa: E731
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return full[len(prefix) :]
        return ""


class TextStream:
    """Detokenizes one request's output and applies its stop strings. While streaming it holds
    back the few characters that could still become a stop string."""

    def __init__(self, tokenizer, stop: list[str], min_tokens: int = 0, include_stop: bool = False,
                 skip_special_tokens: bool = True):  # fmt: skip
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop, self.include_stop = stop, include_stop
        self.min_tokens, self.num_tokens = min_tokens, 0  # as vLLM: no stop string ends a reply before min_tokens
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.stop_reason: str | None = None  # the stop string that ended the text

    @classmethod
    def of(cls, tokenizer, params) -> TextStream:
        """The text of a reply sampled with `params` (a SamplingParams)."""
        return cls(tokenizer, params.stop, params.min_tokens, params.include_stop_str_in_output, params.skip_special_tokens)

    def push(self, token_ids: list[int], final: bool = False, stop_token: bool = False) -> str:
        """Returns the text that may be shown now. Sets .stopped when a stop string appears.
        stop_token: the last token (eos, or one of stop_token_ids) ended the reply: as vLLM, its text
        is left out unless include_stop_str_in_output."""
        if self.stopped:
            return ""
        if stop_token and not self.include_stop:
            token_ids = token_ids[:-1]
        delta = self.detokenizer.push(token_ids)
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        self.num_tokens += len(token_ids)
        found = [(at, s) for s in (self.stop if self.num_tokens > self.min_tokens else ()) if (at := self.text.find(s, start)) != -1]
        if found:  # the stop string that appears first ends the reply
            at, s = min(found)
            self.text = self.text[: at + len(s) if self.include_stop else at]
            self.stopped, self.stop_reason = True, s
        end = len(self.text) if (final or self.stopped) else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
