"""aiohttp's runner, with the answers aiohttp gives itself in the OpenAI-style JSON error body.

What aiohttp's HTTP parser refuses (a header or URL over 8,190 bytes, too many headers, a
duplicate Content-Length, bytes that are not HTTP) never reaches the app or its middlewares:
aiohttp's protocol answers it with a text/plain 400 from `RequestHandler.handle_error`. The
protocol class is the only place to change that answer."""

from __future__ import annotations

import itertools
import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from minipd.server.protocol import ApiError

log = logging.getLogger("minipd.api")
# a connection waiting for a request (idle, or its request's head not yet whole) this long is closed:
# nginx's keepalive_timeout; aiohttp 3.14's own default is 3,630 s
KEEPALIVE_TIMEOUT_S = 75.0
# a connection whose reply has not moved this long (the client reads none of it) is closed, which ends
# the reply and frees its request (nginx's send_timeout is the same idea, timed between two writes)
SEND_TIMEOUT_S = 60.0
SUPPORTED_ENCODINGS = "send it plain (identity), gzip or deflate"
MAX_MESSAGE_CHARS = 300  # the parser's message can quote what the client sent


class BodyCutShort(RequestPayloadError):
    """The client closed its sending side before the request's body was whole."""


class JsonErrorHandler(RequestHandler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.over_capacity = False  # opened past max_connections with no idle one to close: its request gets a 503
        self._newest = None  # the request made last on this connection (made before its handler's task runs)
        make = self._request_factory

        def remember(*args):
            self._newest = make(*args)
            return self._newest

        self._request_factory = remember
        self.started = False  # its protocol task (start) has run
        self._stalled = None  # the timer that runs while writing is paused (the client reads nothing)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        # aiohttp before 3.14 ran the keep-alive timer only after a reply: a connection that never sent
        # a whole request stayed open for good
        if self._keepalive_timeout and getattr(self, "_keepalive_handle", True) is None:
            self._next_keepalive_close_time = self._loop.time() + self._keepalive_timeout
            self._keepalive_handle = self._loop.call_at(self._next_keepalive_close_time, self._process_keepalive)

    async def start(self) -> None:
        self.started = True
        await super().start()

    def pause_writing(self) -> None:
        """The socket's buffers are full: the client has stopped reading, or reads slower than the
        reply is written. While writing is paused the buffered bytes are looked at every
        send_timeout: if none of them left in that time (the client read nothing), the connection is
        dropped, so that a client that reads nothing cannot keep its reply (and what piles up behind
        it) in the server for good. A large reply read slowly but steadily goes on."""
        super().pause_writing()
        timeout = getattr(self._manager, "send_timeout", None)
        if timeout and self._stalled is None and self.transport is not None:
            self._stalled = self._loop.call_later(timeout, self._check_sent, timeout, self.transport.get_write_buffer_size())

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_send_timer()

    def connection_lost(self, exc) -> None:
        self._stop_send_timer()
        super().connection_lost(exc)

    def _stop_send_timer(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _check_sent(self, timeout: float, buffered: int) -> None:
        self._stalled = None
        if self.transport is None or not self.writing_paused:
            return
        now = self.transport.get_write_buffer_size()
        if now < buffered:  # the client read some of it: look again a send_timeout from now
            self._stalled = self._loop.call_later(timeout, self._check_sent, timeout, now)
            return
        peer = self.transport.get_extra_info("peername")
        log.info("closed the connection of %s: it read nothing of its reply for %g s (--send-timeout)",
                 peer[0] if peer else "a client", timeout)  # fmt: skip
        self.transport.abort()  # the handler is cancelled (handler_cancellation) or its next write fails

    def eof_received(self) -> bool | None:
        """The client closed its sending side. While a request's body is still arriving and nothing
        has been answered to it, the body can never be whole: reading it fails with BodyCutShort (a
        400 that says so; the client's receiving side is open, so the answer still reaches it) and
        the connection ends after the answer. Otherwise the connection closes, as aiohttp's does (a
        client gone mid-reply frees its request; a body left unread behind an answer is dropped). A
        pipelined request cut short behind one still being handled is not answered."""
        newest = self._newest
        if newest is not None and not newest.content.is_eof():
            if newest.writer.output_size > 0:  # answered without reading it all
                return None
            cut = [(newest.headers, newest.content)]
        elif self._request_in_progress:
            return None
        else:  # parsed, its handler not started yet
            cut = [(m.headers, body) for m, body in self._messages if not body.is_eof() and hasattr(m, "headers")]
        if not cut:
            return None
        for headers, body in cut:
            length = headers.get("Content-Length")
            expected = f"its Content-Length ({length} bytes)" if length is not None else "its last chunk"
            body.set_exception(BodyCutShort(f"the request body ended before {expected}: the client closed "
                                            f"its side after {body.total_bytes} bytes"))  # fmt: skip
        self.close()
        return True

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:  # fmt: skip
        if request.writer.output_size > 0:  # as aiohttp: a reply has begun, the connection is broken
            raise ConnectionError("an error after the reply began")
        if status >= 500:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
            err = ApiError(HTTPStatus(status).phrase.lower(), status, type_="server_error")
        elif isinstance(exc, ContentEncodingError):  # aiohttp would say "Please install Brotli"
            status = 415
            err = ApiError(f"the request body's Content-Encoding is not supported here; {SUPPORTED_ENCODINGS}", 415)
        else:  # a client's malformed request: one line, not aiohttp's traceback per request
            text = " ".join((message or HTTPStatus(status).phrase).split())
            if len(text) > MAX_MESSAGE_CHARS:
                text = text[:MAX_MESSAGE_CHARS] + "..."
            log.info("refused a request from %s that HTTP parsing failed on: %s", request.remote, text)
            err = ApiError(f"the HTTP request could not be parsed: {text}", status)
        resp = web.json_response(err.body(), status=status)
        resp.force_close()
        return resp


def http_exception_as_json(exc: web.HTTPException) -> web.Response:
    """aiohttp's HTTPException (404, 405, 417, ...) as the OpenAI-style error body."""
    text = exc.text or ""
    prefix = f"{exc.status}: "
    message = text[len(prefix):] if text.startswith(prefix) else text or exc.reason
    resp = web.json_response(ApiError(message, exc.status).body(), status=exc.status)
    if "Allow" in exc.headers:  # a 405's (RFC 9110)
        resp.headers["Allow"] = exc.headers["Allow"]
    return resp


def raise_open_files_limit() -> int:
    """The soft limit on open files raised to the hard one (as vLLM does at start); the limit now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def default_max_connections(open_files_limit: int) -> int:
    """Half the open files for clients: the rest for workers' sockets, shared memory, logs."""
    return max(64, min(10_000, open_files_limit // 2))


def waiting_for_a_request(handler: RequestHandler) -> bool:
    """Idle between requests, or a request's head not yet whole (aiohttp's own test for closing a
    kept-alive connection: its protocol task waits for the next message); or just accepted, its
    protocol task not started yet (before Python 3.12 tasks do not start at once)."""
    waiter = getattr(handler, "_waiter", None)
    if waiter is not None:
        return not waiter.done()
    return not getattr(handler, "started", True)


class JsonErrorServer(web.Server):
    # set by ApiRunner._make_server (the class is swapped in on aiohttp's Server, whose __init__ ran)
    max_connections: int | None
    send_timeout: float | None
    closing: set  # closed for the limit, still in aiohttp's table until their tasks end
    warned_at: float

    def __call__(self) -> RequestHandler:
        return JsonErrorHandler(self, loop=self._loop, **self._kwargs)

    def excess_connections(self) -> int:
        """Open connections past max_connections, not counting those being closed."""
        if self.max_connections is None:
            return 0
        self.closing.intersection_update(self._connections)
        return len(self._connections) - len(self.closing) - self.max_connections

    def connection_made(self, handler: RequestHandler, transport) -> None:
        super().connection_made(handler, transport)
        excess = self.excess_connections()
        if excess <= 0:
            return
        idle = (h for h in self._connections
                if h is not handler and h not in self.closing and waiting_for_a_request(h))  # fmt: skip
        for h in itertools.islice(idle, excess):  # the oldest first
            h.force_close()
            self.closing.add(h)
            excess -= 1
        if excess > 0:
            handler.over_capacity = True
            now = self._loop.time()
            if now - self.warned_at >= 60.0:
                self.warned_at = now
                log.warning("%d connections open, past --max-connections %d, none of them idle: new ones are "
                            "answered 503 (said once a minute)", self.max_connections + excess, self.max_connections)  # fmt: skip


class ApiRunner(web.AppRunner):
    def __init__(self, app: web.Application, max_connections: int | None = None,
                 send_timeout: float | None = SEND_TIMEOUT_S, **kwargs) -> None:  # fmt: skip
        kwargs.setdefault("keepalive_timeout", KEEPALIVE_TIMEOUT_S)
        super().__init__(app, **kwargs)
        self.max_connections, self.send_timeout = max_connections, send_timeout

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = JsonErrorServer  # the app's own Server, only its protocol class changed
        server.max_connections, server.closing, server.warned_at = self.max_connections, set(), float("-inf")
        server.send_timeout = self.send_timeout
        server.request_handler = _http_exceptions_as_json(server.request_handler, server)
        return server


def _http_exceptions_as_json(handle, server: JsonErrorServer):
    """What aiohttp raises before the app's middlewares run (its Expect handler's 417) in JSON too;
    and a request on a connection opened past max_connections gets a 503 while that still holds."""

    async def answer(request):
        if getattr(request.protocol, "over_capacity", False) and server.excess_connections() > 0:
            err = ApiError(f"the server has {server.max_connections} connections open (its --max-connections) and "
                           "none idle; try again shortly", 503, type_="server_error", code="too_many_connections")  # fmt: skip
            resp = web.json_response(err.body(), status=503, headers={"Retry-After": "1"})
            resp.force_close()
            return resp
        try:
            return await handle(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            resp = http_exception_as_json(exc)
            resp.force_close()  # the body was never read: its bytes must not become the next request
            return resp

    return answer
