"""The simulated server: a discrete-event loop over minipd's own Scheduler and BlockManager, one
pair per worker, with step times from a profile instead of a model. The router's rules are the
real ones (server/dispatch.py, server/seats.py): the least loaded worker of a role, ties taken in
turn; in disagg a decode seat (prompt + first token, headroom booked) before the prompt is read,
first come first seated; a handoff's KV over the profile's link; a prompt under
local_prefill_tokens prefilled on its decode worker. A worker handles messages (a new request, a
seat, arrived KV) only between steps, as the real worker's loop does.

What it leaves out, on purpose: requests that fail, moves and live switches, worker deaths."""

from __future__ import annotations

import bisect
import gc
import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field

from minipd.bench.metrics import RequestRecord
from minipd.bench.workloads import BenchRequest
from minipd.engine.block_manager import BlockManager, blocks_for
from minipd.engine.decode_run import DecodeRun, plan_decode_run
from minipd.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig, StepShape
from minipd.engine.sequence import Sequence, SequenceStatus
from minipd.sampling_params import SamplingParams
from minipd.server.modes import Mode
from minipd.sim.load_index import LoadIndex
from minipd.sim.profile import Profile, draw

TOKEN = 1  # what every simulated step samples (the bench's requests ignore EOS: lengths are exact)
RUN_LIMIT = 256  # the most decode steps planned in one event (a run is usually cut sooner)


@dataclass(slots=True, eq=False)
class SimRequest:
    req: BenchRequest
    key: str
    record: RequestRecord
    worker: int | None = None  # where it runs (the writer, in disagg, until its KV lands)
    reader: int | None = None
    path: str | None = None
    kv_bytes: int = 0
    kv_seconds: float | None = None
    writer_id: int | None = None
    events: dict = field(default_factory=dict)  # as a real request's timeline names them


@dataclass(slots=True, eq=False)
class SimSequence(Sequence):
    """The scheduler's own Sequence, holding its request so that a step's tokens need no lookup."""

    request: SimRequest | None = None
    token_times: list[float] | None = None  # its request's record.token_times

    @classmethod
    def of(cls, sr: SimRequest, token_ids: list[int], params: SamplingParams) -> SimSequence:
        seq = cls.new(sr.key, token_ids, params)
        seq.request, seq.token_times = sr, sr.record.token_times
        return seq


@dataclass(slots=True)
class Options:
    transport: str = "shm"
    kv_link_gbps: float | None = None
    kv_link_latency_ms: float | None = None
    trace: bool = False  # keep /admin/events-style events (steps, transfers) for a trace
    seed: int = 0  # for the step-time and delivery noise drawn from the profile's measured spread
    decode_runs: bool = True  # take runs of identical decode steps in one event (the same run, faster; not while
    # tracing, which keeps every step, nor where a step's time depends on its box mates' (co_runner))


@dataclass(slots=True, eq=False)
class Streak:
    """A run of decode steps (engine/decode_run.py) taken in one event: each step's start, end and
    tokens' arrival are known ahead, and the scheduler is brought up to the present (SimWorker.sync)
    only when something outside reads or changes the worker; a message cuts the run after the step
    under way, as the real loop would see it there."""

    run: DecodeRun
    starts: list[float]
    ends: list[float]
    at_client: list[float]
    steps: int  # planned, or fewer once cut
    shape: StepShape  # of the last step planned (replies may leave in it: the worker's _finish ends it)
    rng_state: tuple | None  # the worker's random state after the first step's draws (to undo a cut run's)
    grown: int = 1  # steps whose blocks are taken (as each starts)
    done: int = 0  # steps whose tokens are sampled (as each ends)


