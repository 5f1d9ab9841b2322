"""python -m minipd bench: the same traffic through colocated, chunked and disaggregated serving on
the same workers, side by side: TTFT, TPOT, ITL, throughput, goodput under SLOs, DistServe's
goodput (a rate search), the KV-link study and the P:D planner; with `--workloads phases` and
`auto` among the modes, the server's advisor against every fixed mode, per phase of the traffic.

It starts `minipd serve` itself (or measures a running server with --url: against another
OpenAI-compatible server it runs the one mode that server has, with client-side numbers only).
Timings are taken where the client receives tokens; minipd's timelines are added when present.

    python -m minipd bench --quick --workloads chat,summarize --rates 0.2,0.4 --out bench-out
    python -m minipd bench --quick --rates 2 --duration 20 --switch-at 5:disagg:1p1d,12:colocated  # live switches
    python -m minipd bench --quick --workloads phases --duration 60 --rates 1 --modes colocated,disagg:1p1d,auto \
        --slo-ttft-ms 2000 --slo-tpot-ms 100 --advisor-window 5  # auto against fixed modes, per phase
"""

from __future__ import annotations

import argparse
import sys

from minipd.cli_help import (
    DefaultsFormatter,
    listed,
    make_writable_folder,
    nonnegative_int,
    positive_float,
    positive_int,
    server_url,
)


