"""The serving mode, and switching it at run time: re-role the workers (no reload), then move the
replies that must go elsewhere; or, on request, drain first."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from minipd.server.errors import Conflict, InvalidRequest, Unavailable, shown
from minipd.server.moves import summary
from minipd.server.worker_pool import unresponsive
from minipd.workers import messages as m

log = logging.getLogger("minipd.modes")
MODES = ("colocated", "chunked", "disagg")
DEFAULT_CHUNK_TOKENS = 512
MAX_TOKENS_SETTING = 1 << 20  # more than any context served here; bounds what reaches the workers
MAX_LINK_LATENCY_MS = 60_000.0
MIN_LINK_GBPS = 1e-5  # 10 kbit/s: slow enough for tests of a lease running out, and no slower


@dataclass(slots=True)
class Mode:
    name: str = "colocated"
    prefill_workers: int = 1
    decode_workers: int = 1
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    workers: int | None = None  # colocated and chunked: how many workers serve (None: all; the rest idle)
    kv_link_gbps: float | None = None  # tcp transport: the emulated link's rate (None: unpaced)
    kv_link_latency_ms: float = 0.0  # ... and its one-way latency
    local_prefill_tokens: int = 0  # disagg: prompts shorter than this are prefilled by their decode worker

    def check(self, num_workers: int) -> None:
        if self.name not in MODES:
            raise InvalidRequest(f"mode must be one of {MODES}, got {shown(self.name)}", param="mode")
        if not 1 <= self.chunk_tokens <= MAX_TOKENS_SETTING:
            raise InvalidRequest(f"chunk_tokens must be between 1 and {MAX_TOKENS_SETTING}", param="chunk_tokens")
        if self.kv_link_gbps is not None and not MIN_LINK_GBPS <= self.kv_link_gbps < math.inf:
            raise InvalidRequest(f"kv_link_gbps must be a finite number >= {MIN_LINK_GBPS:g} (10 kbit/s; "
                                 "or null: unpaced)", param="kv_link_gbps")  # fmt: skip
        if not 0 <= self.local_prefill_tokens <= MAX_TOKENS_SETTING:
            raise InvalidRequest(f"local_prefill_tokens must be between 0 and {MAX_TOKENS_SETTING}",
                                 param="local_prefill_tokens")  # fmt: skip
        if not 0 <= self.kv_link_latency_ms <= MAX_LINK_LATENCY_MS:
            raise InvalidRequest(f"kv_link_latency_ms must be between 0 and {MAX_LINK_LATENCY_MS:g}", param="kv_link_latency_ms")
        if self.workers is not None and not 1 <= self.workers <= num_workers:
            raise InvalidRequest(f"workers must be between 1 and {num_workers}, got {self.workers}", param="workers")
        if self.name == "disagg":
            p, d = self.prefill_workers, self.decode_workers
            if p < 1 or d < 1 or p + d > num_workers:
                raise InvalidRequest(f"disagg needs prefill_workers >= 1 and decode_workers >= 1 with P + D <= "
                                     f"{num_workers} workers, got {p}P{d}D", param="prefill_workers")  # fmt: skip

    def policy(self, role: str) -> str:
        """How a worker of this role schedules. In disagg a decode worker reads a prompt (a local
        prefill, or one a switch caught half read) in chunks beside its replies, never whole."""
        if self.name == "chunked" or (self.name == "disagg" and role == "decode"):
            return "chunked"
        return "prefill_first"

    def roles(self, num_workers: int) -> list[str]:
        if self.name != "disagg":
            active = self.workers or num_workers
            return ["both"] * active + ["idle"] * (num_workers - active)
        p, d = self.prefill_workers, self.decode_workers
        return ["prefill"] * p + ["decode"] * d + ["idle"] * (num_workers - p - d)

    def as_dict(self) -> dict:
        """Only the fields that mean something in this mode."""
        if self.name == "disagg":
            out = {"mode": self.name, "prefill_workers": self.prefill_workers, "decode_workers": self.decode_workers}
            if self.local_prefill_tokens:
                out["local_prefill_tokens"] = self.local_prefill_tokens
            if self.chunk_tokens != DEFAULT_CHUNK_TOKENS:  # the chunks its decode workers read prompts in
                out["chunk_tokens"] = self.chunk_tokens
        else:
            out = {"mode": self.name, "chunk_tokens": self.chunk_tokens} if self.name == "chunked" else {"mode": self.name}
            if self.workers is not None:
                out["workers"] = self.workers
        if self.kv_link_gbps is not None or self.kv_link_latency_ms:
            out.update(kv_link_gbps=self.kv_link_gbps, kv_link_latency_ms=self.kv_link_latency_ms)
        return out


# The settings that mean something in each mode; the emulated link's apply in all (moves cross it).
APPLIES_TO = {"workers": ("colocated", "chunked"), "chunk_tokens": ("chunked", "disagg"),
              "prefill_workers": ("disagg",), "decode_workers": ("disagg",), "local_prefill_tokens": ("disagg",)}  # fmt: skip
INTEGER_SETTINGS = ("prefill_workers", "decode_workers", "chunk_tokens", "workers", "local_prefill_tokens")
LINK_SETTINGS = ("kv_link_gbps", "kv_link_latency_ms")


def requested_mode(body: dict, cur: Mode) -> Mode:
    """The mode a POST /admin/mode body asks for. An omitted setting keeps its value where it applies
    to the new mode and goes back to its default where it does not, so nothing the mode's view hides
    comes back with a later switch; a setting sent for a mode it does not apply to is refused."""
    name = body.get("mode", cur.name)
    if not isinstance(name, str):
        raise InvalidRequest("'mode' must be a string", param="mode")
    if name not in MODES:  # "auto" never reaches here: POST /admin/mode turns the advisor on for it
        raise InvalidRequest(f"mode must be one of {', '.join(MODES)} or auto (the server chooses), got {shown(name)}",
                             param="mode")  # fmt: skip
    fields = {}
    for field in INTEGER_SETTINGS + LINK_SETTINGS:
        default, applies = getattr(DEFAULT_MODE, field), name in APPLIES_TO.get(field, MODES)
        if field not in body:
            fields[field] = getattr(cur, field) if applies else default
            continue
        value = body[field]
        if value is None and field == "kv_link_latency_ms":
            value = 0.0  # none, as null is no pacing for the rate
        nullable = field in ("workers", "kv_link_gbps")
        kinds = (int,) if field in INTEGER_SETTINGS else (int, float)
        if isinstance(value, bool) or not (isinstance(value, kinds) or (value is None and nullable)):
            raise InvalidRequest(f"'{field}' must be {'an integer' if kinds == (int,) else 'a number'}", param=field)
        if field in LINK_SETTINGS and value is not None:
            try:
                value = float(value)  # the workers get a float (an int past 2**64 cannot be packed for them)
            except OverflowError:
                raise InvalidRequest(f"'{field}' is out of range", param=field) from None
        if not applies and value != default:
            raise InvalidRequest(f"'{field}' does not apply to mode {name!r}: it is a setting of "
                                 f"{' and '.join(APPLIES_TO[field])}", param=field)  # fmt: skip
        fields[field] = value
    return Mode(name, **fields)


DEFAULT_MODE = Mode()


def check_whatever_it_meets(body: dict, num_workers: int) -> None:
    """Refuse a POST /admin/mode body that no mode it could be read against would take (during a
    switch it is read against the mode that switch leaves, once it ends). Each mode is tried with its
    default settings, the most lenient (a disagg split of 1P1D, every worker serving)."""
    errors = []
    sent = [f for f in body if f in APPLIES_TO]
    fitting_first = sorted(MODES, key=lambda name: not all(name in APPLIES_TO[f] for f in sent))  # whose error says most
    for name in [body["mode"]] if "mode" in body else fitting_first:
        try:
            requested_mode(body, Mode(name) if name in MODES else DEFAULT_MODE).check(num_workers)
            return
        except InvalidRequest as err:
            errors.append(err)
    raise errors[0]


ACK_POLL_S = 0.25  # how often a switch waiting for the workers' answers looks for one gone silent
SEAT_PATIENCE_S = 1.0  # a switch answers once its moves that wait for a seat have waited this long (they go on)


class ModeSwitcher:
    """A switch is one transaction, owned by the server (a client that gives up does not stop it):
    the door closes for new requests, every worker gets its role and acknowledges it, the router
    takes the new mode, the door opens; then the replies whose worker can no longer decode move to
    one that can, at a token boundary, while they stream. With drain=True the running requests
    finish first instead (a clean cut for experiments)."""

    def __init__(self, router, drain_timeout: float = 600.0, ack_timeout: float = 180.0):
        self.router = router
        self.drain_timeout, self.ack_timeout = drain_timeout, ack_timeout
        self.lock = asyncio.Lock()  # one change of roles at a time (switches and restarted workers)
        self.acks: dict[int, asyncio.Future] = {}
        self.num_switches = 0
        self.last: dict | None = None  # the last switch's outcome
        self.moving: list | None = None  # while a switch's moves run: the requests it moves
        self.move_timeout: float | None = None  # how long a switch's answer waits for its moves (they go on
        # after; counted as under_way); None: just past a handoff's lease, by which each has ended

    def _checked(self, mode: Mode) -> Mode:
        """The mode checked against the workers there are, every worker named the same as all."""
        mode.check(len(self.router.pool.workers))
        return dataclasses.replace(mode, workers=None) if mode.workers == len(self.router.pool.workers) else mode

    async def switch(self, mode: Mode | Callable[[Mode], Mode], drain: bool = False) -> dict:
        """`mode`, or what a function makes of the mode served once the switches before this one
        are over (a POST /admin/mode body keeps omitted settings from that mode, not an earlier one)."""
        r = self.router
        if isinstance(mode, Mode):
            mode = self._checked(mode)
        async with self.lock:
            if not isinstance(mode, Mode):
                mode = self._checked(mode(r.mode))
            old, started = r.mode, time.time()
            if mode == old and r.ready:
                return self._record({"from": old.as_dict(), "to": mode.as_dict(), "changed": False, "drain": drain,
                                     "started": started, "seconds": 0.0, "requests_in_flight": len(r.requests),
                                     "note": "the server already serves in this mode: nothing changed"})  # fmt: skip
            silent = unresponsive(r.pool, [w for w in r.pool.workers if w.alive]) if r.ready else {}
            if silent:
                error = "; ".join(f"worker {wid} has shown no sign of life for {s:.0f} s" for wid, s in silent.items())
                self._record({"from": old.as_dict(), "to": mode.as_dict(), "changed": False, "drain": drain,
                              "started": started, "seconds": 0.0, "error": error})  # fmt: skip
                raise Unavailable(f"the mode switch was not started: {error} (stopped or stuck; --worker-timeout "
                                  "replaces it, /health names it) and the switch would wait for its answer. "
                                  "Try again once it answers")  # fmt: skip
            roles, old_roles = assign_roles(mode, r.pool.workers), [w.role for w in r.pool.workers]
            r.target = mode
            r.events.publish({"type": "mode", "phase": "drain" if drain else "switch", "time": started,
                              "from": old.as_dict(), "to": mode.as_dict()})  # fmt: skip
            in_flight = len(r.requests)
            r.serving.clear()  # new and waiting requests wait at the door (for milliseconds, unless draining)
            try:
                r.seats.cancel_all()
                await (self._drain() if drain else self._placements_settled())
                errors = await self._set_roles(mode, roles)
                if errors:
                    await self._set_roles(old, old_roles)
                    self._record({"from": old.as_dict(), "to": mode.as_dict(), "changed": False, "drain": drain,
                                  "started": started, "seconds": time.time() - started, "error": "; ".join(errors)})  # fmt: skip
                    raise Unavailable(f"the mode switch failed and was undone: {'; '.join(errors)}")
                r.mode = mode
                self.num_switches += 1
                r.metrics.mode.info({k: str(v) for k, v in mode.as_dict().items()})
                if r.ready:
                    r.metrics.mode_switches.labels(r.metrics.model).inc()
            except BaseException as err:  # the switch's event gets its end: it did not happen
                r.events.publish({"type": "mode", "phase": "failed", "time": time.time(), "started": started,
                                  "from": old.as_dict(), "to": mode.as_dict(), "error": str(err) or repr(err)})  # fmt: skip
                raise
            finally:
                r.target = None
                r.serving.set()
            serving_after = time.time() - started
            r.events.publish({"type": "mode", "phase": "serving", "time": time.time(), "mode": mode.as_dict(),
                              "drain_seconds": serving_after})  # fmt: skip
            log.info("minipd: now serving in mode %s", mode.as_dict())
            wait = self.move_timeout if self.move_timeout is not None else r.limits.kv_transfer_timeout + 5.0
            try:
                self.moving = r.mover.misplaced()
                moves = await r.mover.move_all(self.moving, "switch", wait, seat_patience=SEAT_PATIENCE_S)
            finally:
                self.moving = None
            outcome = {"from": old.as_dict(), "to": mode.as_dict(), "changed": True, "drain": drain,
                       "started": started, "serving_after_seconds": serving_after,
                       "seconds": time.time() - started, "requests_in_flight": in_flight, **summary(moves)}  # fmt: skip
            r.events.publish({"type": "mode", "phase": "switched", "time": time.time(), **outcome})
            return self._record(outcome)

    def _record(self, outcome: dict) -> dict:
        if self.router.ready:  # the start's own switch is not one
            self.last = outcome
        return outcome

    async def _placements_settled(self, timeout: float = 5.0) -> None:
        """Placements under way finish (they were just told to go round again, or are sending now)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.router.placing and loop.time() < deadline:
            await asyncio.sleep(0.002)

    async def _drain(self) -> None:
        r = self.router
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        while r.placing or any(s.holders for s in r.requests.values()):
            if loop.time() > deadline:
                raise Unavailable(f"the mode switch was given up: the running requests did not finish within "
                                  f"{self.drain_timeout:g} s (--switch-drain-timeout); they go on in the old mode")  # fmt: skip
            await asyncio.sleep(0.01)

    async def _set_roles(self, mode: Mode, roles: list[str]) -> list[str]:
        """Give every worker its role; returns the errors of those that refused. The router's record
        of the roles changes only once every worker that is up has taken its new one."""
        r = self.router
        loop = asyncio.get_running_loop()
        up = [w for w in r.pool.workers if w.alive]
        self.acks = {w.worker_id: loop.create_future() for w in up}
        peers = r.pool.peers()
        for w in up:
            r.pool.send(w.worker_id, m.SetMode(_engine_role(roles[w.worker_id]), mode.policy(roles[w.worker_id]), mode.chunk_tokens, peers,
                                               [mode.kv_link_gbps, mode.kv_link_latency_ms]))  # fmt: skip
        deadline, silent = loop.time() + self.ack_timeout, {}
        while not silent and loop.time() < deadline and not all(f.done() for f in self.acks.values()):
            await asyncio.wait(self.acks.values(), timeout=min(ACK_POLL_S, max(0.0, deadline - loop.time())))
            silent = unresponsive(r.pool, [r.pool.workers[wid] for wid, f in self.acks.items() if not f.done()])
        errors = []
        for wid, fut in self.acks.items():
            if wid in silent:
                errors.append(f"worker {wid} stopped answering (no sign of life for {silent[wid]:.0f} s)")
            elif not fut.done():
                errors.append(f"worker {wid} did not answer within {self.ack_timeout:g} s")
            elif fut.result() is not None:
                errors.append(fut.result())
        if not errors:
            for w, role in zip(r.pool.workers, roles):
                w.role = role  # a worker that is down gets it when it comes back
        return errors

    async def assign(self, worker_id: int) -> None:
        """A restarted worker: give it the role it had, in the current mode."""
        r = self.router
        async with self.lock:
            w = r.pool.workers[worker_id]
            fut = asyncio.get_running_loop().create_future()
            self.acks[worker_id] = fut
            mode = r.mode
            r.pool.send(worker_id, m.SetMode(_engine_role(w.role), mode.policy(w.role), mode.chunk_tokens, r.pool.peers(),
                                             [mode.kv_link_gbps, mode.kv_link_latency_ms]))  # fmt: skip
            error = await asyncio.wait_for(fut, timeout=self.ack_timeout)
            if error:
                raise RuntimeError(error)

    def on_ack(self, msg: m.ModeSet) -> None:
        fut = self.acks.get(msg.worker_id)
        if fut is not None and not fut.done():
            fut.set_result(msg.error)

    def on_worker_lost(self, worker_id: int) -> None:
        fut = self.acks.pop(worker_id, None)
        if fut is not None and not fut.done():
            fut.set_result(None)  # it gets its new role when it comes back


def assign_roles(mode: Mode, workers) -> list[str]:
    """Each worker's role in `mode`. A draining worker takes an idle place where the mode has one;
    a role that only draining workers would hold is refused (new requests would wait for a resume)."""
    roles = mode.roles(len(workers))
    free_idle = [i for i, role in enumerate(roles) if role == "idle" and not workers[i].draining]
    for w in workers:
        if w.draining and roles[w.worker_id] != "idle" and free_idle:
            i = free_idle.pop(0)
            roles[i], roles[w.worker_id] = roles[w.worker_id], "idle"
    for role in dict.fromkeys(roles):
        holders = [w.worker_id for w in workers if roles[w.worker_id] == role]
        if role != "idle" and all(workers[i].draining for i in holders):
            names = ", ".join(map(str, holders))
            raise Conflict(f"worker {names} is draining: in {mode.as_dict()} it would be the only {role} worker, and "
                           f"new requests would wait for it; resume it first (POST /admin/workers/{holders[0]}/resume) "
                           f"or choose a mode that leaves it idle", param="mode", code="worker_draining")  # fmt: skip
    return roles


def _engine_role(role: str) -> str:
    return "both" if role == "idle" else role