class SimWorker:
    def __init__(self, sim: Simulation, worker_id: int, role: str, mode: Mode):
        w = sim.profile.worker
        self.sim, self.id, self.role = sim, worker_id, role
        self.blocks = BlockManager(w.num_blocks, w.block_size)
        config = SchedulerConfig(policy=mode.policy(role), role="both" if role == "idle" else role,
                                 chunk_tokens=mode.chunk_tokens, max_num_seqs=w.max_num_seqs,
                                 max_num_batched_tokens=w.max_num_batched_tokens, max_model_len=w.max_model_len)  # fmt: skip
        self.scheduler = Scheduler(config, self.blocks)
        self.stepping = False
        self.load = 0  # requests placed here, as the router counts them
        self.at_boundary: list = []  # messages that wait for the step under way to end
        self.busy_s = 0.0
        self.steps = 0
        self.hold_s = 0.0  # the loop copies KV out (shm writes in place) before its next step
        self.in_step = False
        self.prompt_share = 0.0  # of the step under way's time, its prompt tokens' (as box mates slow it)
        self.link_free_at = 0.0  # its outgoing KV link is busy until then
        self.box: list[SimWorker] = [self]  # the workers sharing this one's machine (the simulation sets it)
        self.rng = random.Random(f"{sim.options.seed}:{worker_id}")  # its own: a run's draws are its steps' draws
        self.streak: Streak | None = None
        self.num_runs = 0  # runs of decode steps taken in one event

    def deliver(self, fn, *args) -> None:
        """A message to this worker: handled now if it is between steps (the next step, even one due now,
        sees it, as the real loop drains its messages before each step), else when its step ends."""
        if self.streak is not None:
            self._cut()
        if self.in_step:
            self.at_boundary.append((fn, args))
        else:
            fn(*args)
            self.kick()

    def pass_on(self, fn, *args) -> None:
        """A message this worker only passes on, between its steps (it changes nothing here): in a run,
        at the end of the step under way, without cutting the run."""
        st = self.streak
        if st is None:
            self.deliver(fn, *args)
            return
        under_way = bisect.bisect_left(st.starts, self.sim.now, 1, st.steps) - 1  # a later step due now has not begun
        if self.sim.now < st.ends[under_way]:
            self.sim.at(st.ends[under_way], fn, *args)
        else:
            fn(*args)

    def kick(self) -> None:
        if not self.stepping and self.scheduler.num_unfinished:
            self.stepping = True
            self.sim.at(self.sim.now, self._start)

    def _start(self) -> None:
        """Steps, one after another. While nothing else is due before a step ends, the next one runs
        straight away (no other worker or message can change this one's state in between)."""
        sim, step = self.sim, self.sim.profile.step
        while True:
            batch = self.scheduler.schedule()
            if batch.is_empty:  # no room until a block comes back (a handoff or a seat ends): kicked then
                self.stepping = False
                return
            s = batch.shape()
            busy = busy_prompt = 0.0
            if len(self.box) > 1 and step.slowed_by_co_runners():
                mates = [w for w in self.box if w is not self and w.in_step]
                busy = len(mates) / (len(self.box) - 1)
                busy_prompt = sum(w.prompt_share for w in mates) / (len(self.box) - 1)
                alone = step.seconds(s.prefill_tokens, s.prefill_attention, s.decodes, s.decode_context)
                prompt = step.prompt_seconds(s.prefill_tokens, s.prefill_attention)
                self.prompt_share = prompt / alone if alone > 0 else 0.0
            seconds = step.co_run_seconds(s.prefill_tokens, s.prefill_attention, s.decodes, s.decode_context, busy,
                                          busy_prompt)  # fmt: skip
            if step.noise:
                seconds *= draw(step.noise, self.rng.random())
            started, end = sim.now, sim.now + seconds
            self.in_step = True
            if self.runs and (run := plan_decode_run(self.scheduler, batch, TOKEN, RUN_LIMIT)) is not None:
                self._begin_run(run, s, seconds)
                return
            if sim.heap and sim.heap[0][0] <= end:
                sim.at(end, self._end, batch, started, s)
                return
            sim.now = end
            following = self._finish(batch, started, s)
            if following is None:
                return
            if sim.heap and sim.heap[0][0] <= following:
                sim.at(following, self._start)
                return
            sim.now = following

    def _end(self, batch: ScheduledBatch, started: float, shape) -> None:
        following = self._finish(batch, started, shape)
        if following is not None:
            self.sim.at(following, self._start)

    def _finish(self, batch: ScheduledBatch, started: float, shape, at_client: float | None = None) -> float | None:
        """The step that began at `started` ends now, its tokens at the client at `at_client` (None:
        drawn now). Returns when the next one starts (None: no work)."""
        sim, now = self.sim, self.sim.now
        self.in_step = False
        self.busy_s += now - started
        self.steps += 1
        host = sim.profile.host
        if at_client is None:
            at_client = now + (draw(host.token_quantiles, self.rng.random()) if host.token_quantiles else host.token_s)
        keys = []
        requests = sim.requests
        for key in shape.prefilling:
            requests[key].events.setdefault("prefill_start", started)
        tracing = sim.events is not None
        seqs = batch.seqs
        if batch.num_single == len(seqs) and not shape.prefilling:  # replies only: each samples, none its first
            sampled = [TOKEN] * len(seqs)
            for seq in seqs:
                seq.token_times.append(at_client)
            if tracing:
                keys = [seq.request_id for seq in seqs]
        else:
            sampled = []
            for seq, n in zip(seqs, batch.num_new_tokens):  # batch.samples(), and each sample's time, in one pass
                if seq.num_computed_tokens + n == len(seq.token_ids):
                    sampled.append(TOKEN)
                    times = seq.token_times
                    if not times:
                        seq.request.events["prefill_end"] = now
                    times.append(at_client)
                    if tracing:
                        keys.append(seq.request_id)
                else:
                    sampled.append(None)
        left = self.scheduler.postprocess(batch, sampled)
        if sim.events is not None:
            sim.events.append({"type": "step", "worker": self.id, "time": started, "end": now,
                               "prefill_tokens": shape.prefill_tokens, "decodes": shape.decodes, "keys": keys,
                               "prefilling": shape.prefilling, "prefill_attention": shape.prefill_attention,
                               "decode_context": shape.decode_context})  # fmt: skip
        for seq in left:
            if seq.status is SequenceStatus.HANDOFF:
                sim.hand_off(self, seq)
            else:
                sim.finished(requests[seq.request_id], self)
        return self._between_steps(now)

    def _between_steps(self, now: float) -> float | None:
        """The loop between two steps: the messages that came during the step, then the next step's time."""
        sim = self.sim
        self.stepping = False
        if self.at_boundary:
            waiting, self.at_boundary = self.at_boundary, []
            for fn, args in waiting:
                fn(*args)
        if self.stepping or not self.scheduler.num_unfinished:
            return None
        self.stepping = True
        delay, self.hold_s = sim.profile.step.gap + self.hold_s, 0.0
        return now + delay

    def add_seat(self, key: str, num_blocks: int, headroom: int) -> bool:
        """A seat granted now; a run of decode steps that would then be short of the blocks its later
        steps take ends with the step under way, and the scheduler preempts, as it does stepping."""
        self.sync()
        if self.blocks.add_seat(key, num_blocks, headroom) is None:
            return False
        st = self.streak
        if st is not None and st.run.blocks_beyond_bookings(st.grown, st.steps) > self.blocks.num_available:
            self._cut()
        return True

    # ---- runs of decode steps ------------------------------------------------------------------
    @property
    def runs(self) -> bool:
        sim = self.sim
        return (sim.options.decode_runs and sim.events is None
                and not (sim.profile.step.slowed_by_co_runners() and len(self.box) > 1))  # box mates read each step's in_step  # fmt: skip

    def _redraw(self, last: int) -> None:
        """The random draws of a run's steps up to `last` after its first step's noise, in the per-step order."""
        step, host = self.sim.profile.step, self.sim.profile.host
        for i in range(last + 1):
            if i and step.noise:
                self.rng.random()
            if host.token_quantiles:
                self.rng.random()

    def _begin_run(self, run: DecodeRun, shape, seconds: float) -> None:
        sim = self.sim
        step, host, rng = sim.profile.step, sim.profile.host, self.rng
        noise, spread, token_s, gap = step.noise, host.token_quantiles, host.token_s, step.gap + self.hold_s
        rng_state = rng.getstate() if noise or spread else None
        decodes, context = shape.decodes, shape.decode_context
        starts, ends, at_client = [], [], []
        start, times = sim.now, step.decode_run_seconds(decodes, context, run.steps)
        times[0] = seconds
        end = start - gap  # so that the first step starts now
        for i, seconds in enumerate(times):
            if i:
                start = end + gap
                if noise:
                    seconds *= draw(noise, rng.random())
            end = start + seconds
            starts.append(start)
            ends.append(end)
            if spread:
                at_client.append(end + draw(spread, rng.random()))
        if not spread:
            at_client = [end + token_s for end in ends]
        last = StepShape(decodes=decodes, decode_context=context + (run.steps - 1) * decodes)
        self.streak = Streak(run, starts, ends, at_client, run.steps, last, rng_state)
        self.num_runs += 1
        sim.at(ends[-1], self._run_ends, self.streak, run.steps)

    def sync(self) -> None:
        """Bring the scheduler of a worker in a run to the present: blocks taken by the steps that have
        started, tokens of those that have ended (each at its own time)."""
        st = self.streak
        if st is None:
            return
        now, run = self.sim.now, st.run
        grown = bisect.bisect_left(st.starts, now, st.grown, st.steps)  # a step due now has not scheduled yet
        if grown > st.grown:
            run.grow(st.grown, grown)
            st.grown = grown
        done = bisect.bisect_right(st.ends, now, st.done, min(st.grown, st.run.steps - 1))  # the last: _run_ends
        if done > st.done:
            run.advance(done - st.done, TOKEN)
            times = st.at_client[st.done : done]
            for seq in run.seqs:
                seq.token_times += times
            for i in range(st.done, done):
                self.busy_s += st.ends[i] - st.starts[i]
            self.steps += done - st.done
            st.done = done

    def _cut(self) -> None:
        """A message: the run ends with the step under way (or the one just ended, in the gap after it)."""
        self.sync()
        st, sim = self.streak, self.sim
        last = st.grown - 1
        if st.steps > last + 1:
            st.steps = last + 1
            if st.rng_state is not None:
                self.rng.setstate(st.rng_state)
                self._redraw(last)
            if sim.now < st.ends[last]:
                sim.at(st.ends[last], self._run_ends, st, st.steps)
        if sim.now >= st.ends[last]:  # between steps: the next one was due after the gap
            self.streak, self.in_step = None, False
            sim.at(st.ends[last] + sim.profile.step.gap, self._start)

    def _run_ends(self, st: Streak, steps: int) -> None:
        if st is not self.streak or steps != st.steps:
            return  # cut since
        self.sync()
        self.streak, last = None, st.steps - 1
        if st.steps == st.run.steps:  # the planned last step, in which replies may leave
            following = self._finish(st.run.last_batch(), st.starts[last], st.shape, st.at_client[last])
        else:
            self.in_step = False
            following = self._between_steps(self.sim.now)
        if following is not None:
            self.sim.at(following, self._start)