def add_traffic_args(g) -> None:
    """The requests of a run: bench's, and the simulator's, which plays the same ones."""
    g.add_argument(
        "--workloads",
        default=None,
        help="comma-separated: chat, summarize, generate, mixed, fixed, phases (chat, then summarize, then chat: "
        "a third of the run each, or --phases; reported per phase) (default: chat; fixed when --input-len and "
        "--output-len are given)",
    )
    g.add_argument("--phases", default="chat,summarize,chat",
                   help="the phases workload's phases, in order, each an equal share of the run: chat, summarize "
                        "(long prompts, short replies) or generate (short prompts, long replies)")
    g.add_argument("--input-len", type=positive_int, default=None, help="the fixed workload's prompt tokens")
    g.add_argument("--output-len", type=positive_int, default=None, help="the fixed workload's reply tokens")
    g.add_argument("--quick", action="store_true", help="lengths that fit a 2-core CPU (see minipd/bench/workloads.py)")
    g.add_argument("--rates", default="0.5", type=listed(positive_float, inf=True), help="comma-separated request rates (req/s) to sweep; inf = all at once")
    g.add_argument("--burstiness", type=positive_float, default=1.0, help="gamma arrivals' shape; 1 = Poisson")
    g.add_argument("--num-prompts", type=positive_int, default=None, help="requests per run (default 20 unless --duration)")
    g.add_argument("--duration", type=positive_float, default=None, help="seconds of arrivals per run")
    g.add_argument("--seed", type=nonnegative_int, default=0, help="the same seed gives the same requests")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m minipd bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=DefaultsFormatter)  # fmt: skip
    g = ap.add_argument_group("target")
    g.add_argument("--url", type=server_url, default=None, help="a running OpenAI-compatible server (default: start minipd)")
    g.add_argument("--api-key", default=None, help="its API key, if it needs one")
    g.add_argument("--model", default=None, help="model for the server this starts (default: SmolLM2-135M-Instruct)")
    g.add_argument("--workers", type=positive_int, default=2, help="workers of the server this starts")
    g.add_argument("--threads-per-worker", type=positive_int, default=1, help="torch threads per worker")
    g.add_argument("--kv-transport", default=None, choices=["shm", "tcp"],
                   help="for the server this starts (default: shm; tcp with --kv-link-gbps)")
    g.add_argument("--advisor-window", type=positive_float, default=None,
                   help="for the server this starts: seconds between the advisor's decisions in mode auto "
                   "(default: the server's, 30); it is also given --slo-ttft-ms/--slo-tpot-ms")  # fmt: skip
    g = ap.add_argument_group("traffic")
    add_traffic_args(g)
    g.add_argument("--max-concurrency", type=positive_int, default=None, help="requests in flight at most (default: no limit)")
    g.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run each point (workload x rate x mode) N times with seeds seed..seed+N-1 (other requests "
                   "and arrivals each time, the same N for every mode) and report each metric's median with a 95%% "
                   "bootstrap interval, and each mode against colocated as paired ratios")  # fmt: skip
    g = ap.add_argument_group("experiments")
    g.add_argument(
        "--modes",
        default=None,
        help="minipd modes, run on the same requests: colocated, chunked[:TOKENS], disagg[:PpDd[:localN]] (localN: "
        "prompts under N tokens are prefilled by their decode worker), auto (the server's advisor switches live, "
        "starting colocated; its decisions are kept with the run) "
        "(default: colocated,chunked:64,disagg:1p1d; with --switch-at: the one mode the run starts in, "
        "default colocated)",
    )
    g.add_argument(
        "--switch-at",
        default=None,
        metavar="T:MODE[,T:MODE...]",
        help="one run (one workload, one rate) during which the server's mode is switched live at T "
        "seconds after the first request, e.g. 1:disagg:1p1d,2:colocated (MODE as in --modes); the report "
        "shows each interval between switches and what each switch cost the replies streaming through it",
    )
    g.add_argument(
        "--switch-drain",
        action="store_true",
        help="with --switch-at: each switch lets the running requests finish first (drain) instead of moving them",
    )
    g.add_argument("--slo-ttft-ms", type=positive_float, default=None, help="SLO on time to first token")
    g.add_argument("--slo-tpot-ms", type=positive_float, default=None, help="SLO on time per output token")
    g.add_argument("--goodput-search", action="store_true",
                   help="DistServe's goodput: search the highest rate with >= 90%% of requests in both SLOs")
    g.add_argument("--search-max-runs", type=positive_int, default=6, help="probes per goodput search")
    g.add_argument("--kv-link-gbps", default=None, type=listed(positive_float),
                   help="link study: comma-separated emulated KV link rates (Gb/s) for disagg over tcp")
    g.add_argument("--plan", action="store_true", help="profile the workers, plan P:D, and run the recommended split")
    g.add_argument("--plan-rate", type=positive_float, default=None, help="the rate the plan is for (default: the highest of --rates)")
    g.add_argument("--validate-sim", action="store_true",
                   help="then profile the same workers (loads of its own) and run the same requests in the simulator "
                   "(python -m minipd sim): the error per mode and metric, and where the time goes")  # fmt: skip
    g.add_argument("--out", default="bench-out", help="folder for results.json, report.md and the plots")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    from minipd.bench.workloads import parse_phases, workload_names

    try:
        args.workloads = ",".join(workload_names(args.workloads, args.input_len, args.output_len, "--workloads"))
        args.phases = parse_phases(args.phases)
    except ValueError as err:
        ap.error(str(err))
    if args.num_prompts is None and args.duration is None:
        args.num_prompts = 20
    from minipd.bench.experiment import parse_modes
    from minipd.bench.switching import parse_switch_at

    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1 (got {args.repeats})")
    if args.repeats > 1 and args.switch_at:
        ap.error("--switch-at makes one run of its own; it does not go with --repeats")
    if args.switch_drain and not args.switch_at:
        ap.error("--switch-drain goes with --switch-at")
    args.modes = args.modes or ("colocated" if args.switch_at else "colocated,chunked:64,disagg:1p1d")
    try:
        modes = parse_modes(args.modes)
        args.switches = parse_switch_at(args.switch_at, args.switch_drain) if args.switch_at else None
    except ValueError as err:
        ap.error(str(err))
    if args.switch_at:
        others = [flag for flag, on in (("--goodput-search", args.goodput_search), ("--kv-link-gbps", args.kv_link_gbps),
                                        ("--plan", args.plan)) if on]  # fmt: skip
        if len(modes) != 1 or not modes[0][1]:
            ap.error(f"with --switch-at, --modes names the one mode the run starts in (got {args.modes!r})")
        if "," in args.workloads or "," in args.rates:
            ap.error("--switch-at makes one run: give one workload and one rate")
        if others:
            ap.error(f"--switch-at makes one run of its own; it does not go with {', '.join(others)}")
    if args.plan_rate is not None and not args.plan:
        ap.error("--plan-rate goes with --plan")
    if (args.goodput_search or args.plan) and not (args.slo_ttft_ms and args.slo_tpot_ms):
        ap.error("--goodput-search and --plan need --slo-ttft-ms and --slo-tpot-ms")
    if args.url is None:  # the server this starts: a split it cannot run is refused before it starts
        for label, body in modes + [(label, body) for _, label, body in args.switches or []]:
            needed = body.get("prefill_workers", 0) + body.get("decode_workers", 0)
            if needed > args.workers:
                ap.error(f"{label} needs {needed} workers; --workers is {args.workers}")
    return args


