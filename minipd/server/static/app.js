// minipd's teaching page: live replies, a long prompt, and the engine steps that explain every late token.
// Plain JS, no build step, no network outside this server. It uses only the public API:
//   POST /v1/chat/completions (stream), GET|POST /admin/mode, GET /admin/workers, GET /admin/events.
// A mode switch is live: the workers take their new roles at once and the replies on a worker that can no
// longer write them move (their KV cache crosses to another worker) while they stream.
"use strict";

const QUESTIONS = [
  "Tell me a story about a lighthouse keeper and a storm.",
  "Explain how a bicycle stays upright.",
  "Describe a busy market on a Saturday morning.",
  "Why do leaves change colour in autumn?",
];
const COLORS = ["#2f6fde", "#0f9d8a", "#c2417a", "#7a5cc4", "#b0651a", "#3a8f3a"];
const LONG_COLOR = "#3b4454";
const HANDOFF_COLOR = "#7a4bd6"; // a prompt's KV, prefill worker -> decode worker
const MOVE_COLOR = "#0c8a5a"; // a running reply's KV, moved to another worker
const SWITCH_COLOR = "#1d2330";
const ADVISOR_COLOR = "#b0651a";
const REPLY_TOKENS = 120;
const LONG_REPLY_TOKENS = 8;
const STALL_RATIO = 3; // a gap this many times the stream's median gap is a stall ...
const STALL_MIN_S = 0.2; // ... if it is also at least this long
const MODES = {
  colocated: { mode: "colocated" },
  chunked: { mode: "chunked", chunk_tokens: 64 },
  disagg: { mode: "disagg", prefill_workers: 1, decode_workers: 1 },
};

const S = {
  key: localStorage.getItem("minipd.apiKey") || "",
  mode: null, // what GET /admin/mode says
  switching: false, // this page's POST /admin/mode is under way
  served: false, // ... and the new mode serves already (its moves go on)
  workers: [], // [{id, role, state, draining}] from GET /admin/workers
  t0: null, // the scene's start, epoch seconds (Date.now() and the server share the host clock)
  streams: [], // replies and long prompts, in lane order
  byId: new Map(), // request id -> stream
  steps: new Map(), // "worker:time" -> step event
  requests: new Map(), // request id -> {kind: time} from request events
  handoffs: new Map(), // key -> {rid, from, to, start, end, bytes, seconds}
  switches: [], // {time, from, to, drain, serving, mode, roles, switched, outcome}: one per mode switch
  moves: [], // {rid, key, from, to, reason, start, xferStart, xferEnd, end, tokens, bytes, seconds, outcome, detail}
  pendingMoves: new Map(), // key -> its move, from its start to its end
  marks: [], // instants: worker changes (draining, lost, ...) and advisor decisions
  seen: new Set(), // events already taken, but steps (the feed replays after a reconnect)
  since: 0, // the newest event's time: the feed picks up from here
  drawn: [], // what the last draw put on the timeline: switches, moves, marks (for tests and curious readers)
  stalls: [],
  hits: [], // what the pointer can point at, rebuilt on every draw
  charsPerToken: 4.6, // calibrated from the server's prompt_tokens after each long prompt
  longCount: 0,
  feed: null, // the event feed's AbortController
  dirty: true, // something to redraw
};
window.minipd = { state: S, stallPoint, drawn: () => S.drawn };

const $ = (id) => document.getElementById(id);
const now = () => Date.now() / 1000;
const ridOf = (key) => key.slice(0, key.lastIndexOf("."));
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// ---- talking to the server ------------------------------------------------------------------
class HttpError extends Error {}

async function api(path, opts = {}) {
  const headers = { ...(opts.headers || {}) };
  if (S.key) headers.Authorization = "Bearer " + S.key;
  if (opts.body) headers["Content-Type"] = "application/json";
  const resp = await fetch(path, { ...opts, headers });
  if (!resp.ok) {
    let msg = resp.status + " " + resp.statusText;
    try {
      msg = (await resp.json()).error.message || msg;
    } catch (e) { /* not JSON */ }
    if (resp.status === 401) msg = "This server needs an API key: type it in the box at the top right. (" + msg + ")";
    throw new HttpError(msg);
  }
  return resp;
}

// Server-sent events through fetch (an EventSource cannot send the Authorization header).
async function readSSE(resp, onData) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let nl;
    while ((nl = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, nl).trim();
      buf = buf.slice(nl + 1);
      if (!line.startsWith("data:")) continue; // blank lines and ": keep-alive"
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      onData(JSON.parse(data));
    }
  }
}

const isAbort = (e) => e && e.name === "AbortError";

function say(text, error = false) {
  const m = $("message");
  m.textContent = text;
  m.classList.toggle("error", error);
}

// ---- mode and workers -----------------------------------------------------------------------
async function loadMode() {
  try {
    S.mode = await (await api("/admin/mode")).json();
  } catch (e) {
    say(e.message, true);
  }
  renderMode();
}

async function loadWorkers() {
  try {
    S.workers = (await (await api("/admin/workers")).json()).workers
      .map((w) => ({ id: w.id, role: w.role, state: w.state, draining: w.draining }));
  } catch (e) { /* the mode call says why */ }
  S.dirty = true;
}

async function setMode(name) {
  const body = MODES[name];
  S.switching = true;
  S.served = false;
  renderMode();
  say(`Switching to ${name}: the workers take their new roles at once; a reply on a worker that can no longer ` +
    "write it moves, with its KV cache, to one that can, and goes on streaming…");
  // A browser opens at most 6 connections to a server: with 5 streams and the event feed, the switch would wait
  // for a stream to end. The feed gives its connection up meanwhile and replays what it missed afterwards.
  const crowded = S.streams.filter((s) => !s.done).length >= 5;
  if (crowded && S.feed) S.feed.abort();
  try {
    const answer = await (await api("/admin/mode", { method: "POST", body: JSON.stringify(body) })).json();
    S.mode = answer;
    applyRoles(answer);
    if (answer.switch) switchAnswered(answer.switch);
    say(switchText(answer));
  } catch (e) {
    say("The switch failed: " + e.message, true);
  }
  if (crowded) followEvents(S.since - 1);
  S.switching = false;
  renderMode();
  await loadWorkers();
}

function switchText(answer) {
  const sw = answer.switch;
  if (!sw || !sw.changed) return `Already ${modeLabel(answer)}: nothing changed.`;
  let text = `Now ${modeLabel(answer)}: serving again after ${fmtS(sw.serving_after_seconds ?? sw.seconds)}`;
  if (sw.moved || sw.not_moved) {
    text += `; ${sw.moved} repl${sw.moved === 1 ? "y" : "ies"} moved to another worker (${fmtBytes(sw.bytes)} of KV, ` +
      `slowest ${fmtS(sw.slowest_move_seconds)})`;
    if (sw.not_moved) text += `, ${sw.not_moved} not (${Object.entries(sw.outcomes || {}).filter(([o]) => o !== "moved")
      .map(([o, n]) => `${n} ${o}`).join(", ")})`;
  } else text += "; no reply had to move";
  return text + `; all done in ${fmtS(sw.seconds)}.`;
}

// The roles the server gives its workers in a mode (Mode.roles in server/modes.py).
function rolesOf(m, n) {
  if (m.mode === "disagg") {
    const p = m.prefill_workers;
    const d = m.decode_workers;
    return Array.from({ length: n }, (_, i) => (i < p ? "prefill" : i < p + d ? "decode" : "idle"));
  }
  const active = m.workers || n;
  return Array.from({ length: n }, (_, i) => (i < active ? "both" : "idle"));
}

// The lanes show the new roles as soon as the new mode serves (GET /admin/workers confirms them after).
function applyRoles(m) {
  const roles = rolesOf(m, S.workers.length);
  for (const w of S.workers) w.role = roles[w.id] ?? w.role;
  S.dirty = true;
  return roles;
}

