"""`python -m minipd bench` end to end: against another OpenAI-compatible server (a stand-in with
no minipd extensions) and against minipd itself (the modes side by side on the same requests)."""

import asyncio
import json
import threading

import pytest
from aiohttp import web

from minipd.bench import experiment, plan_main
from minipd.bench import main as bench_main
from minipd.bench.main import run
from minipd.bench.plan import Profile, Traffic, decode_tpot
from tests.helpers import serving


class StandInServer:
    """A plain OpenAI-compatible completions server in a thread: no /admin, no timeline."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def routes(self, app) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        self.routes(app)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        self.ready.set()
        self.loop.run_forever()

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "other-model", "object": "model"}]})

    async def completions(self, request):
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            await asyncio.sleep(0.005)
            chunk = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": f" w{i}"}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_lengths_alone_mean_the_fixed_workload():
    args = bench_main.parse_args(["--input-len", "100", "--output-len", "20"])
    assert args.workloads == "fixed" and (args.input_len, args.output_len) == (100, 20)
    assert bench_main.parse_args([]).workloads == "chat"
    assert bench_main.parse_args(["--workloads", "chat,fixed", "--input-len", "9", "--output-len", "3"]).input_len == 9
    plan = plan_main.parse_args(
        ["--input-len", "100", "--output-len", "20", "--slo-ttft-ms", "1", "--slo-tpot-ms", "1"]
    )
    assert plan.workload == "fixed"


@pytest.mark.parametrize(
    "argv,words",
    [
        (
            ["--workloads", "chat", "--input-len", "100", "--output-len", "20"],
            "--input-len and --output-len are the fixed workload's lengths; --workloads chat does not run it",
        ),
        (["--input-len", "100"], "the fixed workload needs both --input-len and --output-len"),
        (["--workloads", "fixed"], "the fixed workload needs both --input-len and --output-len"),
        (["--input-len", "0", "--output-len", "20"], "argument --input-len: must be an integer >= 1"),
        (["--workloads", "sumarize"], "unknown workload 'sumarize'; choose from chat, summarize, generate, mixed, fixed"),
    ],
)
@pytest.mark.parametrize("tool", ["bench", "plan"])
def test_lengths_that_would_be_ignored_are_one_line_errors(capsys, tool, argv, words):
    if tool == "plan":
        argv = [a.replace("--workloads", "--workload") for a in argv] + ["--slo-ttft-ms", "1", "--slo-tpot-ms", "1"]
        words = words.replace("--workloads", "--workload")
    with pytest.raises(SystemExit) as exit:
        (bench_main if tool == "bench" else plan_main).parse_args(argv)
    assert exit.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"python -m minipd {tool}: error: ") and words in error, error


def test_bench_runs_unchanged_against_another_openai_server(tmp_path):
    server = StandInServer()
    try:
        code = run(["--url", server.url, "--quick", "--num-prompts", "5", "--rates", "20", "--slo-ttft-ms", "500",
                    "--slo-tpot-ms", "100", "--out", str(tmp_path), "--no-progress"])  # fmt: skip
    finally:
        server.stop()
    assert code == 0
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["params"]["label"] for r in runs] == ["server"]  # one mode: the server's own
    summary = runs[0]["summary"]
    assert summary["completed"] == 5 and summary["slo_attainment"] == 1.0
    assert all(r["server_timeline"] is None for r in runs[0]["records"])
    assert "server" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_bench_puts_the_modes_side_by_side_on_the_same_requests(tmp_path):
    with serving("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1") as s:
        code = run(["--url", s.url, "--quick", "--num-prompts", "6", "--rates", "8", "--workloads", "chat,summarize",
                    "--modes", "colocated,chunked:16,disagg:1p1d", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "200",
                    "--out", str(tmp_path), "--no-progress"])  # fmt: skip
    assert code == 0
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    labels = [(r["params"]["workload"], r["params"]["label"]) for r in runs]
    assert labels == [(w, m) for w in ("chat", "summarize") for m in ("colocated", "chunked:16", "disagg:1p1d")]
    for w in ("chat", "summarize"):
        shapes = [[(q["prompt_len"], q["output_len_wanted"]) for q in r["records"]] for r in runs
                  if r["params"]["workload"] == w]  # fmt: skip
        assert shapes[0] == shapes[1] == shapes[2]  # the same requests through every mode
    disagg = [r for r in runs if r["params"]["label"] == "disagg:1p1d"]
    assert all(q["server_timeline"]["kv_transfer"]["bytes"] > 0 for r in disagg for q in r["records"])
    report = (tmp_path / "report.md").read_text()
    assert "Admission is not the bottleneck" in report and "slo_attainment_chat.png" in report
    notes = json.loads((tmp_path / "notes.json").read_text())
    assert notes["admission"]["seat_batches"] < notes["admission"]["burst"]


@pytest.mark.slow
def test_goodput_search_link_study_and_plan_end_to_end(tmp_path):
    with serving("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1", "--kv-transport",
                 "tcp") as s:  # fmt: skip
        code = run(["--url", s.url, "--quick", "--num-prompts", "6", "--rates", "4", "--workloads", "summarize",
                    "--modes", "colocated,disagg:1p1d", "--slo-ttft-ms", "3000", "--slo-tpot-ms", "300",
                    "--goodput-search", "--search-max-runs", "2", "--kv-link-gbps", "0.5,5", "--plan",
                    "--out", str(tmp_path), "--no-progress"])  # fmt: skip
    assert code == 0
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    links = sorted(r["params"]["link"] for r in runs if r["params"].get("link"))
    assert links == [0.5, 5.0]
    assert any(r["params"]["label"].startswith("plan: ") for r in runs)
    notes = json.loads((tmp_path / "notes.json").read_text())
    assert [len(search["probes"]) for search in notes["searches"]] == [2, 2]
    plan = notes["plan"]["plans"]["summarize"]
    profile = Profile(**{k: v for k, v in notes["plan"]["profile"].items() if k != "compute_bound_batch"})
    traffic = plan["here"]["traffic"]
    one_decoder = decode_tpot(profile, Traffic(4.0, traffic["prompt_tokens"], traffic["output_tokens"]), 1)[1]
    assert plan["rule_at_link_study_rate"]["decode_batch"] == pytest.approx(one_decoder)
    assert notes["plan"]["profile"]["prefill_fixed_s"] >= 0
    report = (tmp_path / "report.md").read_text()
    assert "nanoPD's rule at this study's 4 req/s" in report and "Plan for `summarize`" in report
    assert (tmp_path / "link_study_summarize.png").stat().st_size > 0


class StandInModes(StandInServer):
    """A stand-in with minipd's /admin/workers and /admin/mode: a token every 8 ms in colocated, every
    4 ms in chunked (so chunked's TPOT is about half)."""

    GAP = {"colocated": 0.008, "chunked": 0.004}

    def __init__(self):
        self.mode = "colocated"
        self.prompts: list[tuple[str, int]] = []  # (mode, prompt length) of each request, as received
        super().__init__()

    def routes(self, app) -> None:
        super().routes(app)
        app.router.add_get("/admin/workers", self.workers)
        app.router.add_post("/admin/mode", self.set_mode)

    async def workers(self, request):
        return web.json_response({"workers": [{"id": 0}, {"id": 1}], "kv_transport": "shm"})

    async def set_mode(self, request):
        self.mode = (await request.json())["mode"]
        return web.json_response({"mode": self.mode})

    async def completions(self, request):
        body = await request.json()
        self.prompts.append((self.mode, len(body["prompt"])))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            await asyncio.sleep(self.GAP[self.mode])
            chunk = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": f" w{i}"}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


def test_repeats_run_every_mode_on_the_same_fresh_seeds_and_report_intervals(tmp_path):
    server = StandInModes()
    try:
        code = run(["--url", server.url, "--quick", "--num-prompts", "4", "--rates", "20", "--seed", "5",
                    "--repeats", "3", "--modes", "colocated,chunked:16", "--slo-ttft-ms", "500",
                    "--slo-tpot-ms", "100", "--out", str(tmp_path), "--no-progress"])  # fmt: skip
    finally:
        server.stop()
    assert code == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    runs = doc["runs"]
    # repeat outside mode: colocated and chunked on seed 5, then both on 6, then on 7
    assert [(r["params"]["label"], r["params"]["repeat"], r["params"]["seed"]) for r in runs] == [
        (m, i, 5 + i) for i in range(3) for m in ("colocated", "chunked:16")]  # fmt: skip
    assert all(r["summary"]["completed"] == 4 for r in runs)
    shapes = [[(q["prompt_len"], q["output_len_wanted"]) for q in r["records"]] for r in runs]
    assert shapes[0] == shapes[1] and shapes[2] == shapes[3] and shapes[4] == shapes[5]  # paired: same requests
    assert len({tuple(s) for s in shapes}) == 3  # fresh requests each repeat
    assert len(server.prompts) == 24 and {m for m, _ in server.prompts} == {"colocated", "chunked"}

    assert [(g["label"], g["n"], g["seeds"]) for g in doc["repeats"]] == [
        ("colocated", 3, [5, 6, 7]), ("chunked:16", 3, [5, 6, 7])]  # fmt: skip
    for g in doc["repeats"]:
        for key in ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "median_itl_ms", "p90_itl_ms",
                    "request_throughput", "output_throughput", "goodput", "slo_attainment"):  # fmt: skip
            m = g["metrics"][key]
            assert m["n"] == 3 and m["lo"] <= m["median"] <= m["hi"], (key, m)
    (ab,) = doc["repeat_comparisons"]
    assert (ab["label"], ab["baseline"], ab["n"]) == ("chunked:16", "colocated", 3)
    tpot = ab["metrics"]["p90_tpot_ms"]
    assert tpot["lo"] <= tpot["ratio"] <= tpot["hi"] < 0.9  # 4 ms a token against 8

    md = (tmp_path / "report.md").read_text()
    assert "## Repeats: median and 95% interval" in md and "**Rough**" in md
    assert "| metric | colocated (3 runs) | chunked:16 (3 runs) |" in md
    row = next(line for line in md.splitlines() if line.startswith("| TPOT p90 (ms) |"))
    assert row.count("[") == 2  # median [lo, hi] for both modes
    assert "- `chunked:16` (3 paired runs, rough): goodput " in md
    assert "TPOT p90 0." in md and "x colocated, 95% CI" in md
    assert "| chunked:16 (repeat 3, seed 7) |" in md
    assert {"slo_attainment.png", "latency_p90.png"} <= {p.name for p in tmp_path.glob("*.png")}


