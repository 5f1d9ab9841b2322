"""`bench --workloads phases` and `--modes ...,auto`: the workload's phases, the auto mode's parsing,
the per-phase report and auto's comparison with the fixed modes from synthetic records (no
server), and end to end against minipd in --mode auto on the tiny model (slow)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from minipd.bench import main as bench_main
from minipd.bench import phases as ph
from minipd.bench.experiment import parse_mode, parse_modes
from minipd.bench.metrics import RequestRecord
from minipd.bench.report import load_results, write_report_md, write_results
from minipd.bench.workloads import LENGTHS, PHASES, WORKLOADS, make_workload, parse_phases, phase_spans
from tests.helpers import serving

# ---- the workload --------------------------------------------------------------------------------


def by_phase(reqs):
    return [[r for r in reqs if r.phase == k] for k in range(3)]


@pytest.mark.parametrize("quick", [False, True])
def test_phases_are_chat_then_long_documents_then_chat(quick):
    reqs = make_workload("phases", duration=300.0, rate=2.0, seed=5, quick=quick)
    assert "phases" in WORKLOADS and PHASES == ("chat", "summarize", "chat")
    assert [r.index for r in reqs] == list(range(len(reqs)))
    assert [r.phase for r in reqs] == sorted(r.phase for r in reqs)  # in order: 0s, then 1s, then 2s
    arrivals = [r.arrival for r in reqs]
    assert arrivals == sorted(arrivals)
    spans = phase_spans(reqs, 300.0, 2.0)
    assert spans == [(0.0, 100.0), (100.0, 200.0), (200.0, 300.0)]
    for mine, (lo, hi), kind in zip(by_phase(reqs), spans, PHASES):
        assert mine and mine[0].arrival == lo and all(lo <= r.arrival < hi for r in mine)
        assert len(mine) / (hi - lo) == pytest.approx(2.0, rel=0.3)  # its own arrivals at the run's rate
        prompt, output = LENGTHS[(kind, quick)]
        p, o = np.array([r.prompt_len for r in mine]), np.array([r.output_len for r in mine])
        assert p.min() >= prompt.lo and p.max() <= prompt.hi and o.min() >= output.lo and o.max() <= output.hi
        assert np.median(p) == pytest.approx(prompt.median, rel=0.35)
    chat1, docs, chat2 = by_phase(reqs)
    # long documents: prompts several times longer, replies shorter than the chat phases'
    mean = lambda rs, f: np.mean([getattr(r, f) for r in rs])  # noqa: E731
    assert mean(docs, "prompt_len") > 5 * max(mean(chat1, "prompt_len"), mean(chat2, "prompt_len"))
    assert mean(docs, "output_len") < min(mean(chat1, "output_len"), mean(chat2, "output_len"))
    assert [(r.prompt_len, r.arrival) for r in chat1] != [(r.prompt_len, r.arrival - 200) for r in chat2[: len(chat1)]]


@pytest.mark.parametrize("quick", [False, True])
def test_other_phases_by_name_and_the_generate_workload(quick):
    kinds = parse_phases("chat,generate,chat,summarize")
    reqs = make_workload("phases", duration=400.0, rate=2.0, seed=3, quick=quick, phases=kinds)
    spans = phase_spans(reqs, 400.0, 2.0, len(kinds))
    assert spans == [(0.0, 100.0), (100.0, 200.0), (200.0, 300.0), (300.0, 400.0)]
    groups = [[r for r in reqs if r.phase == k] for k in range(4)]
    for mine, (lo, hi), kind in zip(groups, spans, kinds):
        assert mine and all(lo <= r.arrival < hi for r in mine)
        prompt, output = LENGTHS[(kind, quick)]
        o = np.array([r.output_len for r in mine])
        assert o.min() >= output.lo and o.max() <= output.hi and np.median(o) == pytest.approx(output.median, rel=0.35)
    chat, gen = groups[0], groups[1]
    mean = lambda rs, f: np.mean([getattr(r, f) for r in rs])  # noqa: E731
    # generate: short prompts, long replies (decode-heavy), unlike chat and summarize
    assert mean(gen, "output_len") > 2 * mean(chat, "output_len") and mean(gen, "prompt_len") < mean(chat, "prompt_len")
    alone = make_workload("generate", num_prompts=200, rate=2.0, seed=3, quick=quick)
    assert np.median([r.output_len for r in alone]) == pytest.approx(LENGTHS[("generate", quick)][1].median, rel=0.2)
    assert make_workload("phases", duration=60.0, rate=2.0, seed=3) == make_workload(
        "phases", duration=60.0, rate=2.0, seed=3, phases=parse_phases(None))  # the default: chat, summarize, chat


@pytest.mark.parametrize("text,words", [("chat,banter", "unknown phase 'banter'"), ("chat", "at least two phases")])
def test_bad_phases_are_refused(text, words):
    with pytest.raises(ValueError, match=words):
        parse_phases(text)
    with pytest.raises(SystemExit):
        bench_main.parse_args(["--workloads", "phases", "--phases", text])


def test_phases_are_deterministic_for_a_seed():
    a = make_workload("phases", duration=30.0, rate=3.0, seed=7, quick=True)
    assert a == make_workload("phases", duration=30.0, rate=3.0, seed=7, quick=True)
    assert a != make_workload("phases", duration=30.0, rate=3.0, seed=8, quick=True)
    # the other workloads are unchanged: one phase, index 0
    assert {r.phase for r in make_workload("mixed", num_prompts=50, rate=3, seed=7)} == {0}


def test_phases_by_count_and_model_length():
    reqs = make_workload("phases", num_prompts=10, rate=4.0, seed=1)
    assert [len(p) for p in by_phase(reqs)] == [4, 3, 3]
    spans = phase_spans(reqs, None, 4.0)
    assert spans[0][0] == 0.0 and spans[0][1] == by_phase(reqs)[1][0].arrival == spans[1][0]
    assert spans[2][1] == pytest.approx(reqs[-1].arrival + 0.25)
    assert [r.arrival for r in reqs] == sorted(r.arrival for r in reqs)
    # both bounds: the first num_prompts of the timed phases
    assert len(make_workload("phases", num_prompts=5, duration=60.0, rate=4.0, seed=1)) == 5
    assert all(r.prompt_len + r.output_len <= 1024
               for r in make_workload("phases", duration=30, rate=2, max_model_len=1024))  # fmt: skip


# ---- auto among the modes ---------------------------------------------------------------------------


def test_parse_mode_auto():
    assert parse_mode("auto") == ("auto", {"mode": "auto"})
    assert parse_modes("colocated,chunked:256,disagg:1p1d,auto")[-1] == ("auto", {"mode": "auto"})
    with pytest.raises(ValueError, match="auto takes no options"):
        parse_mode("auto:5")
    with pytest.raises(ValueError, match="or auto"):
        parse_mode("fast")
    args = bench_main.parse_args(["--workloads", "phases", "--duration", "120", "--modes",
                                  "colocated,chunked:256,disagg:1p1d,auto"])  # fmt: skip
    assert args.workloads == "phases" and args.modes.endswith(",auto")


# ---- the per-phase report from synthetic records ------------------------------------------------------

SPANS = [(0.0, 10.0), (10.0, 20.0), (20.0, 30.0)]
T0 = 1000.0


def synthetic_run(label: str, ttfts: list[list[float]], body: dict | None = None, advisor: dict | None = None) -> dict:
    """Per phase, requests with these TTFTs (seconds), 5 tokens 20 ms apart, the end 80 ms after the first (TPOT 20 ms)."""
    records, phases, i = [], [], 0
    for k, phase in enumerate(ttfts):
        for j, ttft in enumerate(phase):
            send = T0 + SPANS[k][0] + j
            records.append(RequestRecord(i, 100, 5, send, [send + ttft + 0.02 * n for n in range(5)], 5,
                                         end_time=send + ttft + 0.08))  # fmt: skip
            phases.append(k)
            i += 1
    run = {"workload": "phases", "mode": (body or {}).get("mode", label), "label": label,
           "mode_body": body or {"mode": label}, "rate": 0.5, "seed": 0, "duration": 30.0, "slo_ttft_ms": 1000,
           "slo_tpot_ms": 50, "records": records, "request_phases": phases, "phase_names": list(PHASES),
           "phase_spans": SPANS, "load_start": T0}  # fmt: skip
    if advisor is not None:
        run["advisor"] = advisor
    run["phases"] = ph.phase_rows(run)
    return run


def synthetic_group():
    # colocated meets the SLOs in the chat phases, disagg in the long-document phase; auto in between
    colocated = synthetic_run("colocated", [[0.1] * 5, [2.0] * 4 + [0.1], [0.1] * 5])
    disagg = synthetic_run("disagg:1p1d", [[2.0] * 3 + [0.1] * 2, [0.2] * 5, [2.0] * 4 + [0.1]])
    advisor = {
        "window_s": 5.0,
        "decisions": [{"time": T0 + 5, "predict_cpu_seconds": 0.25}, {"time": T0 + 12, "predict_cpu_seconds": 0.5},
                      {"time": T0 + 24}],
        "switches": 2,
        "switch_log": [{"at_s": 12.0, "to": "disagg:1p1d"}, {"at_s": 24.0, "to": "colocated"}],
    }
    auto = synthetic_run("auto", [[0.1] * 5, [2.0] * 2 + [0.3] * 3, [0.1] * 4 + [2.0]], {"mode": "auto"}, advisor)
    return [colocated, disagg, auto]


def test_phase_rows_count_requests_by_their_phase():
    colocated, disagg, auto = synthetic_group()
    rows = colocated["phases"]
    assert [r["phase"] for r in rows] == [0, 1, 2, "overall"]
    assert [r["name"] for r in rows] == ["chat", "summarize", "chat", "overall"]
    assert [r["requests"] for r in rows] == [5, 5, 5, 15]
    assert [r["within_slo"] for r in rows] == [5, 1, 5, 11]
    assert [r["goodput"] for r in rows] == pytest.approx([0.5, 0.1, 0.5, 11 / 30])
    assert [r["slo_attainment"] for r in rows] == pytest.approx([1.0, 0.2, 1.0, 11 / 15])
    assert rows[0]["median_ttft_ms"] == pytest.approx(100) and rows[1]["p90_ttft_ms"] == pytest.approx(2000)
    assert rows[0]["median_tpot_ms"] == pytest.approx(20) and rows[3]["p90_tpot_ms"] == pytest.approx(20)
    assert "modes_in_force" not in rows[0]
    assert [r["modes_in_force"] for r in auto["phases"]] == [
        ["colocated"],
        ["colocated", "disagg:1p1d"],
        ["disagg:1p1d", "colocated"],
        ["colocated", "disagg:1p1d", "colocated"],
    ]


def test_auto_against_the_best_fixed_mode_per_phase_and_overall():
    group = synthetic_group()
    (c,) = ph.attach_comparisons(group)
    assert group[2]["phase_comparison"] is c and "phase_comparison" not in group[0]
    assert c["auto"] == "auto" and c["fixed"] == ["colocated", "disagg:1p1d"]
    assert [p["best_fixed"] for p in c["phases"]] == ["colocated", "disagg:1p1d", "colocated"]
    assert [p["auto_goodput"] for p in c["phases"]] == pytest.approx([0.5, 0.3, 0.4])
    assert [p["ratio"] for p in c["phases"]] == pytest.approx([1.0, 0.6, 0.8])
    o = c["overall"]
    assert o["auto_goodput"] == pytest.approx(12 / 30)
    assert [(v["mode"], v["ratio"]) for v in o["versus"]] == [("colocated", pytest.approx(12 / 11)),
                                                              ("disagg:1p1d", pytest.approx(12 / 8))]  # fmt: skip
    assert o["best_fixed_per_phase_goodput"] == pytest.approx(15 / 30)
    assert o["ratio_to_best_fixed_per_phase"] == pytest.approx(0.8)
    assert c["advisor"] == {"decisions": 3, "switches": 2, "error": None, "cpu_seconds": 0.75, "span_s": 30.0}
    text = ph.table(group)
    print(text)
    assert "| 2 summarize (10-20 s) | auto (colocated -> disagg:1p1d) | 5 (5 / 0) |" in text
    assert "| overall (0-30 s) | colocated | 15 (15 / 0) | 100 / 2000 | 20.0 / 20.0 | 0.37 | 73% |" in text
    assert "best fixed mode, disagg:1p1d, 0.50 req/s: **0.60x**" in text
    assert "- overall: auto 0.40 req/s: 1.09x colocated (0.37), 1.50x disagg:1p1d (0.27); 0.80x the best" in text
    assert ("2 switch(es): 12.0 s to disagg:1p1d (phase 2), 24.0 s to colocated (phase 3); its predictions took "
            "0.8 s of CPU in the main process (2.5% of one core over the run)") in text


def test_ratio_edges_and_no_slos():
    assert ph.ratio(1.0, 0.0) == float("inf") and ph.ratio(0.0, 0.0) is None and ph.ratio(None, 1.0) is None
    group = synthetic_group()
    for run in group:
        run["slo_ttft_ms"] = run["slo_tpot_ms"] = None
        run["phases"] = ph.phase_rows(run)
    (c,) = ph.attach_comparisons(group)
    assert c["phases"][0]["best_fixed"] is None and c["overall"]["auto_goodput"] is None
    assert "give --slo-ttft-ms and --slo-tpot-ms" in ph.table(group)


def test_results_json_and_report_carry_phases(tmp_path):
    group = synthetic_group()
    ph.attach_comparisons(group)
    write_results(tmp_path, group)
    doc = json.loads((tmp_path / "results.json").read_text())
    saved = doc["runs"]
    assert [r["records"][7]["phase"] for r in saved] == [1, 1, 1]
    assert all([d["phase"] for d in r["records"]] == [0] * 5 + [1] * 5 + [2] * 5 for r in saved)
    assert [len(r["phases"]) for r in saved] == [4, 4, 4] and "request_phases" not in saved[0]["params"]
    assert saved[2]["phase_comparison"]["phases"][1]["ratio"] == pytest.approx(0.6)
    assert saved[2]["advisor"]["switches"] == 2 and "phase_comparison" not in saved[0]
    back = load_results(tmp_path / "results.json")
    assert back[0]["request_phases"] == group[0]["request_phases"]
    assert back[0]["records"] == group[0]["records"] and back[2]["phase_comparison"] == saved[2]["phase_comparison"]
    from minipd.bench import report
    from minipd.bench.main import _extra_sections

    extra = _extra_sections(None, back, [], [], {}, report)
    md = write_report_md(tmp_path, back, "t", "python -m minipd bench --workloads phases", extra).read_text()
    assert "## Phases: auto against the fixed modes" in md and "| 1 chat (0-10 s) | auto (colocated) |" in md


def repeated_groups():
    """Three repeats of synthetic_group: auto's phase-2 goodput 0.3, 0.5 and 0.4 req/s; disagg's 0.5 each time."""
    runs = []
    for i, auto_good in enumerate((3, 5, 4)):
        group = synthetic_group()
        auto_ttfts = [[0.1] * 5, [0.1] * auto_good + [2.0] * (5 - auto_good), [0.1] * 4 + [2.0]]
        group[2] = synthetic_run("auto", auto_ttfts, {"mode": "auto"}, group[2]["advisor"])
        for run in group:
            run["repeat"], run["seed"] = i, i
        runs += group
    return runs


def test_repeated_phases_compare_auto_with_the_best_fixed_mode_by_median_with_intervals():
    runs = repeated_groups()
    (c,) = ph.repeat_comparison(runs)
    assert c["n"] == 3 and c["modes"] == ["colocated", "disagg:1p1d", "auto"]
    p2 = c["phases"][1]
    assert p2["name"] == "summarize" and p2["goodput"]["auto"]["values"] == pytest.approx([0.3, 0.5, 0.4])
    assert p2["goodput"]["auto"]["median"] == pytest.approx(0.4)
    assert p2["best_fixed"] == "disagg:1p1d"
    assert p2["ratio"]["ratio"] == pytest.approx(0.8)
    assert p2["ratio"]["lo"] == pytest.approx(0.6) and p2["ratio"]["hi"] == pytest.approx(1.0)
    assert [p["best_fixed"] for p in c["phases"]] == ["colocated", "disagg:1p1d", "colocated"]
    assert c["phases"][0]["ratio"]["ratio"] == pytest.approx(1.0)
    overall = c["overall"]
    assert overall["best_fixed"] == "colocated" and overall["goodput"]["auto"]["median"] == pytest.approx(13 / 30)
    assert [(v["mode"], v["ratio"]) for v in overall["versus"]] == [("colocated", pytest.approx(13 / 11)),
                                                                    ("disagg:1p1d", pytest.approx(13 / 8))]  # fmt: skip
    text = ph.repeat_table(c)
    print(text)
    assert "| 2 summarize | 0.10 [0.10, 0.10] | 0.50 [0.50, 0.50] | 0.40 [0.30, 0.50] | 0.80x disagg:1p1d [0.60x, 1.00x] |" in text
    assert "1.18x colocated [1.09x, 1.27x]" in text and "1.62x disagg:1p1d [1.50x, 1.75x]" in text
    from minipd.bench import report

    assert text in report.phase_tables_by_repeat(runs)
    assert ph.repeat_comparison([r for r in runs if r["repeat"] == 0]) == []  # one run each: no intervals to give


# ---- end to end on minipd ---------------------------------------------------------------------------


@pytest.mark.slow
def test_phases_auto_against_colocated_end_to_end(tmp_path, capsys):
    with serving("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1", "--mode", "auto",
                 "--advisor-window", "2", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100") as s:  # fmt: skip
        code = run_bench(s.url, tmp_path)
        last = s.get("/admin/mode")[1]
    assert code == 0
    err = capsys.readouterr().err
    print(err[err.index("### `phases`") :])  # the printed per-phase table
    saved = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["params"]["label"] for r in saved] == ["colocated", "auto"]
    for r in saved:
        assert [row["phase"] for row in r["phases"]] == [0, 1, 2, "overall"]
        assert all(row["requests"] > 0 for row in r["phases"]), r["phases"]
        assert r["summary"]["failed"] == 0
        assert {d["phase"] for d in r["records"]} == {0, 1, 2}
    colocated, auto = saved
    assert [d["prompt_len"] for d in colocated["records"]] == [d["prompt_len"] for d in auto["records"]]
    assert "advisor" not in colocated and auto["advisor"]["decisions"], auto["advisor"]
    assert auto["advisor"]["window_s"] == 2.0 and auto["advisor"]["enabled"] is True
    c = auto["phase_comparison"]
    assert c["fixed"] == ["colocated"] and len(c["phases"]) == 3 and c["overall"]["versus"][0]["mode"] == "colocated"
    assert last.get("auto") is True  # the auto run left the advisor on
    assert "## Phases: auto against the fixed modes" in (tmp_path / "report.md").read_text()


def run_bench(url, out) -> int:
    return bench_main.run(["--url", url, "--workloads", "phases", "--quick", "--duration", "9", "--rates", "4",
                           "--modes", "colocated,auto", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100",
                           "--out", str(out), "--no-progress"])  # fmt: skip