// "disagg 1P1D", "chunked 64", "colocated": a mode in a few characters, for the timeline
function shortMode(m) {
  if (!m) return "?";
  if (m.mode === "disagg") return `disagg ${m.prefill_workers}P${m.decode_workers}D`;
  if (m.mode === "chunked") return `chunked ${m.chunk_tokens}` + (m.workers ? ` ×${m.workers}` : "");
  return m.mode + (m.workers ? ` ×${m.workers}` : "");
}

function modeLabel(m) {
  if (!m) return "…";
  if (m.mode === "chunked") return `chunked · ${m.chunk_tokens} tokens`;
  if (m.mode === "disagg") return `disagg · ${m.prefill_workers}P + ${m.decode_workers}D`;
  return m.workers ? `${m.mode} · ${m.workers} worker${m.workers > 1 ? "s" : ""}` : m.mode;
}

const MODE_TEXT = {
  colocated: (m) =>
    "Each worker is one shared card: like 32 people sharing one GPU, one pass through the model writes the next token " +
    "of every reply on it. A new prompt is read whole, in one step, before the replies continue, so a long prompt " +
    "freezes every reply on its worker mid-sentence: the red gaps.",
  chunked: (m) =>
    `Still one shared card per worker, but each step reads at most ${m.chunk_tokens} prompt tokens, after everyone's ` +
    "next token. The long prompt is sliced so it rides along: nobody freezes, but every reply on its worker slows for " +
    "as long as it is read (on a CPU a slice costs several decode steps; on a GPU much less), and the long prompt " +
    "itself waits longer for its first word.",
  disagg: (m) =>
    `Reading and writing on separate workers: ${workers(m.prefill_workers)} only read prompts, ` +
    `${workers(m.decode_workers)} only write replies, so no reply ever waits behind a prompt. The price is the ` +
    "prompt's notes (its KV cache) crossing from one worker to the other: the purple arrows, with their size and time.",
};
const SWITCH_TEXT = " A mode button works while replies stream: the black line is the switch, the workers' new roles " +
  "show at once, and a reply on a worker that can no longer write it moves there with its KV cache (the green arrows).";

const workers = (n) => (n === 1 ? "one worker" : `${n} workers`);

function renderMode() {
  const badge = $("mode");
  const waiting = S.switching && !S.served; // the new mode does not serve yet
  badge.textContent = waiting ? "switching…" : modeLabel(S.mode) + (S.switching ? " · moving replies…" : "");
  badge.dataset.mode = waiting || !S.mode ? "" : S.mode.mode;
  badge.classList.toggle("busy", S.switching);
  const text = S.mode && MODE_TEXT[S.mode.mode];
  $("mode-text").textContent = text ? text(S.mode) + SWITCH_TEXT : "";
  renderButtons();
}

function renderButtons() {
  const running = S.streams.filter((s) => !s.done);
  const replies = running.filter((s) => s.kind === "reply").length;
  const longs = running.length - replies;
  $("start").disabled = replies > 0 || S.switching;
  $("long").disabled = longs > 0 || S.switching;
  for (const b of document.querySelectorAll(".mode-btn")) {
    b.disabled = S.switching; // live: a switch while replies stream moves them
    b.classList.toggle("current", !!S.mode && S.mode.mode === b.dataset.setMode && !S.switching);
  }
}

// ---- the event feed: every engine step of every worker ----------------------------------------
async function followEvents(since = now() - 2) {
  if (S.feed) S.feed.abort();
  const ctrl = new AbortController();
  S.feed = ctrl;
  S.since = since;
  while (!ctrl.signal.aborted) {
    try {
      const resp = await api("/admin/events?since=" + S.since.toFixed(3), { signal: ctrl.signal });
      await readSSE(resp, (ev) => {
        if (ctrl.signal.aborted) return;
        S.since = Math.max(S.since, ev.time || 0);
        onEvent(ev);
      });
    } catch (e) {
      if (isAbort(e) || ctrl.signal.aborted) return;
      if (e instanceof HttpError) say(e.message, true);
    }
    await sleep(1000); // the feed ended (server restart, network): pick up where it was
  }
}

function onEvent(ev) {
  if (ev.type === "step_start") return;
  if (ev.type !== "step") { // the feed replays what it had after a reconnect: take each event once
    const sig = [ev.type, ev.kind, ev.phase, ev.state, ev.key, ev.request_id, ev.worker, ev.time].join("|");
    if (S.seen.has(sig)) return;
    if (S.seen.size > 50000) S.seen.clear();
    S.seen.add(sig);
  }
  if (ev.type === "step") {
    ev.rids = ev.keys.map(ridOf);
    ev.prefillRids = ev.prefilling.map(ridOf);
    S.steps.set(ev.worker + ":" + ev.time, ev);
    const st = ev.rids.map((r) => S.byId.get(r)).filter(Boolean);
    for (const s of st) s.worker = ev.worker;
  } else if (ev.type === "request") {
    const r = S.requests.get(ev.request_id) || {};
    if (!(ev.kind in r) || ev.kind.endsWith("_end")) r[ev.kind] = ev.time;
    if (ev.kind === "prefill_start") r.prefillWorker = ev.worker;
    S.requests.set(ev.request_id, r);
    if (ev.kind === "placed") r.path = ev.path;
    const mv = S.pendingMoves.get(ev.key);
    if (mv && (ev.kind === "transfer_start" || ev.kind === "transfer_end")) {
      // a move's KV crossing: drawn as the move, not as a prompt's handoff
      if (ev.kind === "transfer_start") Object.assign(mv, { xferStart: ev.time, bytes: ev.bytes });
      else Object.assign(mv, { xferEnd: ev.time, bytes: ev.bytes, seconds: ev.seconds });
    } else if (ev.kind === "transfer_start" || ev.kind === "transfer_end") {
      const h = S.handoffs.get(ev.key) || { rid: ev.request_id };
      if (ev.kind === "transfer_start") Object.assign(h, { from: ev.worker, to: ev.to, start: ev.time, bytes: ev.bytes });
      else Object.assign(h, { to: ev.worker, end: ev.time, bytes: ev.bytes, seconds: ev.seconds });
      S.handoffs.set(ev.key, h);
    }
  } else if (["mode", "move", "worker", "advisor"].includes(ev.type)) {
    if (ev.type === "mode") onModeEvent(ev);
    else if (ev.type === "move") onMoveEvent(ev);
    else if (ev.type === "worker") {
      const moved = ev.state === "drained" && ev.moved !== undefined ? ` · moved ${ev.moved}` : "";
      S.marks.push({ time: ev.time, worker: ev.worker, label: `worker ${ev.worker} ${ev.state}${moved}`, bad: ev.state === "lost" });
      loadWorkers();
    } else {
      const what = ev.decision ?? ev.chosen ?? "";
      const text = typeof what === "string" ? what : JSON.stringify(what);
      S.marks.push({ time: ev.time, label: "advisor: " + text.slice(0, 60), advisor: true });
    }
  }
  S.dirty = true;
}

// A switch starts ("switch", or "drain" for a clean cut), its new mode serves ("serving": the lanes change
// now), its moves are done ("switched": what moved, how long it all took), or it failed ("failed").
function onModeEvent(ev) {
  if (ev.phase === "switch" || ev.phase === "drain") {
    if (!S.switches.some((w) => w.time === ev.time)) {
      S.switches.push({ time: ev.time, from: ev.from, to: ev.to, drain: ev.phase === "drain" });
    }
    return;
  }
  const open = S.switches.filter((w) => w.time <= ev.time + 0.01);
  if (ev.phase === "serving") {
    const sw = open.reverse().find((w) => w.serving === undefined);
    S.mode = { ...ev.mode };
    S.served = true;
    const roles = applyRoles(ev.mode);
    if (sw) Object.assign(sw, { serving: ev.time, mode: ev.mode, roles });
    renderMode();
    loadWorkers();
  } else if (ev.phase === "switched") {
    switchAnswered(ev, ev.time);
  } else if (ev.phase === "failed") {  // it did not happen: the old mode serves on
    S.switches = S.switches.filter((w) => w.time !== ev.started);
    S.dirty = true;
  }
}