def run(argv=None) -> int:
    args = parse_args(argv)
    import dataclasses
    import json

    from minipd.bench import experiment as ex
    from minipd.bench import phases as ph
    from minipd.bench import report
    from minipd.bench.metrics import at_least
    from minipd.bench.server_process import ServerProcess
    from minipd.bench.target import Lost, SwitchRefused, Target, Unreachable

    rates = [float(r) for r in args.rates.split(",")]
    links = [float(x) for x in args.kv_link_gbps.split(",")] if args.kv_link_gbps else []
    settings = ex.Settings(args.num_prompts, args.duration, args.burstiness, args.seed, args.quick, args.input_len,
                           args.output_len, args.max_concurrency, args.slo_ttft_ms, args.slo_tpot_ms,
                           not args.no_progress, args.phases)  # fmt: skip
    server = None
    if args.url:
        try:
            target = Target.probe(args.url, args.api_key)
        except Unreachable as err:
            print(f"python -m minipd bench: error: cannot reach a server at {args.url}: {err}", file=sys.stderr)
            return 2
    try:  # before the run, not after it, when what it measured would be lost
        make_writable_folder(args.out)
    except OSError as err:
        print(f"python -m minipd bench: error: cannot write to --out {args.out}: {err}", file=sys.stderr)
        return 2
    if not args.url:
        transport = args.kv_transport or ("tcp" if links else "shm")
        extra = ["--model", args.model] if args.model else []
        if args.advisor_window is not None:
            extra += ["--advisor-window", str(args.advisor_window)]
        # the advisor (mode auto) plans for the SLOs this bench measures
        extra += [x for flag, v in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms))
                  if v is not None for x in (flag, str(v))]  # fmt: skip
        print(f"starting minipd serve ({args.workers} workers, {args.threads_per_worker} thread each, {transport})",
              file=sys.stderr)  # fmt: skip
        server = ServerProcess("--workers", str(args.workers), "--threads-per-worker", str(args.threads_per_worker),
                               "--kv-transport", transport, "--log-level", "warning", *extra)  # fmt: skip
        target = Target.probe(server.url)
    modes = ex.parse_modes(args.modes) if target.is_minipd else [("server", {})]
    found = ex.mode_to_restore(target) if args.url and target.is_minipd else None  # a server of the user's own
    runs, searches, link_runs, notes = [], [], [], {}
    if args.switches and not target.is_minipd:
        if server is not None:
            server.stop()
        print(f"error: --switch-at needs a minipd server (its /admin/mode); {target.url} is not one", file=sys.stderr)
        return 2
    try:
        if args.switches:
            start, body = modes[0]
            label = f"{start} then " + ", ".join(f"{lab}@{at:g}s" for at, lab, _ in args.switches)
            runs.append(ex.run_once(target, args.workloads, label, body, rates[0], settings, switches=args.switches,
                                    start_label=start, switch_at=args.switch_at))  # fmt: skip
            _say(runs[-1])
            print(report.switch_tables(runs[-1]), file=sys.stderr)
        for name in [] if args.switches else args.workloads.split(","):
            for rate in rates:
                # repeat outside mode: the modes of one repeat run close together, on the same seed (paired)
                for i in range(args.repeats):
                    if args.repeats > 1:
                        print(f"repeat {i + 1}/{args.repeats} (seed {args.seed + i})", file=sys.stderr)
                    for label, body in modes:
                        runs.append(ex.run_once(target, name, label, body, rate, dataclasses.replace(
                            settings, seed=args.seed + i), keep_steps=args.validate_sim, repeat=i))  # fmt: skip
                        _say(runs[-1])
                    if name == "phases":
                        group = [r for r in runs if r["workload"] == name and r["rate"] == rate and r["repeat"] == i]
                        ph.attach_comparisons(group)
                        print(report.phase_tables(group), file=sys.stderr)
                if args.repeats > 1:
                    point = [r for r in runs if r["workload"] == name and r["rate"] == rate and "repeat" in r]
                    print(report.repeat_tables(point), file=sys.stderr)
                    if name == "phases":
                        print(ph.repeat_tables(point), file=sys.stderr)
            if args.goodput_search:
                for label, body in modes:
                    found = ex.goodput_search(target, name, label, body, settings, lo=min(rates), hi=8 * max(rates),
                                              max_runs=args.search_max_runs)  # fmt: skip
                    searches.append(found)
                    print(f"goodput {name} {label}: {at_least(found)}{found['goodput_rate']:.2f} req/s "
                          f"({found['goodput_per_worker']:.2f} per worker)", file=sys.stderr)  # fmt: skip
            for gbps in links if target.is_minipd else []:
                body = ex.mode_body("disagg", kv_link_gbps=gbps)
                link_runs.append(ex.run_once(target, name, f"disagg@{gbps:g}Gb/s", body, rates[0], settings, link=gbps))
                _say(link_runs[-1])
        if (target.is_minipd and not args.switches and any(b.get("mode") == "disagg" for _, b in modes)
                and target.num_workers >= 2):  # fmt: skip
            body = ex.mode_body("disagg")
            notes["admission"] = ex.admission_probe(target, settings, body)
        if args.plan and target.is_minipd:
            notes["plan"] = _plan_and_run(target, args, settings, runs)
        if args.validate_sim and target.is_minipd:
            notes["validation"] = _validate_sim(target, args, settings, runs, searches)
    except ex.Interrupted as stop:
        runs.append(stop.run)
        if stop.run.get("switches") is not None:
            print(report.switch_tables(stop.run), file=sys.stderr)
        notes["interrupted"] = True
        print("interrupted: writing what was measured", file=sys.stderr)
    except KeyboardInterrupt:
        notes["interrupted"] = True
        print("interrupted: writing what was measured", file=sys.stderr)
    except (Lost, SwitchRefused) as err:
        notes["error"] = str(err)
        print(f"error: {err}; writing what was measured", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()
        if found is not None:
            ex.restore_mode(target, found)
    for i in range(args.repeats):  # each repeat's auto runs against the fixed modes of the same seed
        ph.attach_comparisons([r for r in runs if r.get("repeat", 0) == i])
    everything = runs + link_runs + [r for s in searches for r in s["runs"]]
    report.write_results(args.out, everything)
    report.plot_runs(args.out, runs)
    extra = _extra_sections(args, runs, searches, link_runs, notes, report)
    with open(f"{args.out}/notes.json", "w") as f:
        json.dump(report._plain({"searches": [{k: v for k, v in s.items() if k != "runs"} for s in searches],
                                 **notes}), f, indent=1, default=str)  # fmt: skip
    report.write_report_md(args.out, runs, "minipd bench", "python -m minipd bench " + " ".join(sys.argv[2:] if
                           argv is None else argv), extra)  # fmt: skip
    print(f"wrote {args.out}/report.md, results.json and the plots", file=sys.stderr)
    return 130 if notes.get("interrupted") else 1 if notes.get("error") else 0


def _say(run: dict) -> None:
    s = run["summary"]
    att = "" if s["slo_attainment"] is None else f", SLO attainment {s['slo_attainment']:.0%}"
    print(f"{run['workload']:>9} {run['label']:>18} @ {run['rate']:g} req/s: {s['completed']}/{s['num_requests']} done, "
          f"TTFT p50 {s['median_ttft_ms'] or 0:.0f} ms, TPOT p50 {s['median_tpot_ms'] or 0:.0f} ms{att}",
          file=sys.stderr)  # fmt: skip
    adv = run.get("advisor")
    if adv is not None:
        note = adv.get("error") or (f"{len(adv['decisions'])} decisions, {adv['switches']} switch(es) during the run"
                                    + "".join(f"; {sw['at_s']:.1f} s -> {sw['to']}" for sw in adv["switch_log"]))  # fmt: skip
        print(f"{'':>9} the advisor: {note}", file=sys.stderr)
        for flag, ours, key in (("--slo-ttft-ms", run.get("slo_ttft_ms"), "slo_ttft_s"),
                                ("--slo-tpot-ms", run.get("slo_tpot_ms"), "slo_tpot_s")):  # fmt: skip
            theirs = adv.get(key)
            if ours is not None and theirs is not None and abs(theirs * 1e3 - ours) > 1e-6:
                print(f"{'':>9} note: the server's advisor plans for {flag} {theirs * 1e3:g}, this bench measures "
                      f"{ours:g} (start the server with the same {flag})", file=sys.stderr)  # fmt: skip


def _plan_and_run(target, args, settings, runs) -> dict:
    from minipd.bench import experiment as ex
    from minipd.bench import plan

    print("profiling the workers for the planner…", file=sys.stderr)
    profile = plan.profile(target, quick=args.quick)
    out = {"profile": profile.as_dict(), "plans": {}}
    rate = args.plan_rate or max(float(r) for r in args.rates.split(","))
    for name in args.workloads.split(","):
        reqs = ex.workload(name, rate, settings, target.max_model_len)
        traffic = plan.Traffic(rate, sum(r.prompt_len for r in reqs) / len(reqs),
                               sum(r.output_len for r in reqs) / len(reqs))  # fmt: skip
        here = plan.recommend(profile, traffic, target.num_workers, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
        fleet = plan.recommend(profile, plan.Traffic(traffic.rate * 4, traffic.prompt_tokens, traffic.output_tokens),
                               8, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)  # fmt: skip
        best = here["best"]
        body = (ex.mode_body("colocated") if best["split"] == "colocated" else
                ex.mode_body("disagg", prefill_workers=best["prefill"], decode_workers=best["decode"]))
        checked = ex.run_once(target, name, f"plan: {best['split']}", body, traffic.rate, settings, plan=True)
        runs.append(checked)
        s = checked["summary"]
        out["plans"][name] = {"here": here, "fleet_of_8_at_4x_rate": fleet, "text": plan.explain(here, profile),
                              "fleet_text": plan.explain(fleet, profile),
                              "rule": plan.nanopd_rule(profile, best["decode_batch"] or 1.0),
                              "rule_at_link_study_rate": plan.nanopd_rule(profile, _one_decoder_batch(
                                  plan, profile, traffic, float(args.rates.split(",")[0]))),
                              "run": {"split": best["split"], "slo_attainment": s["slo_attainment"],
                                      "median_ttft_ms": s["median_ttft_ms"], "median_tpot_ms": s["median_tpot_ms"],
                                      "met": (s["slo_attainment"] or 0) >= 0.9}}  # fmt: skip
    return out


def _one_decoder_batch(plan, profile, traffic, rate: float) -> float:
    """The decode batch of 1P1D (the link study's split) at `rate`, from the profile."""
    return plan.decode_tpot(profile, plan.Traffic(rate, traffic.prompt_tokens, traffic.output_tokens), 1)[1]


def _extra_sections(args, runs, searches, link_runs, notes, report) -> str:
    from minipd.bench import experiment as ex
    from minipd.bench.metrics import at_least

    out = []
    phase_text = report.phase_tables_by_repeat(runs)
    if phase_text:
        out += ["## Phases: auto against the fixed modes", "", phase_text, ""]
    for run in runs:
        if run.get("switches") is not None:
            out += [f"## Live mode switches: `{run['label']}` ({run['workload']}, {run['rate']:g} req/s)", "",
                    report.switch_tables(run), ""]  # fmt: skip
    if searches:
        out += ["## DistServe goodput (highest rate with >= 90% of requests within both SLOs)", "",
                "| workload | mode | goodput (req/s) | workers | per worker | probes (rate: attainment) |",
                "|---|---|---|---|---|---|"]  # fmt: skip
        for s in searches:
            probes = ", ".join(f"{r:.2f}: {a:.0%}" for r, a in s["probes"])
            bound = at_least(s)
            out.append(f"| {s['workload']} | {s['label']} | {bound}{s['goodput_rate']:.2f} | {s['workers']} "
                       f"| {bound}{s['goodput_per_worker']:.2f} | {probes} |")  # fmt: skip
        out.append("")
    if link_runs:
        out += ["## KV link study (disagg over tcp at each emulated link rate)", ""]
        for name in dict.fromkeys(r["workload"] for r in link_runs):
            points = [(r["link"], r["summary"]["goodput"] or 0.0) for r in link_runs if r["workload"] == name]
            base = {r["label"]: r["summary"]["goodput"] or 0.0 for r in runs
                    if r["workload"] == name and r["rate"] == link_runs[0]["rate"] and r["mode"] != "disagg"}  # fmt: skip
            best = max(base.values()) if base else 0.0
            cross = ex.crossover(points, best)
            report.plot_link_study(f"{args.out}/link_study_{name}.png", points, base,
                                   f"Goodput against KV link bandwidth ({name}, {link_runs[0]['rate']:g} req/s offered)")
            rows = ", ".join(f"{g:g} Gb/s: {v:.2f}" for g, v in sorted(points))
            verdict = (f"disagg matches the best co-located mode ({best:.2f} req/s) from **{cross:g} Gb/s** up"
                       if cross is not None else f"disagg never reached the best co-located mode ({best:.2f} req/s) "
                       "in the range measured")  # fmt: skip
            out += [f"- `{name}`: goodput {rows}; {verdict}. ![link study](link_study_{name}.png)"]
            plans = notes.get("plan", {}).get("plans", {})
            if name in plans:
                for key, where in (("rule_at_link_study_rate", f"at this study's {link_runs[0]['rate']:g} req/s"),
                                   ("rule", "at the plan's rate")):
                    if key not in plans[name]:
                        continue
                    rule = plans[name][key]
                    out.append(f"  - nanoPD's rule {where} predicts a crossover at "
                               f"{rule['predicted_crossover_gbps']:.3g} Gb/s (interference "
                               f"{rule['interference_per_token_s'] * 1e3:.3f} ms/token, B* = "
                               f"{rule['compute_bound_batch']:.1f}, decode batch {rule['decode_batch']:.1f}).")  # fmt: skip
        out.append("")
    if "admission" in notes:
        a = notes["admission"]
        out += ["## Admission is not the bottleneck", "",
                f"{a['burst']} disaggregated requests arriving at once were all seated within "
                f"{a['all_seated_within_s'] * 1e3:.0f} ms (median wait {a['median_seat_wait_s'] * 1e3:.0f} ms), in "
                f"{a['seat_batches']} batch(es) for {a['seats_granted']} seats. A decode step took "
                f"{a['decode_step_s'] * 1e3:.0f} ms: at one seat per decode step (the old design) seating them would "
                f"have taken {a['one_seat_per_step_would_take_s']:.1f} s.", ""]  # fmt: skip
    for name, p in notes.get("plan", {}).get("plans", {}).items():
        r = p["run"]
        out += [f"## Plan for `{name}`", "", p["text"], "",
                f"Run of the recommended split at that rate: SLO attainment {r['slo_attainment'] or 0:.0%}, TTFT p50 "
                f"{r['median_ttft_ms'] or 0:.0f} ms, TPOT p50 {r['median_tpot_ms'] or 0:.0f} ms: "
                f"{'met' if r['met'] else 'NOT met'} (>= 90% in SLO).", "",
                "For a fleet of 8 workers at 4x the rate:", "", p["fleet_text"], ""]  # fmt: skip
    if "validation" in notes:
        from minipd.sim.main import profile_note
        from minipd.sim.profile import Profile
        from minipd.sim.validate import table

        v = notes["validation"]
        out += ["## The simulator against this run (--validate-sim)", "",
                "The same requests in `python -m minipd sim`, with a profile measured on these workers by loads of its "
                "own (profile.json).", "", table(v), "", profile_note(Profile.from_dict(v["profile"])), ""]  # fmt: skip
        for g in v.get("goodput", []):
            out.append(f"- goodput `{g['workload']}` {g['label']}: measured {g['measured']:.2f} req/s, simulated "
                       f"{g['simulated']:.2f} req/s ({'the same rate step' if g['same_step'] else 'a different rate step'})")  # fmt: skip
        out.append("")
    if notes.get("interrupted"):
        out += ["**Interrupted**: the runs above are what was measured before Ctrl-C.", ""]
    return "\n".join(out)


def _validate_sim(target, args, settings, runs, searches) -> dict:
    """Profile the workers, then the same requests (workload, rate, mode, seed) in the simulator."""
    import dataclasses
    import json
    from pathlib import Path

    from minipd.bench.experiment import parse_mode, workers_used
    from minipd.sim.cluster import Options
    from minipd.sim.measure import measure
    from minipd.sim.runs import sim_goodput, sim_once
    from minipd.sim.validate import step_summary, table, validate

    print("profiling the workers for the simulator…", file=sys.stderr)
    profile = measure(target, quick=args.quick, say=lambda text: print(text, file=sys.stderr))
    profile.about["threads_per_worker"] = args.threads_per_worker
    Path(args.out).mkdir(parents=True, exist_ok=True)
    profile.save(Path(args.out) / "profile.json")
    pairs = []
    for run in runs:
        if run.get("mode") not in ("colocated", "chunked", "disagg") or run.get("interrupted"):
            continue  # auto, live switches and other servers are not simulated
        s = dataclasses.replace(settings, seed=run["seed"])
        sim = sim_once(profile, run["workload"], run["label"], run["mode_body"], run["rate"], s, target.num_workers,
                       Options(trace=True))  # fmt: skip
        steps = [e for e in sim.pop("events") if e["type"] == "step"]
        sim["step_summary"] = step_summary(steps, sim["duration"], workers_used(run["mode_body"], target.num_workers))
        pairs.append((run, sim))
    v = validate(pairs)
    v["goodput"] = []
    for found in searches:
        body = parse_mode(found["label"])[1]
        got = sim_goodput(profile, found["workload"], found["label"], body, settings, target.num_workers,
                          found["probes"][0][0], 8 * max(float(r) for r in args.rates.split(",")), args.search_max_runs)  # fmt: skip
        v["goodput"].append({"workload": found["workload"], "label": found["label"], "measured": found["goodput_rate"],
                             "simulated": got["goodput_rate"], "same_step": abs(got["goodput_rate"] - found["goodput_rate"]) < 1e-9,
                             "simulated_probes": got["probes"], "measured_probes": found["probes"]})  # fmt: skip
    v["profile"] = profile.to_dict() | {"points": "(in profile.json)"}
    v["simulated_runs"] = [{k: x for k, x in sim.items() if k != "records"} for _, sim in pairs]
    with open(Path(args.out) / "validation.json", "w") as f:
        json.dump(v, f, indent=1, default=str)
    print(table(v), file=sys.stderr)
    return v