def test_repeats_must_be_positive_and_not_with_switch_at(capsys):
    assert bench_main.parse_args([]).repeats == 1
    for argv, words in ((["--repeats", "0"], "--repeats must be >= 1"),
                        (["--repeats", "2", "--switch-at", "1:disagg"], "does not go with --repeats")):  # fmt: skip
        with pytest.raises(SystemExit):
            bench_main.parse_args(argv)
        assert words in capsys.readouterr().err


def test_a_url_where_nothing_answers_is_a_one_line_error(capsys, tmp_path):
    """Defect: `bench --url` pointing at nothing ended in a urllib traceback."""
    assert run(["--url", "http://127.0.0.1:9", "--num-prompts", "2", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "cannot reach a server at http://127.0.0.1:9" in err and err.count("\n") == 1, err
    assert not (tmp_path / "b").exists()


def test_a_server_that_goes_away_mid_bench_leaves_what_was_measured(tmp_path, capsys, monkeypatch):
    """Defect: the server stopping between two runs (its process killed, the machine rebooted) ended the
    bench in a urllib traceback, and the runs already measured (minutes each) were not written."""
    server = StandInModes()  # minipd's /admin/workers and /admin/mode, so that the bench switches modes
    real = experiment.run_once
    calls = []

    def run_once(*args, **kwargs):
        calls.append(args[2])
        if len(calls) == 2:
            server.stop()  # gone before the second mode is switched to
        return real(*args, **kwargs)

    monkeypatch.setattr("minipd.bench.experiment.run_once", run_once)
    out = tmp_path / "b"
    rc = run(["--url", server.url, "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
              "--modes", "colocated,chunked", "--no-progress", "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert calls == ["colocated", "chunked"]
    assert rc == 1 and "Traceback" not in err, err
    assert f"the server at {server.url} stopped answering" in err and "writing what was measured" in err, err
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["params"]["label"] for r in runs] == ["colocated"] and runs[0]["summary"]["completed"] == 3
    assert (out / "report.md").exists()


@pytest.mark.slow
def test_bench_leaves_a_server_of_the_users_own_in_the_mode_it_found(tmp_path):
    """Defect (a new-user pass): `bench --url` left the server in the last mode it ran (disagg), with the
    chunk_tokens of a chunked:64 run before it carried into disagg."""
    from tests.helpers import serving

    start = {"mode": "disagg", "prefill_workers": 1, "decode_workers": 1, "chunk_tokens": 128}
    with serving("--model", "tiny-random", "--threads-per-worker", "1", "--workers", "2") as s:
        assert s.post("/admin/mode", start)[0] == 200
        before = s.get("/admin/mode")[1]
        rc = run(["--url", s.url, "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--rates", "20",
                  "--modes", "chunked:64,colocated", "--out", str(tmp_path), "--no-progress"])  # fmt: skip
        after = s.get("/admin/mode")[1]
    assert rc == 0 and {k: v for k, v in after.items() if k != "last_switch"} == {
        k: v for k, v in before.items() if k != "last_switch"} == start, (before, after)  # fmt: skip


def test_the_mode_to_restore_spells_out_every_setting():
    class Found:
        def __init__(self, report):
            self.report = report

        def get(self, path):
            return 200, self.report

    assert experiment.mode_to_restore(Found({"mode": "disagg", "prefill_workers": 1, "decode_workers": 1})) == {
        "mode": "disagg", "prefill_workers": 1, "decode_workers": 1, "chunk_tokens": 512, "local_prefill_tokens": 0,
        "kv_link_gbps": None, "kv_link_latency_ms": 0}  # fmt: skip
    assert experiment.mode_to_restore(Found({"mode": "chunked", "chunk_tokens": 64, "last_switch": {}})) == {
        "mode": "chunked", "chunk_tokens": 64, "workers": None, "kv_link_gbps": None, "kv_link_latency_ms": 0}
    assert experiment.mode_to_restore(Found({"mode": "colocated", "auto": True})) == {"mode": "auto"}
    assert experiment.mode_to_restore(Found({"error": "x"})) is None