// A switch's outcome, from its "switched" event or from the POST's answer (whichever comes first).
function switchAnswered(o, at) {
  let sw = S.switches.find((w) => w.time === o.started);
  if (!sw) {
    sw = { time: o.started, from: o.from, to: o.to, drain: o.drain };
    S.switches.push(sw);
  }
  if (sw.serving === undefined && o.serving_after_seconds !== undefined) {
    Object.assign(sw, { serving: o.started + o.serving_after_seconds, mode: o.to, roles: rolesOf(o.to, S.workers.length) });
  }
  sw.switched = at ?? o.started + o.seconds;
  sw.outcome = o;
  S.dirty = true;
}

function onMoveEvent(ev) {
  let mv = S.pendingMoves.get(ev.key);
  if (ev.phase === "start") {
    mv = { rid: ev.request_id, key: ev.key, from: ev.from, to: ev.to, reason: ev.reason, start: ev.time };
    S.pendingMoves.set(ev.key, mv);
    S.moves.push(mv);
    return;
  }
  S.pendingMoves.delete(ev.key);
  if (!mv) { // it never started (no seat anywhere, or the reply ended first)
    mv = { rid: ev.request_id, key: ev.key, from: ev.source, start: ev.start };
    S.moves.push(mv);
  }
  Object.assign(mv, { from: ev.source, to: ev.target ?? mv.to, reason: ev.reason, end: ev.time, tokens: ev.tokens,
    bytes: ev.bytes || mv.bytes, seconds: ev.seconds, outcome: ev.outcome, detail: ev.detail });
}

// ---- streams --------------------------------------------------------------------------------
function newScene() {
  for (const s of S.streams) if (s.ctrl) s.ctrl.abort();
  S.streams = [];
  S.byId.clear();
  S.stalls = [];
  S.longCount = 0;
  S.t0 = now();
  const old = S.t0 - 5;
  for (const [k, s] of S.steps) if (s.end < old) S.steps.delete(k);
  S.marks = S.marks.filter((m) => m.time >= old);
  S.switches = S.switches.filter((w) => (w.switched ?? w.time) >= old);
  S.moves = S.moves.filter((m) => (m.end ?? m.start) >= old || S.pendingMoves.get(m.key) === m);
  S.requests.clear();
  S.handoffs.clear();
  $("streams").innerHTML = "";
  renderStalls(true);
  S.dirty = true;
}

function sceneRunning() {
  return S.streams.some((s) => !s.done);
}

function addStream(kind, question, content, maxTokens) {
  const i = S.streams.filter((s) => s.kind === kind).length;
  const st = {
    kind,
    n: i + 1,
    name: kind === "long" ? (S.longCount > 1 ? `long prompt ${S.longCount}` : "long prompt") : `reply ${i + 1}`,
    color: kind === "long" ? LONG_COLOR : COLORS[i % COLORS.length],
    question,
    id: null,
    sent: now(),
    ticks: [],
    text: "",
    done: false,
    error: null,
    usage: null,
    timeline: null,
    worker: null,
    ctrl: new AbortController(),
  };
  S.streams.push(st);
  makeCard(st);
  const body = {
    messages: [{ role: "user", content }],
    stream: true,
    temperature: 0,
    max_tokens: maxTokens,
    stream_options: { include_usage: true },
  };
  if (kind === "reply" && $("ignore-eos").checked) body.ignore_eos = true; // vLLM's extension: write all max_tokens
  runStream(st, body);
  renderButtons();
  return st;
}

async function runStream(st, body) {
  try {
    const resp = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body), signal: st.ctrl.signal });
    await readSSE(resp, (obj) => onChunk(st, obj));
    if (!st.timeline && st.id) {
      // the usage chunk carries the timeline; the endpoint has it too
      st.timeline = await (await api(`/v1/requests/${st.id}/timeline`)).json();
    }
  } catch (e) {
    if (!isAbort(e)) st.error = e.message;
  }
  st.done = true;
  st.finished = now();
  if (st.kind === "long" && st.usage) {
    const chars = body.messages[0].content.length;
    S.charsPerToken = chars / Math.max(1, st.usage.prompt_tokens - 20);
  }
  updateCard(st);
  renderButtons();
  S.dirty = true;
}

function onChunk(st, obj) {
  if (obj.error) {
    st.error = obj.error.message;
    return;
  }
  if (obj.id && !st.id) {
    st.id = obj.id;
    S.byId.set(obj.id, st);
  }
  if (obj.usage) {
    st.usage = obj.usage;
    st.timeline = obj.timeline || null;
    return;
  }
  const choice = obj.choices && obj.choices[0];
  if (!choice) return;
  const text = (choice.delta && choice.delta.content) || "";
  if (text || choice.finish_reason) {
    st.ticks.push(now()); // a token arrived (a chunk with no text and no ending is the role)
    st.text += text;
    if (choice.finish_reason) st.finishReason = choice.finish_reason;
    st.textEl.textContent = st.text;
    st.textEl.scrollTop = st.textEl.scrollHeight;
    S.dirty = true;
  }
}

function startReplies() {
  if (!sceneRunning()) newScene();
  const n = +$("n-streams").value;
  for (let i = 0; i < n; i++) addStream("reply", QUESTIONS[i % QUESTIONS.length], QUESTIONS[i % QUESTIONS.length], REPLY_TOKENS);
}

function dropLongPrompt() {
  if (!sceneRunning()) newScene();
  S.longCount += 1;
  const tokens = +$("long-len").value;
  const doc = longDocument(Math.round(tokens * S.charsPerToken));
  const ask = "In one sentence, what is this report about?";
  addStream("long", `A ${tokens}-token report, then: "${ask}"`, doc + "\n\n" + ask, LONG_REPLY_TOKENS);
}

// A long, plain document made here (no file to fetch): numbered paragraphs from a few sentences.
function longDocument(chars) {
  const sentences = [
    "The harbour town of Eastwick grew around a deep bay that stayed free of ice through the winter.",
    "Fishing boats left before dawn and came back at noon, when the market by the quay was at its busiest.",
    "In the spring the council repaired the sea wall, which the storms of the previous year had cracked in places.",
    "A railway line reached the town in the last century and brought visitors from the cities inland.",
    "The old lighthouse on the northern headland still guides ships past the rocks at the mouth of the bay.",
    "Most houses along the hill are built of grey stone, with small windows that face away from the wind.",
    "The school by the church teaches about two hundred children, many of whom walk from the nearby farms.",
    "Every August a regatta fills the bay with sails, and the whole town gathers on the beach to watch.",
    "Records kept at the harbour office list the catch of every boat, the weather and the height of the tide.",
    "Trade in salt, timber and wool made a few families rich, and their houses still stand near the square.",
  ];
  const out = [];
  let n = 0;
  let p = 1;
  while (n < chars) {
    const para = [`Section ${p}.`];
    for (let k = 0; k < 4; k++) para.push(sentences[(p * 3 + k) % sentences.length]);
    const s = para.join(" ");
    out.push(s);
    n += s.length + 2;
    p += 1;
  }
  return "Report on the town of Eastwick\n\n" + out.join("\n\n");
}

