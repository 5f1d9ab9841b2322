"""OpenAI request parsing and response shapes. Bad input raises ApiError, which becomes a 4xx."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from minipd.sampling_params import MAX_LOGPROBS, MAX_REPETITION_PENALTY, SamplingParams


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type_, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
MAX_CHOICES = 64
# prompt logprobs in one reply (copies x prompt tokens x (k + 1)), or two whole contexts with 20
# alternatives a token if the model's contexts are longer: 2 million made a 230 MB reply whose building
# held the event loop 13 s (500,000 take about 3 s)
MAX_PROMPT_LOGPROB_ENTRIES = 500_000
INT64 = 2**63
# fields of OpenAI's (or vLLM's) API that this server cannot honour: refused when set, never ignored
# how the chat template is applied: only its default (a generation prompt after the messages)
CHAT_TEMPLATE_FIELDS = ("chat_template", "chat_template_kwargs", "continue_final_message", "add_generation_prompt")
UNSUPPORTED = ("suffix", "tools", "functions", "function_call",
               "use_beam_search", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "structured_outputs", "allowed_token_ids", "bad_words", "audio",
               "prediction", "web_search_options", *CHAT_TEMPLATE_FIELDS[:3], "documents", "mm_processor_kwargs",
               "logits_processors", "prompt_embeds",
               "kv_transfer_params", "vllm_xargs", "request_id", "reasoning_effort")  # fmt: skip
HARMLESS = {"tool_choice": ("none", "auto"), "response_format": ({"type": "text"},), "add_generation_prompt": (True,),
            "modalities": (["text"], []),
            "spaces_between_special_tokens": (True,), "length_penalty": (1.0, 1), "early_stopping": (False,),
            "priority": (0,), "detokenize": (True,)}  # fmt: skip


def refuse_unsupported(body: dict) -> None:
    _refuse(body, UNSUPPORTED, HARMLESS)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError("'user' must be a string", param="user")
    salt = body.get("cache_salt")  # salts a prefix cache, which minipd does not have: nothing to salt
    if salt is not None and not (isinstance(salt, str) and salt):
        raise ApiError("'cache_salt' must be a non-empty string", param="cache_salt")


def refuse_chat_template_options(body: dict) -> None:
    """/tokenize reads messages as the chat endpoint does: its template options, or the same 400."""
    _refuse(body, CHAT_TEMPLATE_FIELDS[:3], {"add_generation_prompt": HARMLESS["add_generation_prompt"]})


def _refuse(body: dict, unsupported: tuple[str, ...], harmless: dict) -> None:
    """A 400 naming the first field set to something this server cannot honour."""
    for name in unsupported:
        value = body.get(name)
        off = value is None or (not value and isinstance(value, (bool, str, list, dict)))
        if not off:
            raise ApiError(f"'{name}' is not supported by this server", param=name)
    for name, fine in harmless.items():  # the value itself, not one equal to it (true == 1 in Python)
        if body.get(name) is not None and not any(type(body[name]) is type(f) and body[name] == f for f in fine):
            raise ApiError(f"'{name}' other than {' or '.join(map(repr, fine))} is not supported", param=name)


def _number(body: dict, name: str, default, kind=float, low=None, high=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(f"'{name}' must be {'an integer' if kind is int else 'a number'}", param=name)
    if low is not None and high is not None and not low <= value <= high:
        raise ApiError(f"'{name}' must be between {low} and {high}, got {value}", param=name)
    if low is not None and value < low:
        raise ApiError(f"'{name}' must be >= {low}, got {value}", param=name)
    if high is not None and value > high:
        raise ApiError(f"'{name}' must be <= {high}, got {value}", param=name)
    return kind(value)


def echo_only(body: dict, chat: bool) -> bool:
    """Completions' echo with max_tokens 0 (OpenAI's legacy scoring request, and vLLM's): the reply
    is the prompt, with its logprobs if asked, and no token of its own."""
    value = body.get("max_completion_tokens")
    value = body.get("max_tokens") if value is None else value  # the field sampling_params reads
    return not chat and body.get("echo") is True and type(value) is int and value == 0


def sampling_params(body: dict, max_tokens_default: int, max_model_len: int, prompt_len: int,
                    prompt_param: str = "prompt", vocab_size: int = INT64, chat: bool = False) -> SamplingParams:  # fmt: skip
    """max_tokens_default: when the client gives no max_tokens (bounded by what the context has left);
    a max_tokens that cannot fit in the context is refused, as OpenAI and vLLM do."""
    refuse_unsupported(body)
    logprobs = _logprobs(body, chat)
    flag(body, "echo")
    prompt_logprobs = _number(body, "prompt_logprobs", None, int, low=0, high=MAX_LOGPROBS)
    if body.get("echo") and logprobs is not None and not chat:  # echoed prompt tokens get theirs too, as in vLLM
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    penalties = {name: _number(body, name, 0.0, low=-2.0, high=2.0) for name in ("presence_penalty", "frequency_penalty")}
    penalties["repetition_penalty"] = _number(body, "repetition_penalty", 1.0, low=0.0, high=MAX_REPETITION_PENALTY)
    if penalties["repetition_penalty"] == 0:
        raise ApiError("'repetition_penalty' must be > 0 (1 is off)", param="repetition_penalty")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    requested = _number(body, field, None, int, low=0 if echo_only(body, chat) else 1)
    if requested == 0:  # the prompt scored, no reply: the engine makes one token, which the reply leaves out
        requested = 1
    context_left = max_model_len - prompt_len
    if context_left < 1:
        raise ApiError(f"This model's maximum context length is {max_model_len} tokens. However, your "
                       f"{prompt_param} {_has(prompt_param)} {prompt_len:,} tokens, which leaves no room for a completion.",
                       param=prompt_param)  # fmt: skip
    if requested is None:
        max_tokens = min(max_tokens_default, context_left)
    elif requested > context_left:
        raise ApiError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{prompt_len + requested} tokens ({prompt_len} in the {prompt_param}, {requested} in the "
                       f"completion). Please reduce the length of the {prompt_param} or '{field}'.", param=field)  # fmt: skip
    else:
        max_tokens = requested
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters "
                       f"each", param="stop")  # fmt: skip
    for text in stop:
        check_text(text, "stop")
    stop_ids = body.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else stop_ids
    if not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids",
                       param="stop_token_ids")  # fmt: skip
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in stop_ids):
        raise ApiError(f"'stop_token_ids' must be token ids in [0, {vocab_size})", param="stop_token_ids")
    ignore_eos = flag(body, "ignore_eos")
    min_tokens = _number(body, "min_tokens", 0, int, low=0)
    if min_tokens > max_tokens:
        raise ApiError(f"'min_tokens' ({min_tokens}) must not exceed the reply's most tokens ({max_tokens})",
                       param="min_tokens")  # fmt: skip
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, low=0.0, high=2.0),
        top_p=_number(body, "top_p", 1.0, low=1e-6, high=1.0),
        top_k=_number(body, "top_k", -1, int, low=-1, high=INT64 - 1),
        seed=_number(body, "seed", None, int, low=-INT64, high=INT64 - 1),
        stop=stop, stop_token_ids=stop_ids, ignore_eos=ignore_eos, logprobs=logprobs, **penalties,
        min_tokens=min_tokens, min_p=_number(body, "min_p", 0.0, low=0.0, high=1.0),
        logit_bias=_logit_bias(body, vocab_size), prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=flag(body, "include_stop_str_in_output"),
        skip_special_tokens=flag(body, "skip_special_tokens", True),
    )  # fmt: skip


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's map of token ids (as strings) to a bias in [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(f"'logit_bias' must map at most {MAX_LOGIT_BIAS} token ids to numbers", param="logit_bias")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19 and int(key) < vocab_size):
            raise ApiError(f"'logit_bias' keys must be token ids in [0, {vocab_size})", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ApiError("'logit_bias' values must be numbers in [-100, 100]", param="logit_bias")
        out[int(key)] = value
    return out or None


def logprob_cap(max_model_len: int) -> int:
    """Logprob entries one reply may carry (a body built and sent whole): two contexts' worth with
    every alternative, or MAX_PROMPT_LOGPROB_ENTRIES."""
    return max(MAX_PROMPT_LOGPROB_ENTRIES, 2 * max_model_len * (MAX_LOGPROBS + 1))


def check_reply_logprobs_size(params: SamplingParams, replies: int, stream: bool, max_model_len: int,
                              prompt_entries: int = 0) -> None:  # fmt: skip
    """Refuse a reply, not streamed, whose own tokens' logprobs, with the prompt's it carries
    (check_prompt_logprobs_size's count), would be too many to build: it is sent in one piece
    (streamed, each token's go in their own event)."""
    if params.logprobs is None or stream:
        return
    k = params.logprobs + 1
    own = replies * params.max_tokens * k
    entries = own + prompt_entries
    cap = logprob_cap(max_model_len)
    if entries <= cap:
        return
    choices = f"{replies} choices of up to {params.max_tokens:,} tokens" if replies > 1 else f"up to {params.max_tokens:,} tokens"
    choices = f"{prompt_entries:,} of the prompt's and {own:,} of {choices}" if prompt_entries else choices
    raise ApiError(f"this reply would carry up to {entries:,} logprobs ({choices}, {k} logprobs a token); at most "
                   f"{cap:,} in a reply that is not streamed: stream it (\"stream\": true), or ask for fewer choices, "
                   "tokens or alternatives", param="n" if replies > 1 else "max_tokens")  # fmt: skip


def check_prompt_logprobs_size(params: SamplingParams, prompts: list[list[int]], num: int, chat: bool,
                               stream: bool, echo: bool, max_model_len: int) -> int:  # fmt: skip
    """Refuse a reply whose prompt logprobs would be too many to build: each prompt's, in each of its
    choices (a chat reply that is not streamed carries them once), twice with completions' echo and
    logprobs (in the echoed logprobs and in prompt_logprobs). Returns how many it carries."""
    if params.prompt_logprobs is None:
        return 0
    k = params.prompt_logprobs + 1
    copies = 1 if chat and not stream else num
    scored = echo and params.logprobs is not None and not chat
    tokens = sum(map(len, prompts))
    entries = copies * tokens * k * (2 if scored else 1)
    cap = logprob_cap(max_model_len)
    if entries <= cap:
        return entries
    parts = ([f"{len(prompts)} prompts of {tokens:,} tokens in all"] if len(prompts) > 1 else [f"{tokens:,} prompt tokens"])
    parts += [f"{copies} choices each" if copies > 1 else None, f"{k} logprobs a token",
              "twice: echo with logprobs also fills prompt_logprobs" if scored else None]  # fmt: skip
    param = "prompt" if len(prompts) > 1 else "n" if copies > 1 else "logprobs" if scored else "prompt_logprobs"
    raise ApiError(f"this reply would carry {entries:,} prompt logprobs ({', '.join(filter(None, parts))}); at most "
                   f"{cap:,} in one request: send fewer prompts or choices per request, or ask for fewer "
                   "alternatives", param=param)  # fmt: skip


def num_choices(body: dict, num_prompts: int = 1) -> int:
    """n: how many replies to each prompt (best_of, if given, must be n: none is dropped here); at
    most MAX_CHOICES replies in all."""
    n = body.get("n")
    if n is not None and (type(n) is not int or not 1 <= n <= MAX_CHOICES):  # true == 1 in Python
        raise ApiError(f"'n' must be an integer between 1 and {MAX_CHOICES}", param="n")
    n = n or 1
    if n * num_prompts > MAX_CHOICES:
        raise ApiError(f"{num_prompts} prompts with n = {n} make {n * num_prompts} replies; at most {MAX_CHOICES} "
                       "in one request", param="n")  # fmt: skip
    best_of = body.get("best_of")
    if best_of is not None and (type(best_of) is not int or best_of != n):
        raise ApiError("'best_of' other than n is not supported (every reply is returned)", param="best_of")
    return n


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many best tokens' logprobs each output token reports beside its own (None: no logprobs).
    Completions: logprobs N. Chat: logprobs true, and top_logprobs N (only with logprobs true)."""
    if not chat:
        if body.get("top_logprobs") is not None:
            raise ApiError("'top_logprobs' belongs to chat completions; here 'logprobs': N asks for the N best",
                           param="top_logprobs")  # fmt: skip
        return _number(body, "logprobs", None, int, low=0, high=MAX_LOGPROBS)
    wanted = flag(body, "logprobs")
    top = _number(body, "top_logprobs", None, int, low=0, high=MAX_LOGPROBS)
    if top and not wanted:
        raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


@dataclass(frozen=True, slots=True)
class StreamOptions:
    stream: bool = False
    include_usage: bool = False  # a last chunk with the usage (OpenAI)
    continuous_usage: bool = False  # ... and the usage so far in every chunk (vLLM's continuous_usage_stats)


STREAM_OPTIONS = ("include_usage", "continuous_usage_stats", "include_obfuscation")


def stream_options(body: dict) -> StreamOptions:
    stream = flag(body, "stream")
    opts = body.get("stream_options")
    opts = {} if opts is None else opts
    if not isinstance(opts, dict):
        raise ApiError("'stream_options' must be an object", param="stream_options")
    unknown = sorted(set(opts) - set(STREAM_OPTIONS))
    if unknown:
        raise ApiError(f"unknown stream_options field(s) {unknown}; known: {', '.join(STREAM_OPTIONS)}",
                       param="stream_options")  # fmt: skip
    for name in STREAM_OPTIONS:
        if opts.get(name) is not None and not isinstance(opts[name], bool):
            raise ApiError(f"'stream_options.{name}' must be a boolean", param="stream_options")
    if opts.get("include_obfuscation"):  # OpenAI pads chunks against length side channels; not done here
        raise ApiError("'stream_options.include_obfuscation' is not supported by this server", param="stream_options")
    if body.get("stream_options") is not None and not stream:
        raise ApiError("'stream_options' is only allowed with 'stream': true", param="stream_options")
    include_usage = bool(opts.get("include_usage"))
    return StreamOptions(stream, include_usage, include_usage and bool(opts.get("continuous_usage_stats")))


def flag(body: dict, name: str, default: bool = False) -> bool:
    """A boolean field (null: the default); anything else is a 400 naming it."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(f"'{name}' must be a boolean", param=name)
    return default if value is None else value


def truncate_prompt_tokens(body: dict, max_model_len: int) -> int | None:
    """vLLM's truncate_prompt_tokens: keep the prompt's last K tokens (-1: the context length)."""
    k = body.get("truncate_prompt_tokens")
    if k is None:
        return None
    if type(k) is not int or not (k == -1 or 1 <= k <= max_model_len):  # as vLLM: no more than the context
        raise ApiError(f"'truncate_prompt_tokens' must be an integer from 1 to {max_model_len} (the context "
                       "length), or -1 (the context length)", param="truncate_prompt_tokens")  # fmt: skip
    return max_model_len if k == -1 else k


def context_error(max_model_len: int, param: str, what: str, which: str | None = None) -> ApiError:
    """which: how the message names the prompt (default: the param)."""
    name = which or param
    return ApiError(f"This model's maximum context length is {max_model_len} tokens; the {name} {_has(name)} {what}",
                    param=param)  # fmt: skip


def _has(name: str) -> str:
    return "have" if name == "messages" else "has"


def check_prompt_chars(num_chars: int, max_model_len: int, max_token_chars: int, param: str) -> None:
    """Refuse, before tokenizing, a text that cannot fit: no token is longer than max_token_chars."""
    if num_chars > max_model_len * max_token_chars:
        raise context_error(max_model_len, param, f"{num_chars:,} characters, more than {max_model_len} tokens of at "
                                                  f"most {max_token_chars} characters each can hold")  # fmt: skip


def check_text(text: str, param: str) -> str:
    """JSON may escape half of a UTF-16 surrogate pair (\\ud800): Python holds it, but no tokenizer
    or encoder takes it. Refused as the client's error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(f"'{param}' holds a lone UTF-16 surrogate (U+{ord(text[err.start]):04X}) at character "
                       f"{err.start}: not valid Unicode", param=param) from None  # fmt: skip
    return text


def completion_prompts(body: dict, max_model_len: int, max_token_chars: int,
                       truncated: bool = False) -> list[str | list[int]]:  # fmt: skip
    """The prompts (OpenAI's: a string, token ids, or a list of either, up to MAX_CHOICES), each as
    text (still to be tokenized) or token ids, refused early when it cannot fit (unless `truncated`:
    cut to its last tokens; the body's size still bounds it)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt) \
            or isinstance(prompt, list) and prompt and all(isinstance(x, list) for x in prompt):  # fmt: skip
        if len(prompt) > MAX_CHOICES:
            raise ApiError(f"'prompt' holds {len(prompt)} prompts; at most {MAX_CHOICES} in one request", param="prompt")
        return [_one_prompt(x, max_model_len, max_token_chars, truncated) for x in prompt]
    return [_one_prompt(prompt, max_model_len, max_token_chars, truncated)]


def _one_prompt(prompt, max_model_len: int, max_token_chars: int, truncated: bool) -> str | list[int]:
    if truncated:
        max_model_len = INT64
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("'prompt' must not be empty", param="prompt")
        check_prompt_chars(len(prompt), max_model_len, max_token_chars, "prompt")
        return check_text(prompt, "prompt")
    if isinstance(prompt, list) and len(prompt) >= max_model_len:
        raise context_error(max_model_len, "prompt", f"{len(prompt):,} tokens")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ApiError("'prompt' must be a non-empty string, a list of token ids, or a list of either",
                   param="prompt")  # fmt: skip


def chat_messages(body: dict, max_model_len: int, max_token_chars: int, truncated: bool = False) -> list[dict]:
    """The messages, checked and flattened to text; refused early when they cannot fit (unless
    `truncated`: the prompt is cut to its last tokens)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    if len(messages) > max_model_len:
        raise ApiError(f"'messages' has {len(messages)} entries; at most {max_model_len} (the context length) "
                       "are accepted", param="messages")  # fmt: skip
    clean, num_chars, num_parts = [], 0, 0
    for msg in messages:
        if not isinstance(msg, dict) or msg.get("role") not in ("system", "user", "assistant", "tool", "developer"):
            raise ApiError("each message needs a 'role' of system, developer, user, assistant or tool", param="messages")
        for name in ("tool_calls", "function_call"):  # tools are not supported: a call is never dropped silently
            if msg.get(name) not in (None, [], {}):
                raise ApiError(f"a message's '{name}' is not supported by this server", param="messages")
        if msg.get("name") is not None and not isinstance(msg["name"], str):
            raise ApiError("a message's 'name' must be a string", param="messages")
        content = msg.get("content")
        if content == []:  # no part at all: as no content (OpenAI refuses an empty array)
            content = None
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            num_parts += len(content)
            if num_parts > max_model_len:
                raise ApiError(f"the messages have more than {max_model_len} content parts", param="messages")
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):  # fmt: skip
                raise ApiError("only text content parts are supported, each with its 'text'", param="messages")
            content = "\n".join(p["text"] for p in content)  # as vLLM
        if msg["role"] == "assistant" and content is None:
            content = ""
        if content is None:
            raise ApiError(f"a {msg['role']} message needs its 'content'", param="messages")
        if not isinstance(content, str):
            raise ApiError("message 'content' must be a string or a list of text parts", param="messages")
        num_chars += len(content)
        role = "system" if msg["role"] == "developer" else msg["role"]
        clean.append({"role": role, "content": content})
    if not truncated:
        check_prompt_chars(num_chars, max_model_len, max_token_chars, "messages")
    for msg in clean:
        check_text(msg["content"], "messages")
    return clean


def chat_prompt(messages: list[dict], tokenizer, add_special_tokens: bool = False) -> list[int]:
    """add_special_tokens: as vLLM's (off: the template writes them)."""
    from jinja2.exceptions import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except TemplateError as err:  # the template's own raise_exception: e.g. roles that must alternate
        raise ApiError(f"the model's chat template refused the messages: {err}", param="messages") from None
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                         "stop_reason": None}]}  # fmt: skip


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
                         "stop_reason": None}]}  # fmt: skip


def completion_response(rid, model, created, text, finish_reason, use) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}], "usage": use}  # fmt: skip


def chat_response(rid, model, created, text, finish_reason, use) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}], "usage": use}  # fmt: skip


def now() -> int:
    return int(time.time())
