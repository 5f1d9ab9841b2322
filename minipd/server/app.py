"""The aiohttp application: OpenAI-compatible endpoints, health, metrics, timelines, events, admin.
The only place where the server's errors become HTTP status codes."""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from itertools import takewhile
from pathlib import Path

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from aiohttp.web_urldispatcher import SystemRoute
from yarl import URL

from minipd.server import protocol as p
from minipd.server.advisor import GOODPUT_MEANING
from minipd.server.browser_guard import BrowserGuard
from minipd.server.choices import Reply, choice_params
from minipd.server.encode import dumps_in_pieces
from minipd.server.errors import Conflict, InvalidRequest, NotFound, Overloaded, ServeError, Unavailable, shown
from minipd.server.http_runner import SUPPORTED_ENCODINGS, ApiRunner, BodyCutShort, http_exception_as_json
from minipd.server.logprobs import LogprobsWriter, vllm_prompt_logprobs
from minipd.server.metrics import CONTENT_TYPE
from minipd.server.modes import INTEGER_SETTINGS, LINK_SETTINGS, check_whatever_it_meets, requested_mode
from minipd.server.protocol import ApiError
from minipd.server.router import Router
from minipd.server.worker_pool import unresponsive

log = logging.getLogger("minipd.api")
STATUS = {InvalidRequest: (400, "invalid_request_error"), NotFound: (404, "invalid_request_error"),
          Overloaded: (429, "rate_limit_error"), Unavailable: (503, "server_error"),
          Conflict: (409, "invalid_request_error")}  # fmt: skip
OPEN_PATHS = ("/health", "/metrics")
MIN_BODY_LIMIT = 8 * 2**20  # parsing a body holds the event loop: 8 MiB of token ids take ~0.25 s, 32 MiB ~1 s
CORS = web.RequestKey("cors", dict)
INLINE_LOGPROBS = 512  # tokens whose logprobs are built on the loop; more are built in a thread
INLINE_TOKENIZE_CHARS = 8192  # shorter texts are tokenized on the loop (well under a millisecond)
TEMPLATE_CHARS_PER_MESSAGE = 64  # what a chat template adds around each message, about
MAX_BODY_LIMIT = 16 * 2**20
MAX_TOKEN_IDS = 131_072  # /tokenize's and /detokenize's: 16 contexts of the default model (1.4 million made a 114 MB reply)
BODY_TIMEOUT_S = 60.0  # a body not in within this (a client that stalled mid-body) gets a 408
STATIC = Path(__file__).parent / "static"  # the teaching page served at /
HERE = "\u0000minipd choices\u0000"  # where a reply's encoded choices go in its encoded body (ids and model come before)
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}  # as vLLM's