// ---- the numbers --------------------------------------------------------------------------
function median(xs) {
  if (!xs.length) return null;
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

function gapsOf(st) {
  const g = [];
  for (let i = 1; i < st.ticks.length; i++) g.push(st.ticks[i] - st.ticks[i - 1]);
  return g;
}

function computeStalls() {
  const out = [];
  for (const st of S.streams) {
    st.stalls = [];
    if (st.kind !== "reply") continue;
    const gaps = gapsOf(st);
    st.median = median(gaps);
    if (gaps.length < 4) continue;
    gaps.forEach((g, j) => {
      if (g > STALL_RATIO * st.median && g >= STALL_MIN_S) {
        const s = { st, i: j + 1, a: st.ticks[j], b: st.ticks[j + 1], gap: g, ratio: g / st.median };
        st.stalls.push(s);
        out.push(s);
      }
    });
  }
  out.sort((x, y) => x.b - y.b);
  S.stalls = out;
  const tl = $("timeline");
  if (tl.dataset.stalls !== String(out.length)) {
    tl.dataset.stalls = String(out.length);
    document.body.dataset.stalls = String(out.length);
    $("stall-count").textContent = String(out.length);
  }
}

function streamName(rid) {
  const st = S.byId.get(rid);
  if (!st) return "another request";
  return st.kind === "long" ? "the " + st.name : st.name + "'s prompt";
}

function joinNames(rids) {
  const names = [...new Set(rids.map(streamName))];
  return names.length ? names.join(" and ") : "a prompt";
}

// What ran while a reply waited between two of its tokens: the steps of the worker that made the late
// token, from the step after the one that made the token before, up to the one that made the late one.
const explained = new Map(); // memo, cleared whenever new events arrive
let explainedAt = -1;

function why(stall) {
  const version = S.steps.size + S.handoffs.size * 1e6 + S.moves.length * 1e9 + S.switches.length * 1e12;
  if (version !== explainedAt) {
    explained.clear();
    explainedAt = version;
  }
  const memo = stall.st.name + ":" + stall.i;
  if (!explained.has(memo)) explained.set(memo, findCause(stall));
  return explained.get(memo);
}

function findCause({ st, a, b }) {
  let made = null; // the step that made the late token
  let before = null; // the step that made the token before it
  for (const s of S.steps.values()) {
    if (!s.rids.includes(st.id)) continue;
    if (s.end <= b + 0.002 && (!made || s.end > made.end)) made = s;
  }
  for (const s of S.steps.values()) {
    if (s.rids.includes(st.id) && s.end <= a + 0.002 && (!made || s.end < made.end) && (!before || s.end > before.end)) before = s;
  }
  const worker = made ? made.worker : st.timeline ? st.timeline.decode_worker : null;
  const lo = before ? before.end : a - 0.002;
  const hi = made ? made.end : b;
  const steps = worker === null ? [] : [...S.steps.values()].filter((s) => s.worker === worker && s.end > lo && s.end <= hi);
  const prefill = steps.filter((s) => s.prefill_tokens > 0);
  const handoffs = [...S.handoffs.values()].filter((h) => h.rid === st.id && h.start !== undefined && h.start < b && (h.end || b) > a);
  const moves = S.moves.filter((m) => m.rid === st.id && m.start < b && (m.end ?? b) > a);
  const modeSwitch = S.switches.find((w) => w.time < b && (w.switched ?? w.serving ?? w.time) > a) || null;
  let cause = "none";
  let names = "";
  if (prefill.length) {
    cause = "prefill";
    names = joinNames(prefill.flatMap((s) => s.prefillRids));
  } else if (handoffs.length) cause = "handoff";
  else if (moves.length) cause = "move";
  else if (steps.length) {
    cause = "slow";
    names = [...new Set(steps.flatMap((s) => s.rids))].map((r) => S.byId.get(r)).filter((o) => o && o.kind === "long")
      .map((o) => `the ${o.name}'s reply` + (o.usage ? ` (attending over its ${fmtInt(o.usage.prompt_tokens)}-token prompt)` : ""))
      .join(" and ");
  }
  return { worker, steps, prefill, handoffs, moves, modeSwitch, cause, names,
    key: `${cause}:${worker}:${names}:${modeSwitch ? modeSwitch.time : ""}` };
}

// The cause of one late token, or of a run of them (an episode), in words.
function causeText(c, steps, handoffs, moves = []) {
  const w = c.worker;
  const parts = [];
  if (w === null || w === undefined) parts.push("(no engine step is known for this gap yet)");
  else if (c.cause === "prefill") {
    const pre = steps.filter((s) => s.prefill_tokens > 0);
    const tokens = pre.reduce((n, s) => n + s.prefill_tokens, 0);
    const busy = pre.reduce((n, s) => n + (s.end - s.time), 0);
    if (pre.length === 1) {
      parts.push(`behind worker ${w}'s step reading ${fmtInt(tokens)} prompt tokens of ${c.names} (${fmtS(busy)})`);
    } else {
      const most = Math.max(...pre.map((s) => s.prefill_tokens));
      parts.push(`behind ${pre.length} steps of worker ${w} that read ${fmtInt(tokens)} prompt tokens of ${c.names}, ` +
        `up to ${fmtInt(most)} per step, each also writing the replies' next tokens (${fmtS(busy)} in all)`);
    }
  } else if (c.cause === "slow") {
    const longest = Math.max(...steps.map((s) => s.end - s.time));
    parts.push(`on worker ${w}'s slower step${steps.length > 1 ? "s" : ""} (up to ${fmtS(longest)}), which read no prompt` +
      (c.names ? ` but also wrote ${c.names}` : ""));
  } else if (c.cause === "none" && !handoffs.length && !moves.length) {
    parts.push(`while worker ${w} ran no step (the browser or the network was slow)`);
  }
  for (const h of handoffs) {
    parts.push(`while its KV cache (${fmtBytes(h.bytes)}) crossed from worker ${h.from} to worker ${h.to}` +
      (h.seconds ? ` in ${fmtS(h.seconds)}` : ""));
  }
  for (const m of moves) {
    const kv = m.bytes ? ` (${m.tokens ? fmtInt(m.tokens) + " tokens, " : ""}${fmtBytes(m.bytes)})` : "";
    if (m.outcome === undefined || m.outcome === "moved") {
      parts.push(`while it moved from worker ${m.from} to worker ${m.to}, its KV cache${kv} with it` +
        (m.seconds ? ` in ${fmtS(m.seconds)}` : ""));
    } else parts.push(`while its move from worker ${m.from} did not happen (${m.outcome})`);
  }
  const sw = c.modeSwitch;
  if (sw) parts.push(sw.drain ? "while a mode switch drained the workers" : `during the switch to ${shortMode(sw.to)}`);
  return parts.join("; ");
}

function explain(stall) {
  const c = why(stall);
  return { worker: c.worker, text: causeText(c, c.steps, c.handoffs, c.moves) };
}

// Late tokens with one cause, back to back (and the replies on one worker stall together): one episode.
function episodes() {
  const out = [];
  for (const s of S.stalls) {
    const c = why(s);
    let e = out.find((e) => e.key === c.key && s.a <= e.until + 0.05);
    if (!e) {
      e = { key: c.key, cause: c, stalls: [], steps: new Set(), handoffs: new Set(), moves: new Set(), until: 0 };
      out.push(e);
    }
    e.stalls.push(s);
    e.until = Math.max(e.until, s.b);
    c.steps.forEach((x) => e.steps.add(x));
    c.handoffs.forEach((x) => e.handoffs.add(x));
    c.moves.forEach((x) => e.moves.add(x));
  }
  return out;
}

function fmtS(s) {
  if (s === null || s === undefined || isNaN(s)) return "–";
  return s >= 1 ? s.toFixed(2) + " s" : Math.round(s * 1000) + " ms";
}
function fmtRange(a, b) {
  return a < 1 && b < 1 ? `${Math.round(a * 1000)}–${Math.round(b * 1000)} ms` : `${fmtS(a)}–${fmtS(b)}`;
}
const fmtInt = (n) => Number(n).toLocaleString("en-US");
function fmtBytes(b) {
  if (!b) return "? B";
  if (b >= 1e9) return (b / 1e9).toFixed(2) + " GB";
  if (b >= 1e6) return (b / 1e6).toFixed(1) + " MB";
  return (b / 1e3).toFixed(0) + " kB";
}

// ---- the cards and the list ----------------------------------------------------------------
function makeCard(st) {
  const card = document.createElement("div");
  card.className = "card" + (st.kind === "long" ? " long" : "");
  card.style.setProperty("--lane", st.color);
  card.dataset.stream = st.name;
  card.dataset.tokens = "0";
  card.innerHTML = '<div class="head"><b></b><span class="where"></span></div><div class="q"></div>' +
    '<div class="text"></div><div class="stats"></div><div class="err"></div>';
  card.querySelector("b").textContent = st.name;
  card.querySelector(".q").textContent = st.question;
  st.card = card;
  st.textEl = card.querySelector(".text");
  $("streams").appendChild(card);
}

function updateCard(st) {
  const c = st.card;
  if (!c) return;
  c.dataset.tokens = String(st.ticks.length);
  c.dataset.done = String(st.done);
  c.classList.toggle("error", !!st.error);
  c.querySelector(".err").textContent = st.error || "";
  const tl = st.timeline;
  const req = (st.id && S.requests.get(st.id)) || {};
  let where = st.worker !== null ? `worker ${st.worker}` : "";
  if (tl && tl.prefill_worker !== null && tl.decode_worker !== null && tl.prefill_worker !== tl.decode_worker) {
    where = `read on worker ${tl.prefill_worker} → written on worker ${tl.decode_worker}`;
  } else if (tl && tl.decode_worker !== null) where = `worker ${tl.decode_worker}`;
  const moves = movesOf(st);
  const hops = moves.filter((m) => m.outcome === "moved");
  const path = hops.map((m) => `${m.from}→${m.to}`).join(",");
  if (c.dataset.moved !== path) c.dataset.moved = path;
  if (hops.length) where = `moved: worker ${movedPath(st, moves).slice(1).replaceAll("→", " → ")}`;
  c.querySelector(".where").textContent = (st.done ? "" : "● ") + where;
  const rows = [];
  const n = st.ticks.length;
  rows.push(["tokens", tl ? `${tl.output_tokens}` + (st.usage ? ` (prompt ${fmtInt(st.usage.prompt_tokens)})` : "") : `${n}`]);
  rows.push(["TTFT here", n ? fmtS(st.ticks[0] - st.sent) : st.done ? "–" : "waiting…"]);
  if (n > 1) rows.push(["TPOT here", fmtS((st.ticks[n - 1] - st.ticks[0]) / (n - 1))]);
  if (st.kind === "reply" && st.median) {
    const worst = Math.max(...gapsOf(st));
    const bad = st.stalls && st.stalls.length;
    rows.push(["worst gap", `<span class="${bad ? "bad" : ""}">${fmtS(worst)} (${(worst / st.median).toFixed(1)}× median ` +
      `${fmtS(st.median)})${bad ? ` · ${bad} stall${bad > 1 ? "s" : ""}` : ""}</span>`]);
  }
  const pStart = (tl && tl.events.prefill_start) || req.prefill_start;
  const pEnd = (tl && tl.events.prefill_end) || req.prefill_end;
  if (st.kind === "long" && pStart && pEnd) rows.push(["prefill", `${fmtS(pEnd - pStart)} (waited ${fmtS(pStart - st.sent)} for it)`]);
  const placed = (tl && tl.path) || req.path;
  const paths = {local: "local: its decode worker read the prompt", remote: "remote: KV handoff",
    prefill_only: "prefill only: it ended at its first token, no decode seat"};
  if (placed) rows.push(["path", paths[placed] || placed]);
  for (const m of moves) {
    const when = S.t0 ? ` at +${((m.end ?? m.start) - S.t0).toFixed(1)} s` : "";
    const what = m.outcome === undefined ? "moving…" : m.outcome !== "moved" ? `not moved (${m.outcome})`
      : `${m.tokens ? fmtInt(m.tokens) + " tokens, " : ""}${fmtBytes(m.bytes)} in ${fmtS(m.seconds)}`;
    rows.push(["moved", `<span class="moved">worker ${m.from} → ${m.to ?? "?"}</span>${when}: ${what}`]);
  }
  if (tl) {
    rows.push(["server", `TTFT ${fmtS(tl.ttft)} · TPOT ${fmtS(tl.tpot)}`]);
    const kv = tl.kv_transfer;
    if (kv && kv.bytes) rows.push(["KV handoff", `${fmtBytes(kv.bytes)} in ${fmtS(kv.seconds)} (${kv.gbps ? kv.gbps.toFixed(1) : "?"} Gb/s)`]);
  }
  const html = rows.map(([k, v]) => `<span>${k}</span><span>${v}</span>`).join("");
  const stats = c.querySelector(".stats");
  if (stats.innerHTML !== html) stats.innerHTML = html;
}

let lastStallsHtml = "";
function renderStalls(force) {
  let html = '<li class="empty">No stall yet.</li>';
  if (S.stalls.length) {
    html = episodes().map((e) => {
      const streams = [...new Set(e.stalls.map((s) => s.st))];
      const who = streams.map((st) => {
        const idx = e.stalls.filter((s) => s.st === st).map((s) => s.i + 1);
        const tokens = idx.length > 1 ? `tokens ${idx[0]}–${idx[idx.length - 1]}` : `token ${idx[0]}`;
        return `<span class="who" style="color:${st.color}">${st.name}</span> (${tokens})`;
      }).join(" and ");
      const gaps = e.stalls.map((s) => s.gap);
      const ratios = e.stalls.map((s) => s.ratio);
      const [r0, r1] = [Math.round(Math.min(...ratios)), Math.round(Math.max(...ratios))];
      const ratio = r0 === r1 ? `${r0}×` : `${r0}–${r1}×`;
      const their = streams.length > 1 ? "their" : "its";
      const first = Math.min(...e.stalls.map((s) => s.b));
      const when = e.until - first > 0.05 ? `+${(first - S.t0).toFixed(1)}–${(e.until - S.t0).toFixed(1)} s` : `+${(first - S.t0).toFixed(1)} s`;
      let what;
      const perStream = e.stalls.length / streams.length;
      if (perStream <= 1) {
        what = `waited ${fmtS(Math.max(...gaps))} (${ratio} ${their} median gap)`;
      } else {
        const lost = Math.max(...streams.map((st) => e.stalls.filter((s) => s.st === st).reduce((n, s) => n + s.gap - st.median, 0)));
        what = `${Math.round(perStream)} late tokens${streams.length > 1 ? " each" : ""}, ` +
          `${fmtRange(Math.min(...gaps), Math.max(...gaps))} apart (${ratio} ${their} median gap; ${fmtS(lost)} lost` +
          `${streams.length > 1 ? " per reply" : ""}),`;
      }
      const text = causeText(e.cause, [...e.steps], [...e.handoffs], [...e.moves]);
      return `<li data-worker="${e.cause.worker ?? ""}" data-cause="${e.cause.cause}">${when}, ${who}: ${what} ${escapeHtml(text)}.</li>`;
    }).join("");
  }
  if (force || html !== lastStallsHtml) {
    $("stall-list").innerHTML = html;
    lastStallsHtml = html;
  }
}

function escapeHtml(s) {
  return s.replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
}

// ---- the timeline -------------------------------------------------------------------------
const L = { gutter: 150, right: 18, axis: 26, lane: 24, wlane: 36, gap: 14 };

function viewRange() {
  const t0 = S.t0 ?? now();
  let t1 = t0 + 10;
  const live = sceneRunning() || S.switching;
  if (live) t1 = Math.max(t1, now() + 0.3);
  for (const st of S.streams) {
    if (st.ticks.length) t1 = Math.max(t1, st.ticks[st.ticks.length - 1] + 0.5);
    if (st.finished) t1 = Math.max(t1, st.finished + 0.3);
  }
  return [t0, t1];
}

function workerLanes() {
  const ids = new Set(S.workers.map((w) => w.id));
  for (const s of S.steps.values()) ids.add(s.worker);
  return [...ids].sort((a, b) => a - b).map((id) => ({ id, ...(S.workers.find((w) => w.id === id) || {}) }));
}

function draw() {
  const canvas = $("timeline");
  const wrap = canvas.parentElement;
  const replies = S.streams.filter((s) => s.kind === "reply");
  const longs = S.streams.filter((s) => s.kind === "long");
  const workers = workerLanes();
  const lanesH = Math.max(1, replies.length) * L.lane + longs.length * L.lane;
  const height = L.axis + lanesH + L.gap + workers.length * L.wlane + 10;
  const width = wrap.clientWidth;
  const dpr = window.devicePixelRatio || 1;
  if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
    canvas.style.height = height + "px";
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "12px " + getComputedStyle(document.body).fontFamily;
  ctx.textBaseline = "middle";
  S.hits = [];
  S.drawn = [];

  const [t0, t1] = viewRange();
  const plotW = width - L.gutter - L.right;
  const X = (t) => L.gutter + ((t - t0) / (t1 - t0)) * plotW;

  // time axis
  const span = t1 - t0;
  const stepS = [0.5, 1, 2, 5, 10, 20, 30, 60, 120].find((s) => (s / span) * plotW >= 70) || 300;
  ctx.fillStyle = "#5f6b7a";
  ctx.strokeStyle = "#eef1f5";
  ctx.lineWidth = 1;
  for (let s = 0; s <= span; s += stepS) {
    const x = Math.round(X(t0 + s)) + 0.5;
    ctx.beginPath();
    ctx.moveTo(x, L.axis - 4);
    ctx.lineTo(x, height - 6);
    ctx.stroke();
    ctx.textAlign = "center";
    ctx.fillText(`${s} s`, x, 10);
  }
  ctx.textAlign = "left";

  let y = L.axis;
  if (!S.streams.length) {
    ctx.fillStyle = "#8a94a3";
    ctx.fillText("Start some replies, then drop in a long prompt.", L.gutter + 8, y + L.lane / 2);
  }
  for (const st of [...replies, ...longs]) {
    drawStreamLane(ctx, st, y, X, t0);
    y += L.lane;
  }
  if (!S.streams.length) y += L.lane;
  y += L.gap;

  // worker lanes
  const gapY = y - L.gap / 2; // the row between the replies and the workers: the switches' labels
  const wy = new Map();
  for (const w of workers) {
    wy.set(w.id, y);
    ctx.fillStyle = "#f3f5f8";
    ctx.fillRect(L.gutter, y + 3, plotW, L.wlane - 6);
    ctx.fillStyle = "#1d2330";
    ctx.font = "600 12px " + getComputedStyle(document.body).fontFamily;
    ctx.fillText(`worker ${w.id}`, 8, y + L.wlane / 2 - 6);
    ctx.font = "12px " + getComputedStyle(document.body).fontFamily;
    ctx.fillStyle = "#5f6b7a";
    ctx.fillText((w.role ? roleText(w.role) : "") + (w.draining ? " · draining" : ""), 8, y + L.wlane / 2 + 8);
    y += L.wlane;
  }
  for (const s of S.steps.values()) {
    if (s.end < t0 || s.time > t1 || !wy.has(s.worker)) continue;
    const top = wy.get(s.worker) + 6;
    const h = L.wlane - 12;
    const x0 = Math.max(L.gutter, X(s.time));
    const x1 = Math.max(x0 + 1, X(s.end));
    const prefill = s.prefill_tokens > 0;
    ctx.fillStyle = prefill ? "#f0a030" : "#9fb8dc";
    ctx.fillRect(x0, top, Math.max(1, x1 - x0 - 0.5), h);
    if (prefill && x1 - x0 > 44) {
      ctx.fillStyle = "#4a2c00";
      const label = `${fmtInt(s.prefill_tokens)} tok`;
      if (ctx.measureText(label).width < x1 - x0 - 6) ctx.fillText(label, x0 + 4, top + h / 2);
    }
    S.hits.push({ x0: x0 - 1, x1: x1 + 1, y0: top, y1: top + h, prio: 1, tip: () => stepTip(s) });
  }
  // KV handoffs: prefill worker -> decode worker
  for (const h of S.handoffs.values()) {
    if (h.start === undefined || h.end === undefined || !wy.has(h.from) || !wy.has(h.to)) continue;
    if (h.end < t0 || h.start > t1) continue;
    const down = wy.get(h.to) > wy.get(h.from);
    const ya = wy.get(h.from) + (down ? L.wlane - 5 : 5);
    const yb = wy.get(h.to) + (down ? 5 : L.wlane - 5);
    const xa = X(h.start);
    const xb = Math.max(X(h.end), xa + 4);
    arrow(ctx, xa, ya, xb, yb, HANDOFF_COLOR);
    const st = S.byId.get(h.rid);
    if (st && st.kind === "long") {
      ctx.fillStyle = HANDOFF_COLOR;
      ctx.fillText(`KV ${fmtBytes(h.bytes)} · ${fmtS(h.seconds)}`, xb + 6, (ya + yb) / 2);
    }
    S.hits.push({ x0: Math.min(xa, xb) - 4, x1: Math.max(xa, xb) + 4, y0: Math.min(ya, yb), y1: Math.max(ya, yb), prio: 2,
      tip: () => `<b>KV handoff</b> of ${st ? st.name : h.rid}: ${fmtBytes(h.bytes)} from worker ${h.from} to worker ` +
        `${h.to} in ${fmtS(h.seconds)}${h.seconds ? ` (${((h.bytes * 8) / h.seconds / 1e9).toFixed(1)} Gb/s)` : ""}` });
  }
  drawMoves(ctx, wy, X, t0, t1);
  drawSwitches(ctx, wy, X, t0, t1, height, gapY);
  // worker changes (draining, lost, back up) and advisor decisions: instants
  for (const m of S.marks) {
    if (m.time < t0 || m.time > t1) continue;
    const x = Math.round(X(m.time)) + 0.5;
    const color = m.bad ? "#d93a3a" : m.advisor ? ADVISOR_COLOR : "#8a94a3";
    ctx.strokeStyle = color;
    ctx.setLineDash(m.advisor ? [1, 3] : [3, 3]);
    ctx.beginPath();
    ctx.moveTo(x, L.axis - 2);
    ctx.lineTo(x, height - 6);
    ctx.stroke();
    ctx.setLineDash([]);
    const ly = wy.has(m.worker) ? wy.get(m.worker) + 9 : L.axis + 6;
    label(ctx, m.label, x + 4, ly, m.bad ? "#d93a3a" : m.advisor ? ADVISOR_COLOR : "#5f6b7a");
    S.drawn.push({ kind: m.advisor ? "advisor" : "mark", label: m.label, time: m.time, x });
  }
  const nMoved = S.drawn.filter((d) => d.kind === "move" && d.outcome === "moved").length;
  const nSwitches = S.drawn.filter((d) => d.kind === "switch").length;
  if (canvas.dataset.switches !== String(nSwitches)) canvas.dataset.switches = String(nSwitches);
  if (canvas.dataset.moves !== String(nMoved)) canvas.dataset.moves = String(nMoved);
  if (sceneRunning()) {
    const x = Math.round(X(now())) + 0.5;
    ctx.strokeStyle = "rgba(47,111,222,.5)";
    ctx.beginPath();
    ctx.moveTo(x, L.axis - 4);
    ctx.lineTo(x, height - 6);
    ctx.stroke();
  }
}

// Each move: an arrow from the worker that had the reply to the one that has it now, from its KV leaving to
// its KV landing (a move that did not happen: a grey cross on the worker that kept the reply).
function drawMoves(ctx, wy, X, t0, t1) {
  for (const m of S.moves) {
    const a = m.xferStart ?? m.start;
    const b = m.xferEnd ?? m.end ?? now();
    if (b < t0 || a > t1 || !wy.has(m.from)) continue;
    const st = S.byId.get(m.rid);
    const name = st ? st.name : m.rid;
    const ok = m.outcome === undefined || m.outcome === "moved";
    let box;
    if (ok && wy.has(m.to) && m.to !== m.from) { // from the middle of one lane to the middle of the other
      const ya = wy.get(m.from) + L.wlane / 2;
      const yb = wy.get(m.to) + L.wlane / 2;
      const xa = X(a);
      const xb = Math.max(X(b), xa + 4);
      arrow(ctx, xa, ya, xb, yb, MOVE_COLOR, m.outcome === undefined ? [4, 3] : null); // dashed: on its way
      box = { x0: Math.min(xa, xb) - 4, x1: Math.max(xa, xb) + 4, y0: Math.min(ya, yb), y1: Math.max(ya, yb) };
    } else {
      const x = X(m.end ?? a);
      const yc = wy.get(m.from) + L.wlane / 2;
      ctx.strokeStyle = "#8a94a3";
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      ctx.moveTo(x - 4, yc - 4);
      ctx.lineTo(x + 4, yc + 4);
      ctx.moveTo(x + 4, yc - 4);
      ctx.lineTo(x - 4, yc + 4);
      ctx.stroke();
      ctx.lineWidth = 1;
      box = { x0: x - 5, x1: x + 5, y0: yc - 5, y1: yc + 5 };
    }
    S.hits.push({ ...box, prio: 2, tip: () => moveTip(m, name) });
    S.drawn.push({ kind: "move", rid: m.rid, name, from: m.from, to: m.to, outcome: m.outcome || "moving", time: a });
  }
}

function moveTip(m, name) {
  const why = { switch: "the mode switch", drain: "its worker being drained", rebalance: "a rebalance" }[m.reason] || m.reason;
  if (m.outcome && m.outcome !== "moved") {
    return `<b>${escapeHtml(name)} did not move</b> (${m.outcome}) from worker ${m.from}, for ${why}` +
      (m.detail ? `: ${escapeHtml(m.detail)}` : "");
  }
  const kv = m.bytes ? `its KV cache${m.tokens ? ` (${fmtInt(m.tokens)} tokens)` : ""}, ${fmtBytes(m.bytes)}` : "its KV cache";
  return `<b>${escapeHtml(name)} moved</b> from worker ${m.from} to worker ${m.to} for ${why}: ${kv}` +
    (m.seconds ? ` in ${fmtS(m.seconds)}` : m.outcome ? "" : ", on its way");
}

// Each mode switch: a line across every lane when it starts, a band while its replies move, its label between
// the replies and the workers, and each worker's new role.
function drawSwitches(ctx, wy, X, t0, t1, height, gapY) {
  const last = S.switches[S.switches.length - 1];
  for (const sw of S.switches) {
    const live = sw === last && sw.switched === undefined && (S.switching || sceneRunning());
    const end = sw.switched ?? (live ? now() : sw.serving ?? sw.time);
    if (end < t0 || sw.time > t1) continue;
    const x = Math.round(X(sw.time)) + 0.5;
    ctx.fillStyle = "rgba(12,138,90,.08)";
    ctx.fillRect(x, L.axis - 2, Math.max(0, X(end) - x), height - L.axis - 4);
    ctx.strokeStyle = SWITCH_COLOR;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    ctx.moveTo(x, L.axis - 4);
    ctx.lineTo(x, height - 6);
    ctx.stroke();
    ctx.lineWidth = 1;
    const title = `→ ${shortMode(sw.to)}` + (sw.drain ? " (drain)" : "");
    const o = sw.outcome;
    const detail = o ? `${fmtS(o.seconds)} · moved ${o.moved}${o.moved ? ` (${fmtBytes(o.bytes)})` : ""}` +
      (o.not_moved ? ` · ${o.not_moved} not` : "") : sw.serving !== undefined ? "serving · moving…" : "switching…";
    const font = getComputedStyle(document.body).fontFamily;
    ctx.font = "600 12px " + font;
    label(ctx, title, x + 4, gapY, SWITCH_COLOR);
    const w = ctx.measureText(title).width;
    ctx.font = "12px " + font;
    label(ctx, "· " + detail, x + 10 + w, gapY, MOVE_COLOR);
    if (sw.roles && sw.serving !== undefined) { // the workers' new roles, right of the band (the moves)
      const xs = Math.max(X(sw.serving), X(end)) + 6;
      for (const [id, y] of wy) if (sw.roles[id]) label(ctx, roleText(sw.roles[id]), xs, y + L.wlane - 9, "#5f6b7a");
    }
    S.hits.push({ x0: x - 3, x1: x + 3, y0: L.axis - 4, y1: height - 6, prio: 1, tip: () => switchTip(sw) });
    S.drawn.push({ kind: "switch", label: title, detail, time: sw.time, x, roles: sw.roles || null });
  }
}

function switchTip(sw) {
  const o = sw.outcome;
  let text = `<b>Mode switch</b> ${escapeHtml(shortMode(sw.from))} → ${escapeHtml(shortMode(sw.to))} at ` +
    `+${(sw.time - S.t0).toFixed(2)} s`;
  if (sw.serving !== undefined) text += `<br>The new mode served after ${fmtS(sw.serving - sw.time)}` +
    (sw.drain ? " (the running replies finished first)" : " (the workers took their roles at once)");
  if (o) {
    text += `<br>${o.moved} repl${o.moved === 1 ? "y" : "ies"} moved (${fmtBytes(o.bytes)} of KV, slowest ` +
      `${fmtS(o.slowest_move_seconds)})` + (o.not_moved ? `, ${o.not_moved} did not` : "") + `; done after ${fmtS(o.seconds)}`;
  }
  return text;
}

// Text on a white backing, so that it reads over ticks and steps.
function label(ctx, text, x, y, color) {
  const w = ctx.measureText(text).width;
  ctx.fillStyle = "rgba(255,255,255,.85)";
  ctx.fillRect(x - 2, y - 7, w + 4, 14);
  ctx.fillStyle = color;
  ctx.fillText(text, x, y);
}

function roleText(role) {
  return { both: "reads + writes", prefill: "reads prompts", decode: "writes replies", idle: "idle" }[role] || role;
}

function drawStreamLane(ctx, st, y, X, t0) {
  const mid = y + L.lane / 2;
  const font = getComputedStyle(document.body).fontFamily;
  ctx.fillStyle = st.color;
  ctx.beginPath();
  ctx.arc(12, mid, 4, 0, 2 * Math.PI);
  ctx.fill();
  ctx.fillStyle = "#1d2330";
  ctx.font = "600 12px " + font;
  ctx.fillText(st.name, 22, mid);
  ctx.font = "12px " + font;
  const moves = movesOf(st);
  if (st.worker !== null || moves.length) {
    const path = movedPath(st, moves);
    ctx.fillStyle = moves.length ? MOVE_COLOR : "#8a94a3";
    if (path && (st.kind === "reply" || moves.length)) ctx.fillText(path, 22 + ctx.measureText(st.name).width + 12, mid);
  }
  const end = st.done ? st.finished : now();
  // the request's life: sent -> done
  ctx.fillStyle = "#e9edf2";
  ctx.fillRect(X(st.sent), mid - 1, Math.max(1, X(end) - X(st.sent)), 2);
  ctx.fillStyle = "#8a94a3";
  ctx.fillRect(X(st.sent) - 1, mid - 5, 2, 10);
  // its prompt being read, once the server says so
  const tl = st.timeline;
  const req = (st.id && S.requests.get(st.id)) || {};
  const ps = (tl && tl.events.prefill_start) || req.prefill_start;
  const pe = (tl && tl.events.prefill_end) || req.prefill_end || (ps && !st.ticks.length ? now() : null);
  if (ps && pe) {
    const x0 = X(ps);
    const x1 = Math.max(x0 + 1, X(pe));
    ctx.fillStyle = st.kind === "long" ? "rgba(240,160,48,.45)" : "rgba(240,160,48,.3)";
    ctx.fillRect(x0, y + 3, x1 - x0, L.lane - 6);
    if (st.kind === "long" && x1 - x0 > 90) {
      ctx.fillStyle = "#7a4a00";
      const tokens = st.usage ? `${fmtInt(st.usage.prompt_tokens)} tokens ` : "";
      ctx.fillText(`prompt read: ${tokens}${fmtS(pe - ps)}`, x0 + 5, mid);
    }
    if (st.kind === "long") {
      S.hits.push({ x0, x1, y0: y, y1: y + L.lane, prio: 0, tip: () => `<b>${st.name}</b>: its prompt` +
        (st.usage ? ` (${fmtInt(st.usage.prompt_tokens)} tokens)` : "") + ` was read on worker ${req.prefillWorker ?? "?"} ` +
        `from +${(ps - t0).toFixed(2)} s to +${(pe - t0).toFixed(2)} s: ${fmtS(pe - ps)}` });
    }
  }
  // a gap that is growing right now
  if (!st.done && st.kind === "reply" && st.median && st.ticks.length > 4) {
    const last = st.ticks[st.ticks.length - 1];
    const g = now() - last;
    if (g > STALL_RATIO * st.median && g >= STALL_MIN_S) {
      ctx.fillStyle = "rgba(217,58,58,.12)";
      ctx.fillRect(X(last), y + 2, X(now()) - X(last), L.lane - 4);
    }
  }
  for (const s of st.stalls || []) {
    ctx.fillStyle = "rgba(217,58,58,.18)";
    ctx.fillRect(X(s.a), y + 2, X(s.b) - X(s.a), L.lane - 4);
  }
  for (const m of moves) { // where its KV went: a diamond on the reply's lane when it moved
    const x = X(m.end ?? m.start);
    const ok = m.outcome === undefined || m.outcome === "moved";
    ctx.fillStyle = ok ? MOVE_COLOR : "#8a94a3";
    ctx.beginPath();
    ctx.moveTo(x, mid - 6);
    ctx.lineTo(x + 5, mid);
    ctx.lineTo(x, mid + 6);
    ctx.lineTo(x - 5, mid);
    ctx.closePath();
    ctx.fill();
    S.hits.push({ x0: x - 6, x1: x + 6, y0: y, y1: y + L.lane, prio: 5, tip: () => moveTip(m, st.name) });
  }
  const late = new Set((st.stalls || []).map((s) => s.i));
  st.ticks.forEach((t, i) => {
    const x = Math.round(X(t));
    const bad = late.has(i);
    ctx.fillStyle = bad ? "#d93a3a" : st.color;
    ctx.fillRect(x - (bad ? 1 : 0.5), y + (bad ? 2 : 5), bad ? 3 : 1.5, L.lane - (bad ? 4 : 10));
    const stall = bad ? st.stalls.find((s) => s.i === i) : null;
    S.hits.push({ x0: x - 3, x1: x + 3, y0: y, y1: y + L.lane, prio: bad ? 4 : 3, stall,
      tip: () => (stall ? stallTip(stall) : tickTip(st, i)) });
  });
}

// A reply's moves: what the event feed said, or its timeline's records once it is done.
function movesOf(st) {
  if (!st.id) return [];
  const seen = S.moves.filter((m) => m.rid === st.id);
  if (seen.length || !st.timeline || !st.timeline.moves) return seen;
  return st.timeline.moves.map((m) => ({ ...m, rid: m.request_id, from: m.source, to: m.target }));
}

// "w0→1" for a reply that moved from worker 0 to worker 1, "w1" for one that stayed.
function movedPath(st, moves) {
  const hops = moves.filter((m) => m.outcome === undefined || m.outcome === "moved");
  if (!hops.length) return st.worker !== null && st.worker !== undefined ? `w${st.worker}` : "";
  return "w" + [hops[0].from, ...hops.map((m) => m.to)].join("→");
}

function arrow(ctx, xa, ya, xb, yb, color, dash = null) {
  ctx.strokeStyle = color;
  ctx.fillStyle = color;
  ctx.lineWidth = 1.5;
  if (dash) ctx.setLineDash(dash);
  ctx.beginPath();
  ctx.moveTo(xa, ya);
  ctx.lineTo(xb, yb);
  ctx.stroke();
  ctx.setLineDash([]);
  const a = Math.atan2(yb - ya, xb - xa);
  ctx.beginPath();
  ctx.moveTo(xb, yb);
  ctx.lineTo(xb - 7 * Math.cos(a - 0.4), yb - 7 * Math.sin(a - 0.4));
  ctx.lineTo(xb - 7 * Math.cos(a + 0.4), yb - 7 * Math.sin(a + 0.4));
  ctx.closePath();
  ctx.fill();
  ctx.lineWidth = 1;
}

function stallTip(s) {
  const e = explain(s);
  return `<b>${s.st.name}, token ${s.i + 1}: late</b><br>It came ${fmtS(s.gap)} after the one before, ` +
    `${s.ratio.toFixed(0)}× this reply's median gap of ${fmtS(s.st.median)}.<br>It waited ${escapeHtml(e.text)}.`;
}

function tickTip(st, i) {
  const t = st.ticks[i];
  const gap = i ? `, ${fmtS(t - st.ticks[i - 1])} after the one before` : `, ${fmtS(t - st.sent)} after the request (TTFT)`;
  return `<b>${st.name}</b>, token ${i + 1} at +${(t - S.t0).toFixed(2)} s${gap}`;
}

function stepTip(s) {
  const who = s.prefillRids.length ? ` of ${escapeHtml(joinNames(s.prefillRids))}` : "";
  const read = s.prefill_tokens ? `read ${fmtInt(s.prefill_tokens)} prompt tokens${who}` : "read no prompt";
  return `<b>worker ${s.worker}, one step</b> of ${fmtS(s.end - s.time)}: ${read}, wrote the next token of ` +
    `${s.decodes} repl${s.decodes === 1 ? "y" : "ies"}`;
}

// the i-th stall's late tick, in page coordinates (for tests and curious readers)
function stallPoint(i) {
  const s = S.stalls[i];
  if (!s) return null;
  const h = S.hits.find((h) => h.stall === s);
  if (!h) return null;
  const r = $("timeline").getBoundingClientRect();
  return { x: r.left + (h.x0 + h.x1) / 2, y: r.top + (h.y0 + h.y1) / 2 };
}

function onPointer(ev) {
  const canvas = $("timeline");
  const r = canvas.getBoundingClientRect();
  const x = ev.clientX - r.left;
  const y = ev.clientY - r.top;
  let best = null;
  for (const h of S.hits) {
    if (x >= h.x0 && x <= h.x1 && y >= h.y0 && y <= h.y1) {
      const d = Math.abs((h.x0 + h.x1) / 2 - x);
      if (!best || h.prio > best.prio || (h.prio === best.prio && d < best.d)) best = { ...h, d };
    }
  }
  const tip = $("tip");
  if (!best) {
    tip.hidden = true;
    return;
  }
  tip.innerHTML = best.tip();
  tip.hidden = false;
  const left = Math.min(x + 14, r.width - tip.offsetWidth - 4);
  tip.style.left = Math.max(0, left) + "px";
  tip.style.top = y + 16 + "px";
}

// ---- the loop -------------------------------------------------------------------------------
let lastDraw = 0;
function frame(t) {
  if (S.dirty || sceneRunning() || S.switching || t - lastDraw > 1000) {
    if (t - lastDraw > 40) {
      S.dirty = false;
      lastDraw = t;
      computeStalls();
      draw();
      for (const st of S.streams) updateCard(st);
      renderStalls(false);
      renderButtons();
    }
  }
  requestAnimationFrame(frame);
}

function init() {
  const keyInput = $("api-key");
  keyInput.value = S.key;
  keyInput.addEventListener("change", () => {
    S.key = keyInput.value.trim();
    localStorage.setItem("minipd.apiKey", S.key);
    say("");
    loadMode();
    loadWorkers();
    followEvents();
  });
  $("start").addEventListener("click", startReplies);
  $("long").addEventListener("click", dropLongPrompt);
  $("clear").addEventListener("click", () => {
    newScene();
    S.t0 = null;
    renderButtons();
  });
  for (const b of document.querySelectorAll(".mode-btn")) b.addEventListener("click", () => setMode(b.dataset.setMode));
  const canvas = $("timeline");
  canvas.addEventListener("mousemove", onPointer);
  canvas.addEventListener("mouseleave", () => ($("tip").hidden = true));
  window.addEventListener("resize", () => (S.dirty = true));
  loadMode();
  loadWorkers();
  followEvents();
  requestAnimationFrame(frame);
}

init();
