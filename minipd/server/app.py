"""The aiohttp application: OpenAI-compatible endpoints, health, metrics, timelines, admin."""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from minipd.server import protocol as p
from minipd.server.protocol import ApiError
from minipd.server.router import Mode, Router

log = logging.getLogger("minipd.api")


def json_error(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


@web.middleware
async def errors_as_json(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as err:
        return json_error(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return json_error(ApiError(exc.reason, exc.status, type_="invalid_request_error"))
    except Exception:
        log.exception("unhandled error")
        return json_error(ApiError("internal server error", 500, type_="server_error"))


class Api:
    def __init__(self, router: Router, model_name: str, max_model_len: int):
        self.router = router
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = router.tokenizer

    def app(self) -> web.Application:
        app = web.Application(middlewares=[errors_as_json], client_max_size=32 * 2**20)
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
            web.get("/v1/requests/{request_id}/timeline", self.timeline),
            web.get("/admin/mode", self.get_mode),
            web.post("/admin/mode", self.post_mode),
            web.get("/admin/workers", self.workers),
        ])  # fmt: skip
        return app

    # ---- OpenAI endpoints ---------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        ids = p.completion_prompt(body, self._tokenizer())
        return await self._serve(request, body, ids, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        ids = p.chat_prompt(body, self._tokenizer())
        return await self._serve(request, body, ids, chat=True)

    async def _serve(self, request, body, ids: list[int], chat: bool) -> web.StreamResponse:
        model = body.get("model")
        if model not in (None, self.model_name):
            raise ApiError(f"model {model!r} is not served here; this server serves {self.model_name!r}",
                           404, param="model", code="model_not_found")  # fmt: skip
        if len(ids) >= self.max_model_len:
            raise ApiError(f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len}",
                           param="messages" if chat else "prompt")  # fmt: skip
        vocab = len(self.tokenizer) if self.tokenizer else None
        if vocab and any(t < 0 or t >= vocab for t in ids):
            raise ApiError(f"token ids must be in [0, {vocab})", param="prompt")
        stream, include_usage = p.stream_options(body)
        params = p.sampling_params(body, None if chat else 16, self.max_model_len - len(ids))
        rid = p.new_id("chatcmpl" if chat else "cmpl")
        state = await self.router.submit(rid, ids, params)
        try:
            if stream:
                return await self._stream(request, state, chat, include_usage)
            return await self._collect(state, chat)
        except (asyncio.CancelledError, ConnectionResetError):
            await self.router.abort(rid)  # the client went away: free the blocks everywhere
            raise
        finally:
            if not state.finished:
                await self.router.abort(rid)

    async def _collect(self, state, chat: bool) -> web.Response:
        text, n = "", 0
        while True:
            d = await state.deltas.get()
            text += d.text
            n += d.num_tokens
            if d.error:
                raise ApiError(d.error, 500, type_="server_error")
            if d.finish_reason:
                break
        use = p.usage(len(state.prompt_token_ids), n)
        make = p.chat_response if chat else p.completion_response
        body = make(state.request_id, self.model_name, p.now(), text, d.finish_reason, use)
        return web.json_response(body)

    async def _stream(self, request, state, chat: bool, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created, n = p.now(), 0

        async def send(obj: dict) -> None:
            await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

        def chunk(delta, finish_reason):
            make = p.chat_chunk if chat else p.completion_chunk
            return make(state.request_id, self.model_name, created, delta, finish_reason)

        if chat:
            await send(chunk({"role": "assistant", "content": ""}, None))
        while True:
            d = await state.deltas.get()
            n += d.num_tokens
            if d.error:
                await send(ApiError(d.error, 500, type_="server_error").body())
                break
            if d.text or d.finish_reason:
                text = {"content": d.text} if chat else d.text
                await send(chunk(text if d.text or not chat else {}, d.finish_reason))
            if d.finish_reason:
                break
        if include_usage:
            obj = chunk({}, None)
            obj["choices"] = []
            obj["usage"] = p.usage(len(state.prompt_token_ids), n)
            obj["timeline"] = self.router.timeline(state.request_id)
            await send(obj)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ---- the rest ----------------------------------------------------------------------
    async def models(self, request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "created": p.now(), "owned_by": "minipd",
                "root": self.model_name, "parent": None, "max_model_len": self.max_model_len}  # fmt: skip
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request) -> web.Response:
        if not self.router.ready:
            return web.json_response({"status": "starting"}, status=503)
        if self.router.dead:
            return web.json_response({"status": "unhealthy", "dead_workers": self.router.dead}, status=503)
        return web.json_response({"status": "ok", "mode": self.router.mode.name})

    async def metrics(self, request) -> web.Response:
        return web.Response(body=self.router.metrics.render(), content_type="text/plain", charset="utf-8")

    async def timeline(self, request) -> web.Response:
        t = self.router.timeline(request.match_info["request_id"])
        if t is None:
            raise ApiError("no such request (or it ended too long ago)", 404, code="not_found")
        return web.json_response(t)

    async def get_mode(self, request) -> web.Response:
        return web.json_response(self.router.mode.as_dict())

    async def post_mode(self, request) -> web.Response:
        body = await self._body(request)
        cur = self.router.mode
        try:
            mode = Mode(body.get("mode", cur.name), int(body.get("prefill_workers", cur.prefill_workers)),
                        int(body.get("decode_workers", cur.decode_workers)),
                        int(body.get("chunk_tokens", cur.chunk_tokens)))  # fmt: skip
        except (TypeError, ValueError):
            raise ApiError("prefill_workers, decode_workers and chunk_tokens must be integers") from None
        await self.router.set_mode(mode)
        return web.json_response(self.router.mode.as_dict())

    async def workers(self, request) -> web.Response:
        rows = []
        for w in self.router.pool.workers:
            s = w.stats
            rows.append({"id": w.worker_id, "pid": w.pid, "alive": w.alive, "role": w.role, "device": w.device,
                         "kv_address": w.info.kv_address if w.info else None,
                         "requests_running": s.num_running if s else 0, "requests_waiting": s.num_waiting if s else 0,
                         "inflight": len(w.inflight), "kv_blocks_used": s.blocks_used if s else 0,
                         "kv_blocks_reserved": s.blocks_reserved if s else 0,
                         "kv_blocks_total": w.info.num_blocks if w.info else None})  # fmt: skip
        return web.json_response({"mode": self.router.mode.as_dict(), "workers": rows})

    # ---- helpers -----------------------------------------------------------------------
    async def _body(self, request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        return body

    def _tokenizer(self):
        if self.tokenizer is None:
            raise ApiError("this model has no tokenizer", 400)
        return self.tokenizer