def json_error(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


def sse_event(obj: dict | bytes) -> bytes:
    """One server-sent event (bytes: already encoded, as a chunk with a whole prompt's logprobs is)."""
    data = obj if isinstance(obj, bytes) else json.dumps(obj, ensure_ascii=False).encode()
    return b"data: " + data + b"\n\n"


def as_api_error(err: ServeError) -> ApiError:
    status, kind = STATUS.get(type(err), (500, "server_error"))
    return ApiError(str(err), status, param=err.param, type_=kind, code=err.code)


@web.middleware
async def errors_as_json(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as err:
        resp = json_error(err)
        if request.content.exception() is not None:  # a body that could not be decoded: the rest of it
            request.content.feed_eof()  # is not read (aiohttp's lingering read would raise again)
            resp.force_close()  # and the connection ends, its position in the stream unknown
        return resp
    except ServeError as err:
        return json_error(as_api_error(err))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return http_exception_as_json(exc)
    except ConnectionResetError:  # the client went away: nothing to answer, nothing wrong
        log.debug("client of %s %s went away", request.method, request.path)
        return web.Response(status=499)  # nginx's "client closed request"; nobody will read it
    except Exception:
        log.exception("unhandled error")
        return json_error(ApiError("internal server error", 500, type_="server_error"))


def without_trailing_slash(request: web.Request) -> str | None:
    """Where vLLM (Starlette) sends a path with a trailing slash: the path without it, the query as
    sent; None where that would leave this server (a Location of //host/... names another host)."""
    if not request.raw_path.startswith("/"):  # absolute-form (http://host/...): its authority is not ours to send to
        return None
    path, sep, query = request.raw_path.partition("?")
    bare = path.rstrip("/")
    if not path.endswith("/") or not bare or bare.startswith("//"):
        return None
    return bare + sep + query


@web.middleware
async def redirect_trailing_slash(request: web.Request, handler):
    """A 307 (the method and body are kept) where the path without its slash would be served."""
    if isinstance(request.match_info.route, SystemRoute) and (where := without_trailing_slash(request)):
        match = await request.app.router.resolve(request.clone(rel_url=where))
        if match.http_exception is None or match.http_exception.status != 404:  # served, or not with this method
            raise web.HTTPTemporaryRedirect(URL(where, encoded=True))  # as sent: yarl would decode it
    return await handler(request)


GUARDED_HEADERS = ("Host", "Origin", "Sec-Fetch-Site", "Access-Control-Request-Method")


def guard_browsers(guard: BrowserGuard):
    """browser_guard.py's rules; a CORS preflight is answered here, before the API key is asked for."""

    def refuse(message: str, code: str) -> web.Response:
        return json_error(ApiError(message, 403, type_="invalid_request_error", code=code))

    @web.middleware
    async def check(request: web.Request, handler):
        for name in GUARDED_HEADERS:  # each is checked below; a second copy must not slip past
            if len(request.headers.getall(name, ())) > 1:
                return json_error(ApiError(f"the {name} header was sent more than once", 400, code="duplicate_header"))
        host = request.headers.get("Host")
        why = guard.host_refusal(host)
        if not why and not request.raw_path.startswith("/"):  # absolute-form: its authority is the host served
            why = guard.host_refusal(request.url.raw_authority or "")  # (RFC 9112), aiohttp's request.host too
        if why:
            return refuse(why, "host_not_allowed")
        origin = request.headers.get("Origin")
        method = request.method
        if method == "OPTIONS":  # a CORS preflight asks for the method to come
            method = request.headers.get("Access-Control-Request-Method", method).upper()
        why = guard.origin_refusal(method, request.path, origin, host, request.headers.get("Sec-Fetch-Site"))
        if why:
            return refuse(why, "origin_not_allowed")
        cors = guard.cors_headers(origin, request.path)
        if request.method == "OPTIONS" and origin is not None:
            allow = request.headers.get("Access-Control-Request-Headers", "Authorization, Content-Type")
            return web.Response(status=204, headers={**cors, "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                                                     "Access-Control-Allow-Headers": allow,
                                                     "Access-Control-Max-Age": "600"})  # fmt: skip
        request[CORS] = cors
        return await handler(request)

    return check


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.update(request.get(CORS) or {})


def require_api_key(key: str):
    """vLLM's --api-key: /v1 and /admin need `Authorization: Bearer <key>`; health and metrics stay open."""

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path.startswith(("/v1", "/admin")):
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            given = given.lstrip(" ").encode("utf-8", "surrogateescape")  # RFC 9110: 1*SP; any bytes
            if scheme.lower() != "bearer" or not hmac.compare_digest(given, key.encode()):
                return json_error(ApiError("a valid API key is needed: send 'Authorization: Bearer <key>'", 401,
                                           type_="invalid_request_error", code="invalid_api_key"))  # fmt: skip
        return await handler(request)

    return check


class Api:
    def __init__(self, router: Router, model_name: str, max_model_len: int, default_max_tokens: int = 1024,
                 api_key: str | None = None, kv_transport: str = "shm", guard: BrowserGuard | None = None):  # fmt: skip
        self.router = router
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.api_key = api_key
        self.kv_transport = kv_transport
        self.tokenizer = router.tokenizer
        self.guard = guard or BrowserGuard("127.0.0.1")
        self.max_token_chars = self.tokenizer.max_token_chars if self.tokenizer else 1
        self.tokenize_thread = ThreadPoolExecutor(1, thread_name_prefix="minipd-tokenize")
        # /tokenize and /detokenize: a client's 8 MB text there does not hold up the prompts being served
        self.endpoint_thread = ThreadPoolExecutor(1, thread_name_prefix="minipd-tokenize-endpoint")
        # a prompt's logprobs, whole contexts of them, are built here (the loop gets the GIL between bytecodes)
        self.reply_thread = ThreadPoolExecutor(1, thread_name_prefix="minipd-reply")
        self.token_texts: dict[int, str] = {}  # token id -> its text, for logprobs (at most the vocabulary)
        self.body_timeout_s = BODY_TIMEOUT_S
        self.max_body_bytes = min(MAX_BODY_LIMIT, max(MIN_BODY_LIMIT, 2 * max_model_len * self.max_token_chars))

    def runner(self, **kwargs) -> web.AppRunner:
        """The runner to serve `app()` with: aiohttp's own error answers in JSON too."""
        return ApiRunner(self.app(), **kwargs)

    def app(self) -> web.Application:
        middlewares = [errors_as_json, guard_browsers(self.guard)]
        middlewares += [require_api_key(self.api_key)] if self.api_key else []
        middlewares += [redirect_trailing_slash]  # after the key: a 401 says nothing of which routes exist
        app = web.Application(middlewares=middlewares, client_max_size=self.max_body_bytes)
        app.on_response_prepare.append(add_cors_headers)
        app.on_cleanup.append(self._stop_tokenizing)
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model:.+}", self.model),  # ids may hold a '/' (org/name)
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
            web.get("/v1/requests/{request_id}/timeline", self.timeline),
            web.get("/admin/mode", self.get_mode),
            web.post("/admin/mode", self.post_mode),
            web.get("/admin/workers", self.workers),
            web.get("/admin/advisor", self.advisor),
            web.post("/admin/workers/{worker_id}/drain", self.drain_worker),
            web.post("/admin/workers/{worker_id}/resume", self.resume_worker),
            web.get("/admin/events", self.events, allow_head=False),  # a HEAD must not get the stream
            web.get("/", self.page),
            web.get("/static/{name}", self.static),
        ])  # fmt: skip
        return app

    # ---- OpenAI endpoints ---------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        keep = p.truncate_prompt_tokens(body, self.max_model_len)
        special = p.flag(body, "add_special_tokens", True)
        prompts, texts = [], []
        given = p.completion_prompts(body, self.max_model_len, self.max_token_chars, truncated=keep is not None)
        for i, prompt in enumerate(given):
            text = prompt if isinstance(prompt, str) else None
            which = f"prompt {i} of {len(given)}" if len(given) > 1 else "prompt"
            if text is not None:
                prompt = await self._off_loop(len(text), self._tokenizer().encode, text, special)
            else:  # before echo decodes them and truncation cuts any off
                self._check_token_ids(prompt, which)
            if keep is not None and len(prompt) > keep:  # echo then shows the tokens kept
                prompt, text = prompt[-keep:], None
            if len(prompt) >= self.max_model_len:  # refused before the batch's next prompts are tokenized
                raise p.context_error(self.max_model_len, "prompt", f"{len(prompt):,} tokens", which)
            prompts.append(prompt)
            texts.append(text)
        echoes = [None] * len(prompts)  # echo: each prompt's text, as given (or its tokens decoded)
        if p.flag(body, "echo"):
            echoes = [text if text is not None else self.tokenizer.decode(ids, skip_special_tokens=False)
                      if self.tokenizer else "" for ids, text in zip(prompts, texts)]  # fmt: skip
        return await self._serve(request, body, prompts, chat=False, echoes=echoes)

    def _check_token_ids(self, ids: list[int], which: str) -> None:
        vocab = len(self.tokenizer) if self.tokenizer else None
        if vocab and any(t < 0 or t >= vocab for t in ids):
            raise ApiError(f"{which}: token ids must be in [0, {vocab})", param="prompt")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        keep = p.truncate_prompt_tokens(body, self.max_model_len)
        messages, ids = await self._chat_ids(body, truncated=keep is not None)
        last = messages[-1]  # vLLM's echo: the assistant's last message (closed by the template) starts the reply
        echo = last["content"] if p.flag(body, "echo") and last["role"] == "assistant" else None
        return await self._serve(request, body, [ids[-keep:] if keep is not None else ids], chat=True, echoes=[echo])

    async def _chat_ids(self, body: dict, truncated: bool = False,
                        pool: ThreadPoolExecutor | None = None) -> tuple[list[dict], list[int]]:  # fmt: skip
        """The body's messages, checked, and the token ids the chat template makes of them."""
        special = p.flag(body, "add_special_tokens", False)  # vLLM's chat default: the template writes them
        messages = p.chat_messages(body, self.max_model_len, self.max_token_chars, truncated=truncated)
        num_chars = sum(len(msg["content"]) + TEMPLATE_CHARS_PER_MESSAGE for msg in messages)
        return messages, await self._off_loop(num_chars, p.chat_prompt, messages, self._tokenizer(), special, pool=pool)

    async def _off_loop(self, num_chars: int, fn, *args, pool: ThreadPoolExecutor | None = None):
        """Tokenizing a long text takes a while (about 2 s per MB): never on the event loop."""
        return await self._maybe_off_loop(num_chars >= INLINE_TOKENIZE_CHARS, fn, *args, pool=pool or self.tokenize_thread)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a prompt, or chat messages, as the token ids the server would read."""
        body = await self._body(request)
        self._check_model(body)
        if ("prompt" in body) == ("messages" in body):
            raise ApiError("/tokenize takes a 'prompt' (a string) or 'messages', one of them", param="prompt")
        if "messages" in body:
            p.refuse_chat_template_options(body)
            _, ids = await self._chat_ids(body, pool=self.endpoint_thread)
        else:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise ApiError("'prompt' must be a string", param="prompt")
            p.check_text(prompt, "prompt")
            special = p.flag(body, "add_special_tokens", True)
            ids = await self._off_loop(len(prompt), self._tokenizer().encode, prompt, special, pool=self.endpoint_thread)
        if len(ids) > MAX_TOKEN_IDS:
            given = "messages" if "messages" in body else "prompt"
            raise ApiError(f"'{given}' {'are' if given == 'messages' else 'is'} {len(ids):,} tokens; /tokenize answers at "
                           f"most {MAX_TOKEN_IDS:,} tokens", param=given)  # fmt: skip
        strs = None
        if p.flag(body, "return_token_strs"):  # a decode per id: many of them off the loop
            strs = await self._off_loop(4 * len(ids), lambda: [self._token_text(t) for t in ids], pool=self.endpoint_thread)
        return web.json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: token ids to text, special tokens kept (as vLLM's) unless skip_special_tokens."""
        body = await self._body(request)
        self._check_model(body)
        tokens, vocab = body.get("tokens"), len(self._tokenizer())
        if isinstance(tokens, list) and len(tokens) > MAX_TOKEN_IDS:
            raise ApiError(f"'tokens' has {len(tokens):,} ids; at most {MAX_TOKEN_IDS:,} in one request",
                           param="tokens")  # fmt: skip
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
            raise ApiError(f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
        skip = p.flag(body, "skip_special_tokens", False)
        text = await self._off_loop(4 * len(tokens), self.tokenizer.decode, tokens, skip, pool=self.endpoint_thread)
        return web.json_response({"prompt": text})

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError("'model' must be a string", param="model")
        if model not in (None, self.model_name):
            raise ApiError(f"model {shown(model)} is not served here; this server serves {self.model_name!r}",
                           404, param="model", code="model_not_found")  # fmt: skip

    async def _serve(self, request, body, prompts: list[list[int]], chat: bool,
                     echoes: list[str | None]) -> web.StreamResponse:  # fmt: skip
        """prompts: token ids (completions may bring several); echoes: the text each one's replies
        start with (echo), or None."""
        self._check_model(body)
        prompt_param = "messages" if chat else "prompt"
        vocab = len(self.tokenizer) if self.tokenizer else None
        for ids in prompts:
            if len(ids) >= self.max_model_len:
                raise p.context_error(self.max_model_len, prompt_param, f"{len(ids):,} tokens")
        opts = p.stream_options(body)
        default = self.default_max_tokens if chat else 16
        longest = max(map(len, prompts))
        params = p.sampling_params(body, default, self.max_model_len, longest, prompt_param, vocab or p.INT64, chat)
        num = p.num_choices(body, len(prompts))
        prompt_entries = p.check_prompt_logprobs_size(params, prompts, num, chat, opts.stream,
                                                      any(e is not None for e in echoes), self.max_model_len)  # fmt: skip
        total = num * len(prompts)
        p.check_reply_logprobs_size(params, total, opts.stream, self.max_model_len, prompt_entries)
        if total > (most := self.router.most_requests()):
            raise ApiError(f"this request asks for {total} replies ({len(prompts)} prompts x n {num}); this server holds at "
                           f"most {most} at once (--max-num-seqs per worker and --max-waiting): send fewer",
                           param="n" if num > 1 else "prompt")  # fmt: skip
        token_text = token_id_text if p.flag(body, "return_tokens_as_token_ids") else self._token_text
        rid = p.new_id("chatcmpl" if chat else "cmpl")
        reply = Reply(rid, [], chat, [echo for echo in echoes for _ in range(num)], token_text,
                      sum(map(len, prompts)), p.flag(body, "return_token_ids"), p.echo_only(body, chat))  # fmt: skip
        try:
            for index in range(total):  # every choice a request of its own; a lone one keeps the reply's id
                ids, params_i = prompts[index // num], choice_params(params, index % num)
                reply.states.append(self.router.submit(rid if total == 1 else f"{rid}-{index}", ids, params_i))
            if opts.stream:
                return await self._stream(request, reply, opts)
            return await self._collect(reply)
        except (asyncio.CancelledError, ConnectionResetError):
            log.debug("client went away; request %s aborted", rid)
            raise
        finally:
            for state in reply.states:
                if not state.finished:
                    self.router.abort(state.request_id)  # the client went away (or a choice failed): free the blocks

    async def _collect(self, reply: Reply) -> web.Response:
        states, chat = reply.states, reply.chat
        texts, counts, ends = [""] * len(states), [0] * len(states), [None] * len(states)
        logprobs, token_ids = [[] for _ in states], [[] for _ in states]
        async with aclosing(reply.deltas()) as deltas:
            async for i, d in deltas:
                texts[i] += d.text
                token_ids[i] += d.token_ids or []
                counts[i] += d.num_tokens
                logprobs[i] += d.logprobs or []
                if d.error:
                    raise ApiError(d.error, d.error_status, type_="server_error", code=d.error_code)
                ends[i] = d.finish_reason or ends[i]
        use = p.usage(reply.prompt_tokens, sum(counts))
        make = p.chat_response if chat else p.completion_response
        body = make(reply.rid, self.model_name, p.now(), texts[0], ends[0], use)
        body["choices"] = [make(reply.rid, self.model_name, 0, text, end, use)["choices"][0] | {"index": i}
                           for i, (text, end) in enumerate(zip(texts, ends))]  # fmt: skip
        params = states[0].params
        if reply.return_token_ids and chat:
            body["prompt_token_ids"] = states[0].prompt_token_ids
        for i, (choice, entries, state, echo, ids) in enumerate(zip(body["choices"], logprobs, states, reply.echoes, token_ids)):
            choice["stop_reason"] = reply.stop_reason(i)
            if reply.return_token_ids:
                choice.update({"token_ids": ids} if chat else {"prompt_token_ids": state.prompt_token_ids, "token_ids": ids})
            scored = echo is not None and params.logprobs is not None and not chat  # completions' echo has logprobs
            asked = params.logprobs is not None or params.prompt_logprobs is not None
            big = asked and len(state.prompt_token_ids) + len(entries) > INLINE_LOGPROBS
            await self._maybe_off_loop(big, self._fill_logprobs, reply, choice, state, entries, scored)
            if echo is not None and chat:
                choice["message"]["content"] = echo + choice["message"]["content"]
            elif echo is not None:
                choice["text"] = echo + choice["text"]
            await asyncio.sleep(0)  # a reply of many choices is built a choice at a time: other clients go on between
        if params.prompt_logprobs is not None and chat:
            body["prompt_logprobs"] = await self._maybe_off_loop(len(states[0].prompt_token_ids) > INLINE_LOGPROBS,
                                                                 vllm_prompt_logprobs, states[0].prompt_entries(),
                                                                 self._token_text)  # fmt: skip
        choices = []
        for choice in body["choices"]:  # and encoded so, long lists a slice at a time
            choices.append(await dumps_in_pieces(choice))
            await asyncio.sleep(0)
        body["choices"] = HERE
        text = (await dumps_in_pieces(body)).replace(json.dumps(HERE), "[" + ", ".join(choices) + "]", 1)  # the first: before any text
        return web.Response(text=text, content_type="application/json")

    def _fill_logprobs(self, reply: Reply, choice: dict, state, entries: list, scored: bool) -> None:
        """A choice's logprobs (with completions' echo, its prompt's first) and prompt_logprobs."""
        params = state.params
        if params.logprobs is not None:
            writer = LogprobsWriter(reply.token_text, reply.chat)
            head = writer.echoed(state.prompt_token_ids, state.prompt_entries()) if scored else None
            choice["logprobs"] = writer(entries)
            if head is not None:
                choice["logprobs"] = {k: head[k] + v for k, v in choice["logprobs"].items()}
        if params.prompt_logprobs is not None and not reply.chat:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(state.prompt_entries(), self._token_text)

    async def _maybe_off_loop(self, big: bool, fn, *args, pool: ThreadPoolExecutor | None = None):
        """fn in a thread when its work is big (by default the logprobs thread: a whole context's take
        about 0.1 s per 4,000 tokens of 20), else here."""
        if not big:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(pool or self.reply_thread, fn, *args)

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return token_id_text(token_id)  # as vLLM without a tokenizer
        text = self.token_texts.get(token_id)
        if text is None:  # a whole context's logprobs name 20 tokens per token: decoded once each
            text = self.token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    async def _stream(self, request, reply: Reply, opts: p.StreamOptions) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        created = p.now()

        async def send(obj: dict | bytes) -> None:
            await resp.write(sse_event(obj))

        def chunk(delta, finish_reason, index: int = 0):
            make = p.chat_chunk if reply.chat else p.completion_chunk
            obj = make(reply.rid, self.model_name, created, delta, finish_reason)
            obj["choices"][0]["index"] = index
            return obj

        try:
            await resp.prepare(request)
            await self._stream_deltas(reply, send, chunk, opts)
            await resp.write_eof()
        except ConnectionResetError:  # the client went away mid-stream; _serve frees the request
            log.debug("client of %s went away", reply.rid)
        return resp

    async def _stream_deltas(self, reply: Reply, send, chunk, opts: p.StreamOptions) -> None:
        states, chat = reply.states, reply.chat
        counts = [0] * len(states)
        writers = [LogprobsWriter(reply.token_text, chat) if s.params.logprobs is not None else None for s in states]
        logprobs = [[] for _ in states]  # of tokens whose text has not gone yet (held back: half a character, a stop string's start)

        prompt_ids_sent = [False] * len(states)

        async def send_chunk(obj: dict, index: int, token_ids: list[int] | None = None, large: bool = False) -> None:
            if reply.return_token_ids:  # as vLLM: the prompt's ids in a choice's first chunk, each chunk's own ids
                obj["choices"][0]["token_ids"] = token_ids or []
                if not prompt_ids_sent[index]:
                    prompt_ids_sent[index] = True
                    (obj if chat else obj["choices"][0])["prompt_token_ids"] = states[index].prompt_token_ids
            if opts.continuous_usage:  # as vLLM: the usage of this chunk's choice so far
                obj["usage"] = p.usage(len(states[index].prompt_token_ids), counts[index])
            if writers[index] is not None and logprobs[index]:
                obj["choices"][0]["logprobs"] = writers[index](logprobs[index])
                logprobs[index].clear()
            await send((await dumps_in_pieces(obj, ensure_ascii=False)).encode() if large else obj)  # large: the prompt's

        if chat:
            for i in range(len(states)):
                await send_chunk(chunk({"role": "assistant", "content": ""}, None, i), i)
        started = [False] * len(states)
        async with aclosing(reply.deltas()) as deltas:
            async for i, d in deltas:
                if not started[i] and not d.error:  # the prompt's part comes first: known once its first token is
                    started[i] = True
                    await self._stream_prompt(reply, i, functools.partial(send_chunk, index=i), chunk, writers[i])
                counts[i] += d.num_tokens
                logprobs[i] += d.logprobs or []
                if d.error:
                    await send(ApiError(d.error, d.error_status, type_="server_error", code=d.error_code).body())
                    break
                if d.text or d.finish_reason or d.token_ids:  # as vLLM: a chunk per step that made tokens, its text may be empty
                    # chat: content "" where there is no text, as OpenAI's and vLLM's; {} only on the last, with nothing to add
                    text = {"content": d.text} if chat and (d.text or not d.finish_reason) else {} if chat else d.text
                    obj = chunk(text, d.finish_reason, i)
                    if d.finish_reason:
                        obj["choices"][0]["stop_reason"] = reply.stop_reason(i)
                    await send_chunk(obj, i, d.token_ids)
        if opts.include_usage:
            obj = chunk({}, None)
            obj["choices"] = []
            obj["usage"] = p.usage(reply.prompt_tokens, sum(counts))
            timelines = [self.router.timeline(s.request_id) for s in states]
            obj.update({"timeline": timelines[0]} if len(states) == 1 else {"timelines": timelines})
            await send(obj)
        await send(b"[DONE]")

    async def _stream_prompt(self, reply: Reply, index: int, send, chunk, writer) -> None:
        """The echo (completions: the prompt's text, and its tokens' logprobs; chat: the assistant's last
        message), and prompt_logprobs if asked."""
        state, echo, chat = reply.states[index], reply.echoes[index], reply.chat
        params = state.params
        if echo is None and params.prompt_logprobs is None:
            return
        obj = chunk(({"content": echo} if echo is not None else {}) if chat else echo or "", None, index)
        big = len(state.prompt_token_ids) > INLINE_LOGPROBS
        if echo is not None and writer is not None and not chat:
            echoed = await self._maybe_off_loop(big, writer.echoed, state.prompt_token_ids, state.prompt_entries())
            obj["choices"][0]["logprobs"] = echoed
        if params.prompt_logprobs is not None:
            where = obj if chat else obj["choices"][0]
            where["prompt_logprobs"] = await self._maybe_off_loop(big, vllm_prompt_logprobs, state.prompt_entries(),
                                                                  self._token_text)  # fmt: skip
        await send(obj, large=True)

    # ---- the rest ----------------------------------------------------------------------
    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": p.now(), "owned_by": "minipd",
                "root": self.model_name, "parent": None, "max_model_len": self.max_model_len}  # fmt: skip

    async def models(self, request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request) -> web.Response:
        name = request.match_info["model"]
        if name.endswith("/") and name.rstrip("/") == self.model_name and (where := without_trailing_slash(request)):
            raise web.HTTPTemporaryRedirect(URL(where, encoded=True))  # the route's id takes the slash: as any other path's
        if name != self.model_name:
            raise ApiError(f"model {shown(name)} is not served here; this server serves {self.model_name!r}",
                           404, param="model", code="model_not_found")  # fmt: skip
        return web.json_response(self._model_card())

    async def health(self, request) -> web.Response:
        r = self.router
        if not r.ready:
            return web.json_response({"status": "starting"}, status=503)
        if r.fault:
            return web.json_response({"status": "unhealthy", "error": r.fault}, status=503)
        if not r.accepting:
            return web.json_response({"status": "draining"}, status=503)
        dead = [w.worker_id for w in r.pool.workers if w.state == "dead"]
        if dead:
            causes = [w.exit_cause for w in r.pool.workers if w.state == "dead"]
            return web.json_response({"status": "unhealthy", "dead_workers": dead, "causes": causes}, status=503)
        restarting = [w.worker_id for w in r.pool.workers if w.state != "up"]
        if restarting:
            causes = [w.exit_cause for w in r.pool.workers if w.state != "up"]
            return web.json_response({"status": "degraded", "restarting_workers": restarting, "causes": causes,
                                      "mode": r.mode.name})  # fmt: skip
        silent = unresponsive(r.pool, r.pool.workers)
        if silent:  # stopped or stuck: --worker-timeout replaces it; meanwhile a switch is refused
            return web.json_response({"status": "degraded", "unresponsive_workers": list(silent),
                                      "silent_seconds": [round(s, 1) for s in silent.values()], "mode": r.mode.name})  # fmt: skip
        return web.json_response({"status": "ok", "mode": r.mode.name})

    async def metrics(self, request) -> web.Response:
        resp = web.Response(body=self.router.metrics.render())
        resp.headers["Content-Type"] = CONTENT_TYPE
        return resp

    async def timeline(self, request) -> web.Response:
        rid = request.match_info["request_id"]
        t = self.router.timeline(rid)
        if t is None:  # a reply of n choices: choice i ran as request rid-i
            parts = (self.router.timeline(f"{rid}-{i}") for i in range(p.MAX_CHOICES))
            choices = list(takewhile(lambda t: t is not None, parts))
            t = {"request_id": rid, "choices": choices} if choices else None
        if t is None:
            raise NotFound("no such request (or it ended too long ago)", code="not_found")
        return web.json_response(t)

    async def get_mode(self, request) -> web.Response:
        return web.json_response(self.router.mode_report())

    async def post_mode(self, request) -> web.Response:
        body = await self._body(request)
        cur = self.router.mode
        unknown = set(body) - {"mode", "drain", *INTEGER_SETTINGS, *LINK_SETTINGS}
        if unknown:
            raise InvalidRequest(f"unknown field(s) {sorted(unknown)}; /admin/mode takes mode, chunk_tokens, "
                                 "workers, prefill_workers, decode_workers, kv_link_gbps, kv_link_latency_ms, "
                                 "local_prefill_tokens and drain", param=sorted(unknown)[0])  # fmt: skip
        drain = body.get("drain", False)
        if not isinstance(drain, bool):
            raise InvalidRequest("'drain' must be true or false", param="drain")
        if body.get("mode") == "auto":  # the advisor chooses from now on (GET /admin/advisor says what and why)
            if set(body) - {"mode"}:
                raise InvalidRequest("'auto' takes no other field: the advisor chooses them", param=sorted(set(body) - {"mode"})[0])
            self.router.advisor.enable()
            return web.json_response(self.router.mode_report())
        num_workers = len(self.router.pool.workers)
        if not self.router.switcher.lock.locked():  # refused at once; during a switch, against the mode it leaves
            requested_mode(body, cur).check(num_workers)
        else:  # ... and at once if no mode could take it
            check_whatever_it_meets(body, num_workers)
        for field in LINK_SETTINGS:
            if body.get(field) and self.kv_transport != "tcp":
                raise InvalidRequest(f"'{field}' needs the server started with --kv-transport tcp", param=field)

        def resolve(served):
            mode = requested_mode(body, served)
            mode.check(num_workers)
            return mode

        self.router.advisor.enable(False)  # a mode chosen by hand ends `auto` when asked for (not when it lands)
        outcome = await self.router.set_mode(resolve, drain=drain)
        return web.json_response({**self.router.mode.as_dict(), "switch": outcome})

    async def workers(self, request) -> web.Response:
        r = self.router
        rows = []
        for w in r.pool.workers:
            s = w.stats
            rows.append({"id": w.worker_id, "pid": w.pid, "state": w.state, "alive": w.alive, "role": w.role,
                         "device": w.device, "incarnation": w.incarnation, "restarts": w.num_restarts,
                         "exit_cause": w.exit_cause, "kv_transport": self.kv_transport,
                         "kv_address": w.info.kv_address if w.info else None,  # handoff notes (tcp: the KV too)
                         "kv_shm_segment": w.info.kv_cache_name if w.info and self.kv_transport == "shm" else None,
                         "requests_running": s.num_running if s else 0, "requests_waiting": s.num_waiting if s else 0,
                         "inflight": r.load(w.worker_id), "kv_blocks_used": s.blocks_used if s else 0,
                         "kv_blocks_seated": s.blocks_seated if s else 0, "kv_blocks_booked": s.blocks_booked if s else 0,
                         "kv_blocks_total": w.info.num_blocks if w.info else None,
                         "kv_block_size": w.info.block_size if w.info else None,
                         "kv_bytes_per_token": w.info.kv_bytes_per_token if w.info else None,
                         "preemptions": s.num_preempted if s else 0, "handoffs": s.handoffs if s else {},
                         "step_seconds": round(w.step_s, 3), "draining": w.draining,
                         "integrity_error": s.integrity_error if s else None,
                         "gc": s.gc if s else None})  # fmt: skip
        return web.json_response({"mode": r.mode_report(), "kv_transport": self.kv_transport, "workers": rows,
                                  "seats": {"waiting": r.seats.num_waiting, "batches_sent": r.seats.batches_sent,
                                            "granted": r.seats.seats_granted}})  # fmt: skip

    async def advisor(self, request) -> web.Response:
        a = self.router.advisor
        return web.json_response({"enabled": a.enabled, "window_s": a.config.window_s,
                                  "slo_ttft_s": a.config.slo_ttft_s, "slo_tpot_s": a.config.slo_tpot_s,
                                  "min_gain": a.config.min_gain, "model": a.config.model,
                                  "profile": "given" if a.config.profile else "fitted live from the workers' steps",
                                  "goodput": GOODPUT_MEANING[a.config.model], "decisions": list(a.entries)})  # fmt: skip

    def _worker(self, request):
        name = request.match_info["worker_id"]
        workers = self.router.pool.workers
        if not (re.fullmatch(r"0|[1-9][0-9]{0,8}", name) and int(name) < len(workers)):  # not -1, not 01
            raise NotFound(f"no worker {name!r}", code="not_found")
        w = workers[int(name)]
        if not w.alive:
            raise ApiError(f"worker {w.worker_id} is {w.state}, not up", 409)
        return w

    async def drain_worker(self, request) -> web.Response:
        """Move the worker's running replies to the others and give it no new ones; {"restart": true}
        then stops it and it starts again (a restart that costs nobody their reply)."""
        w = self._worker(request)
        body = await self._body(request) if request.can_read_body else {}
        unknown = set(body) - {"restart", "timeout"}
        if unknown:
            raise InvalidRequest(f"unknown field(s) {sorted(unknown)}; drain takes restart and timeout",
                                 param=sorted(unknown)[0])  # fmt: skip
        restart, timeout = body.get("restart", False), body.get("timeout", 60)
        if not isinstance(restart, bool):
            raise InvalidRequest("'restart' must be true or false", param="restart")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            raise InvalidRequest("'timeout' must be a number of seconds in (0, 3600]", param="timeout")
        r = self.router
        others = [x for x in r.pool.workers if x is not w and x.role == w.role
                  and (x.alive and not x.draining or x.state in ("starting", "restarting"))]  # fmt: skip
        if w.role != "idle" and not restart and not others:
            raise ApiError(f"worker {w.worker_id} is the only {w.role} worker left: drained, it would leave new "
                           f"requests waiting for a resume; switch the mode first (POST /admin/mode), or drain "
                           f"with restart", 409, type_="invalid_request_error", code="last_worker_of_its_role")  # fmt: skip
        outcome = await asyncio.shield(r.spawn(r.mover.drain_worker(w.worker_id, float(timeout), stop=restart)))
        return web.json_response(outcome)

    async def resume_worker(self, request) -> web.Response:
        w = self._worker(request)
        body = await self._body(request) if request.can_read_body else {}
        if body:
            raise InvalidRequest(f"unknown field(s) {sorted(body)}; resume takes none", param=sorted(body)[0])
        w.draining = False
        self.router.events.publish({"type": "worker", "worker": w.worker_id, "state": "up", "time": time.time()})
        self.router.seats.pump()
        return web.json_response({"worker": w.worker_id, "draining": False})

    async def events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: every engine step, transfer, seat, mode switch and worker change.
        ?since=T first replays what is kept from time T on (seconds since the epoch)."""
        since = request.query.get("since")
        if since is not None and not (re.fullmatch(r"[0-9]{1,12}(\.[0-9]{0,9})?", since)):
            raise InvalidRequest("'since' must be a number of seconds since the epoch, such as 1764000000.5",
                                 param="since")  # fmt: skip
        since = time.time() if since is None else float(since)
        log_ = self.router.events
        queue = log_.subscribe()
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        try:
            for i, event in enumerate(log_.since(since)):
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                if i % 256 == 255:
                    await asyncio.sleep(0)  # a long replay takes turns with the other clients
            while True:
                if log_.ended(queue):
                    await resp.write(b": cut off: this reader fell %d events behind; reconnect with ?since= the last "
                                     b"event's time\n\n" % queue.maxsize)  # fmt: skip
                    break
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=15)
                except asyncio.TimeoutError:
                    await resp.write(b": keep-alive\n\n")
                    continue
                if event is None:  # the server is stopping
                    break
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        except ConnectionResetError:
            pass
        finally:
            log_.unsubscribe(queue)
        return resp

    # ---- the teaching page (open, like /health: the page asks for the API key itself) ----------
    async def page(self, request) -> web.FileResponse:
        return WholeFile(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def static(self, request) -> web.FileResponse:
        name = request.match_info["name"]
        files = {f.name for f in STATIC.iterdir() if f.is_file()}
        if name not in files:  # only the folder's own files: no path leaves it
            raise NotFound(f"no static file {name!r}", code="not_found")
        return WholeFile(STATIC / name, headers={"Cache-Control": "no-cache"})

    # ---- helpers -----------------------------------------------------------------------
    async def _body(self, request) -> dict:
        if request.content_type != "application/json" and not request.content_type.endswith("+json"):
            raise ApiError(f"the request body must be JSON, sent with 'Content-Type: application/json' "
                           f"(got {request.content_type!r})", 415)  # fmt: skip
        if (request.charset or "utf-8").lower().replace("_", "-") not in ("utf-8", "utf8"):
            raise ApiError(f"JSON bodies are UTF-8 (RFC 8259); got charset {request.charset!r}", 415)
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("identity", "gzip", "deflate"):  # aiohttp reads any other as plain bytes
            raise ApiError(f"Content-Encoding {encoding[:40]!r} is not supported here; {SUPPORTED_ENCODINGS}", 415)
        try:
            async with asyncio.timeout(self.body_timeout_s):
                raw = await request.read()
        except TimeoutError:  # a client that stopped sending: its connection is not held forever
            raise ApiError(f"the request body did not arrive within {self.body_timeout_s:g} s", 408,
                           code="request_timeout") from None  # fmt: skip
        except BodyCutShort as err:
            raise ApiError(str(err)) from None
        except RequestPayloadError:  # e.g. Content-Encoding: gzip over bytes that are not gzip
            how = "read" if encoding == "identity" else f"decoded as {encoding} (its Content-Encoding)"
            raise ApiError(f"the request body could not be {how}") from None
        try:
            body = json.loads(raw, parse_constant=_not_json, parse_float=_finite_float)
        except UnicodeDecodeError:
            raise ApiError("the request body is not valid UTF-8 (JSON bodies are UTF-8, RFC 8259)") from None
        except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            detail = f": {err}" if isinstance(err, NotJson) else " (or nests too deeply)"
            raise ApiError(f"the request body is not valid JSON{detail}") from None
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        return body

    async def _stop_tokenizing(self, app) -> None:
        for pool in (self.tokenize_thread, self.endpoint_thread, self.reply_thread):
            pool.shutdown(wait=False, cancel_futures=True)

    def _tokenizer(self):
        if self.tokenizer is None:
            raise ApiError("this model has no tokenizer", 400)
        return self.tokenizer


def token_id_text(token_id: int) -> str:
    """vLLM's name for a token by its id (return_tokens_as_token_ids; a model without a tokenizer)."""
    return f"token_id:{token_id}"


class NotJson(ValueError):
    pass


def _not_json(word: str):
    raise NotJson(f"{word} is not a JSON number (RFC 8259)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NotJson(f"{text[:40]} is out of the range of a number")
    return value


class WholeFile(web.FileResponse):
    """A page file, always whole or "not modified": Range and the preconditions that could fail are
    ignored (RFC 9110 lets a server), so no request gets aiohttp's empty 416 or 412."""

    IGNORED = ("Range", "If-Range", "If-Match", "If-Unmodified-Since")

    async def prepare(self, request):
        if any(h in request.headers for h in self.IGNORED):
            headers = request.headers.copy()
            for h in self.IGNORED:
                headers.popall(h, None)
            request = request.clone(headers=headers)
        return await super().prepare(request)