class Simulation:
    def __init__(self, profile: Profile, mode: Mode, num_workers: int, options: Options | None = None):
        mode.check(num_workers)
        self.profile, self.mode, self.options = profile, mode, options or Options()
        self.now = 0.0
        self.heap: list = []
        self.counter = itertools.count()
        self.workers = [SimWorker(self, i, role, mode) for i, role in enumerate(mode.roles(num_workers))]
        per_box = max(1, profile.worker.workers_per_box)
        for w in self.workers:
            w.box = self.workers[w.id - w.id % per_box : w.id - w.id % per_box + per_box]
        self.requests: dict[str, SimRequest] = {}
        self.by_load = {role: LoadIndex([w.id for w in self.workers if w.role == role])
                        for role in ("both", "prefill", "decode")}  # fmt: skip
        self.seat_queue: deque[SimRequest] = deque()
        self.turn: dict[str, int] = {}
        self.events: list[dict] | None = [] if self.options.trace else None
        self.link = profile.link(self.options.transport, self.options.kv_link_gbps, self.options.kv_link_latency_ms)

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.heap, (t, next(self.counter), fn, args))

    def run(self, requests: list[BenchRequest]) -> list[RequestRecord]:
        for r in requests:
            self.at(r.arrival, self._arrive, r)
        collecting = gc.isenabled()
        gc.disable()  # millions of short-lived objects and no cycles: the collector would only rescan them
        try:
            heap, pop = self.heap, heapq.heappop
            while heap:
                t, _, fn, args = pop(heap)
                self.now = t
                fn(*args)
        finally:
            if collecting:
                gc.enable()
        records = [self.requests[f"r{r.index}.1"].record for r in requests]
        for rec in records:
            if rec.end_time is None and rec.error is None:
                rec.error = "not finished when the simulation ran out of events"
        return records

    # ---- the router ----------------------------------------------------------------------------
    def _arrive(self, r: BenchRequest) -> None:
        rec = RequestRecord(r.index, r.prompt_len, r.output_len, send_time=self.now)
        sr = SimRequest(r, f"r{r.index}.1", rec)
        self.requests[sr.key] = sr
        self.at(self.now + self.profile.host.dispatch_s, self._place, sr)

    def _place(self, sr: SimRequest) -> None:
        if self.mode.name != "disagg":
            self._send(sr, self._pick("both"), hand_off=None)
        elif sr.req.prompt_len < self.mode.local_prefill_tokens:
            sr.path = "local"
            self._send(sr, self._pick("decode"), hand_off=None)
        elif (sr.req.max_tokens or sr.req.output_len) <= 1:  # its cap ends it at its first token: no seat, as dispatch
            sr.path = "prefill_only"
            self._send(sr, self._pick("prefill"), hand_off=False)
        elif blocks_for(sr.req.prompt_len + 1, self.profile.worker.block_size) > self.profile.worker.num_blocks:
            sr.record.error = (f"the prompt ({sr.req.prompt_len} tokens) does not fit in any decode worker's KV "
                               "cache")  # as dispatch refuses it, before it can hold up the seat queue  # fmt: skip
        else:
            sr.path = "remote"
            sr.worker = self._pick("prefill").id  # the writer is chosen first, as dispatch does
            self._load(self.workers[sr.worker], 1)
            self.seat_queue.append(sr)
            self._pump_seats()

    def _load(self, w: SimWorker, delta: int) -> None:
        w.load += delta
        self.by_load[w.role].add(w.id, delta)

    def _pick(self, role: str) -> SimWorker:
        n = len(self.workers)
        turn = self.turn.get(role, 0)
        w = self.workers[self.by_load[role].first(turn % n)]
        self.turn[role] = w.id + 1
        return w

    def _send(self, sr: SimRequest, w: SimWorker, hand_off: bool | None) -> None:
        """The whole request to one worker (a remote one goes once its seat is granted: _seated)."""
        sr.events["dispatched"] = self.now
        if sr.worker != w.id:
            self._load(w, 1)
        sr.worker = w.id
        w.deliver(self._add, w, sr, hand_off)

    def _add(self, w: SimWorker, sr: SimRequest, hand_off: bool | None) -> None:
        r = sr.req
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
        seq = SimSequence.of(sr, [TOKEN] * r.prompt_len, params)
        seq.hand_off = hand_off
        try:
            w.scheduler.add(seq)
        except ValueError as err:  # the worker refuses it (a prompt its KV cache cannot hold): the request ends
            sr.record.error = str(err)
            self._load(w, -1)
            if hand_off and sr.reader is not None:  # its seat goes back, as the writer's cancel frees it
                self._give_back_seat(sr)

    def _give_back_seat(self, sr: SimRequest) -> None:
        reader = self.workers[sr.reader]
        reader.sync()
        reader.blocks.release_seat(sr.key)
        self._load(reader, -1)
        self._pump_seats()

    def _pump_seats(self) -> None:
        """First come, first seated: a seat on the least loaded decode worker with room."""
        bs = self.profile.worker.block_size
        while self.seat_queue:
            sr = self.seat_queue[0]
            n = sr.req.prompt_len
            now_blocks = blocks_for(n + 1, bs)
            headroom_tokens = max(0, min(self.profile.worker.decode_headroom_tokens, sr.req.output_len,
                                         self.profile.worker.num_blocks * bs - n - 1))  # fmt: skip
            headroom = max(0, blocks_for(n + 1 + headroom_tokens, bs) - now_blocks)
            turn = self.turn.get("seat", 0) % len(self.workers)
            readers = (self.workers[i] for i in self.by_load["decode"].order(turn))
            reader = next((w for w in readers if w.add_seat(sr.key, now_blocks, headroom)), None)
            if reader is None:
                return  # waits until a decode worker frees blocks
            self.turn["seat"] = reader.id + 1
            self.seat_queue.popleft()
            self._load(reader, 1)
            sr.reader = reader.id
            reader.pass_on(self._seated, sr)  # the grant leaves the reader between its steps

    def _seated(self, sr: SimRequest) -> None:
        sr.events["dispatched"] = self.now
        writer = self.workers[sr.worker]
        writer.deliver(self._add, writer, sr, True)

    # ---- KV handoffs -------------------------------------------------------------------------------
    def hand_off(self, writer: SimWorker, seq: Sequence) -> None:
        sr = self.requests[seq.request_id]
        num_bytes = seq.num_computed_tokens * self.profile.worker.kv_bytes_per_token
        seconds = self.link.seconds(num_bytes)
        if self.link.blocks_writer:
            writer.hold_s += seconds
        else:  # one link per writer: its transfers go one after another
            seconds += max(0.0, writer.link_free_at - self.now)
            writer.link_free_at = self.now + seconds
        sr.kv_bytes, sr.events["transfer_start"], sr.writer_id = num_bytes, self.now, writer.id
        if self.events is not None:
            self.events.append({"type": "request", "kind": "transfer_start", "request_id": sr.key[:-2], "key": sr.key,
                                "worker": writer.id, "time": self.now, "bytes": num_bytes, "to": sr.reader})  # fmt: skip
        self.at(self.now + seconds, self._transferred, writer, sr, seq)

    def _transferred(self, writer: SimWorker, sr: SimRequest, seq: Sequence) -> None:
        writer.scheduler.release_handoff(sr.key)
        writer.kick()
        reader = self.workers[sr.reader]
        reader.deliver(self._import, reader, sr, seq)

    def _import(self, reader: SimWorker, sr: SimRequest, seq: Sequence) -> None:
        moved = SimSequence.of(sr, seq.prompt_token_ids, seq.params)
        moved.token_ids = list(seq.token_ids)
        moved.num_computed_tokens = seq.num_computed_tokens
        moved.block_table = reader.blocks.claim_seat(sr.key)
        sr.kv_seconds = self.now - sr.events["transfer_start"]  # as the reader reports it: once it has the KV in
        if self.events is not None:
            self.events.append({"type": "request", "kind": "transfer_end", "request_id": sr.key[:-2], "key": sr.key,
                                "worker": sr.reader, "time": self.now, "bytes": sr.kv_bytes,
                                "seconds": self.now - sr.events["transfer_start"], "from": sr.writer_id})  # fmt: skip
        self._load(self.workers[sr.writer_id], -1)  # the router's placement becomes the reader's when the KV is in
        sr.worker = reader.id
        reader.scheduler.add_imported(moved)

    def finished(self, sr: SimRequest, w: SimWorker) -> None:
        self._load(w, -1)
        sr.record.output_tokens = len(sr.record.token_times)
        sr.record.end_time = sr.record.token_times[-1] if sr.record.token_times else self.now
        sr.record.server_timeline = {"request_id": sr.key[:-2], "arrival": sr.record.send_time, "path": sr.path,
                                     "events": sr.events, "kv_transfer": {"bytes": sr.kv_bytes, "seconds": sr.kv_seconds}}  # fmt: skip
        if sr.reader is not None and w.id != sr.reader:  # it ended on its writer (its first token): as the router's Abort
            self._give_back_seat(sr)
        elif w.role == "decode":
            self._pump_seats()


def simulate(profile: Profile, requests: list[BenchRequest], mode: Mode, num_workers: int,
             options: Options | None = None) -> tuple[list[RequestRecord], Simulation]:  # fmt: skip
    sim = Simulation(profile, mode, num_workers, options)
    return sim.run(requests), sim
