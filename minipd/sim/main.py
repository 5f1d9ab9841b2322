"""python -m minipd sim: the bench's experiments on a simulated server, from a profile (measured by
`python -m minipd profile`, or a roofline estimate for an accelerator), driving minipd's own
scheduler and block manager. Same workloads, seeds, modes and SLO flags as bench; the same
results.json, report and plots, every run marked simulated.

    python -m minipd profile --quick --out profile.json
    python -m minipd sim --profile profile.json --quick --workloads chat --rates 0.5,1 --modes colocated,disagg:1p1d
    python -m minipd sim --estimate h100 --workers 64 --modes disagg:16p48d --rates 50 --num-prompts 20000
"""

from __future__ import annotations

import argparse
import sys

from minipd.cli_help import DefaultsFormatter, listed, make_writable_folder, positive_float, positive_int


def add_traffic_args(ap: argparse.ArgumentParser) -> None:
    from minipd.bench.main import add_traffic_args as bench_traffic

    g = ap.add_argument_group("traffic (as bench)")
    bench_traffic(g)
    g.add_argument("--slo-ttft-ms", type=positive_float, default=None, help="SLO on time to first token")
    g.add_argument("--slo-tpot-ms", type=positive_float, default=None, help="SLO on time per output token")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m minipd sim", description=__doc__.split("\n\n")[0],
                                 formatter_class=DefaultsFormatter)  # fmt: skip
    g = ap.add_argument_group("what is simulated")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="a profile JSON from `python -m minipd profile`")
    src.add_argument("--estimate", metavar="ACCELERATOR", help="a roofline estimate instead, of one of: h100, h200, a100, l4")
    g.add_argument("--params", type=positive_float, default=8e9, help="with --estimate: the model's parameters")
    g.add_argument("--kv-bytes-per-token", type=positive_int, default=131072, help="with --estimate: KV bytes per token")
    g.add_argument("--dtype-bytes", type=positive_int, default=2, help="with --estimate: bytes per weight")
    g.add_argument("--kv-cache-tokens", type=positive_int, default=None,
                   help="KV cache per worker in tokens (default: the profile's; with --estimate 262144)")
    g.add_argument("--workers", type=positive_int, default=2, help="simulated workers")
    g.add_argument("--kv-transport", default=None, help="which of the profile's links a handoff uses (default: its first)")
    add_traffic_args(ap)
    g = ap.add_argument_group("experiments")
    g.add_argument("--modes", default="colocated,chunked:64,disagg:1p1d",
                   help="colocated, chunked[:TOKENS], disagg[:PpDd[:localN]], as bench's")
    g.add_argument("--goodput-search", action="store_true", help="DistServe's goodput by a rate search, simulated")
    g.add_argument("--search-max-runs", type=positive_int, default=8, help="probes per goodput search")
    g.add_argument("--trace", action="store_true", help="also write each run's Chrome/Perfetto trace")
    g = ap.add_argument_group("fleet studies (instead of the runs above)")
    g.add_argument("--fleet-sizes", default=None, type=listed(positive_int), metavar="N,N,...",
                   help="DistServe's placement search: for each fleet size, colocated and disagg with 1/8 to 5/8 of "
                   "the workers prefilling, each one's goodput by a rate search; the best split per size, plotted")  # fmt: skip
    g.add_argument("--fleet-link-gbps", default=None, type=listed(positive_float), metavar="G,G,...",
                   help="the link crossover at the largest fleet size: the best disagg split's goodput at each KV link "
                   "rate against colocated's")  # fmt: skip
    g.add_argument("--fleet-link-workers", type=positive_int, default=None,
                   help="the link study's fleet size (default: the largest of --fleet-sizes, else --workers)")
    g.add_argument("--per-worker-rate", type=positive_float, default=0.25,
                   help="fleet studies: the rate search starts at this many req/s per worker")
    g.add_argument("--probe-seconds", type=positive_float, default=60.0,
                   help="fleet studies: seconds of arrivals per probe (a bigger fleet gets more requests)")
    g.add_argument("--out", default="sim-out", help="folder for results.json, report.md and the plots")
    args = ap.parse_args(argv)
    from minipd.bench.experiment import parse_modes
    from minipd.bench.workloads import parse_phases, workload_names

    try:
        args.workloads = ",".join(workload_names(args.workloads, args.input_len, args.output_len, "--workloads"))
        args.phases = parse_phases(args.phases)
        args.mode_list = parse_modes(args.modes)
    except ValueError as err:
        ap.error(str(err))
    if not args.mode_list:
        ap.error("--modes names no mode")
    if args.fleet_sizes and min(int(x) for x in args.fleet_sizes.split(",")) < 2:
        ap.error("--fleet-sizes: a fleet needs 2 workers or more (a prefill and a decode worker)")
    if any(b.get("mode") not in ("colocated", "chunked", "disagg") for _, b in args.mode_list):
        ap.error("the simulator runs colocated, chunked and disagg modes; auto and server need a real server (python -m minipd bench)")
    for label, body in [] if args.fleet_sizes else args.mode_list:
        need = body.get("prefill_workers", 0) + body.get("decode_workers", 0)
        if body["mode"] == "disagg" and need > args.workers:
            ap.error(f"{label} needs {need} workers; --workers is {args.workers}")
    if args.num_prompts is None and args.duration is None:
        args.num_prompts = 20
    if (args.goodput_search or args.fleet_sizes or args.fleet_link_gbps) and not (args.slo_ttft_ms and args.slo_tpot_ms):
        ap.error("--goodput-search and the fleet studies need --slo-ttft-ms and --slo-tpot-ms")
    return args


def load_profile(args):
    from minipd.sim import profile as pf

    if args.profile:
        try:
            p = pf.Profile.load(args.profile)
        except (OSError, ValueError, KeyError, TypeError) as err:  # missing, not JSON, not a profile
            _fail(f"cannot read the profile {args.profile}: {err}")
    else:
        acc = pf.ACCELERATORS.get(args.estimate.lower())
        if acc is None:
            _fail(f"unknown accelerator {args.estimate!r}: one of {', '.join(pf.ACCELERATORS)}")
        worker = pf.WorkerShape(num_blocks=(args.kv_cache_tokens or 262144) // 16, kv_bytes_per_token=args.kv_bytes_per_token)
        p = pf.roofline(acc, args.params, args.kv_bytes_per_token, args.params * args.dtype_bytes, worker)
    if args.kv_cache_tokens and args.profile:
        p.worker.num_blocks = args.kv_cache_tokens // p.worker.block_size
    if p.worker.num_blocks < 1:
        _fail(f"--kv-cache-tokens {args.kv_cache_tokens} is less than one KV block ({p.worker.block_size} tokens)")
    if args.kv_transport and args.kv_transport not in p.links:
        _fail(f"the profile has no {args.kv_transport!r} link: one of {', '.join(p.links) or '(none)'}")
    return p


def _ready_out(folder: str) -> None:
    try:
        make_writable_folder(folder)
    except OSError as err:
        _fail(f"cannot write to --out {folder}: {err}")


def _fail(message: str):
    print(f"python -m minipd sim: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def run(argv=None) -> int:
    args = parse_args(argv)
    import json

    from minipd.bench import experiment as ex
    from minipd.bench import report
    from minipd.bench.metrics import at_least
    from minipd.sim.cluster import Options
    from minipd.sim.runs import sim_goodput, sim_once

    profile = load_profile(args)
    _ready_out(args.out)
    transport = args.kv_transport or next(iter(profile.links), "shm")
    options = Options(transport, trace=args.trace)
    settings = ex.Settings(args.num_prompts, args.duration, args.burstiness, args.seed, args.quick, args.input_len,
                           args.output_len, None, args.slo_ttft_ms, args.slo_tpot_ms, False,
                           args.phases)  # fmt: skip
    if args.fleet_sizes or args.fleet_link_gbps:
        return fleet(args, profile, settings)
    rates = [float(r) for r in args.rates.split(",")]
    print(f"simulating {args.workers} workers from a profile ({profile.source})", file=sys.stderr)
    runs, searches = [], []
    for name in args.workloads.split(","):
        for rate in rates:
            for label, body in args.mode_list:
                runs.append(sim_once(profile, name, label, body, rate, settings, args.workers, options))
                _say(runs[-1])
        if args.goodput_search:
            for label, body in args.mode_list:
                found = sim_goodput(profile, name, label, body, settings, args.workers, min(rates), 8 * max(rates),
                                    args.search_max_runs, options)  # fmt: skip
                searches.append(found)
                print(f"goodput {name} {label}: {at_least(found)}{found['goodput_rate']:.2f} req/s (simulated)",
                      file=sys.stderr)  # fmt: skip
    import pathlib

    out = pathlib.Path(args.out)  # made by _ready_out
    if args.trace:
        write_traces(out, runs)
    for r in runs:
        r.pop("events", None)
    report.write_results(out, runs + [r for s in searches for r in s["runs"]])
    report.plot_runs(out, runs)
    (out / "profile.json").write_text(json.dumps(profile.to_dict() | {"points": "(omitted)"}, indent=1, default=str))
    extra = [profile_note(profile), ""]
    if searches:
        extra += ["## DistServe goodput (simulated)", "", "| workload | mode | goodput (req/s) | per worker | probes |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for s in searches:
            probes = ", ".join(f"{r:.2f}: {a:.0%}" for r, a in s["probes"])
            bound = at_least(s)
            extra.append(f"| {s['workload']} | {s['label']} | {bound}{s['goodput_rate']:.2f} "
                         f"| {bound}{s['goodput_per_worker']:.2f} | {probes} |")  # fmt: skip
    report.write_report_md(out, runs, "minipd sim (simulated, not measured)",
                           "python -m minipd sim " + " ".join(sys.argv[2:] if argv is None else argv), "\n".join(extra))  # fmt: skip
    print(f"wrote {out}/report.md, results.json and the plots", file=sys.stderr)
    return 0


def profile_note(profile) -> str:
    about = profile.about
    what = ("**Simulated** from a profile measured on " + ", ".join(
        f"{k} {about[k]}" for k in ("model", "workers", "kv_transport") if k in about)
        + (f" ({about['machine'].get('cpu', '?')}, {about['machine'].get('isa', '?')})" if "machine" in about else "")
        if not profile.is_estimate else f"**Simulated** from an **{profile.source}**: not measured anywhere")  # fmt: skip
    s = profile.step
    return (f"## How this was made\n\n{what}. Step time = {s.fixed * 1e3:.2f} ms + {s.per_prefill_token * 1e6:.2f} us per "
            f"prompt token{s.prompt_bends_text(' per ')} + {s.per_attention_pair * 1e9:.3f} ns per (query, key) pair + {s.per_decode * 1e3:.3f} ms per "
            f"decode{s.bends_text(' per ')} (+ {s.per_mixed_decode * 1e3:.3f} ms beside prompt tokens) + {s.per_decode_context * 1e6:.3f} us per token of "
            f"decode context, {s.co_runner_text()}; {s.gap * 1e3:.2f} ms between "
            f"steps. Host: {profile.host.dispatch_s * 1e3:.1f} ms to place a request, {profile.host.token_s * 1e3:.1f} ms "
            f"from a step's end to the client. Links: " + ", ".join(
                f"{k} {v.latency_s * 1e3:.2f} ms + {v.bytes_per_s * 8 / 1e9:.2f} Gb/s" for k, v in profile.links.items()))  # fmt: skip


def write_traces(out, runs) -> None:
    import json

    from minipd.trace.chrome import to_chrome_trace

    for r in runs:
        name = f"trace_{r['workload']}_{r['label']}_{r['rate']:g}".replace(":", "-").replace("/", "-")
        trace = to_chrome_trace(r.get("events") or [], title=f"minipd sim: {r['label']} {r['workload']} @ {r['rate']:g}")
        (out / f"{name}.json").write_text(json.dumps(trace))


def _say(run: dict) -> None:
    s = run["summary"]
    att = "" if s["slo_attainment"] is None else f", SLO attainment {s['slo_attainment']:.0%}"
    print(f"{run['workload']:>9} {run['label']:>18} @ {run['rate']:g} req/s: {s['completed']}/{s['num_requests']} done, "
          f"TTFT p50 {s['median_ttft_ms'] or 0:.0f} ms, TPOT p50 {s['median_tpot_ms'] or 0:.0f} ms{att} "
          f"(simulated in {run['sim']['wall_seconds']:.2f} s)", file=sys.stderr)  # fmt: skip


def fleet(args, profile, settings) -> int:
    """The placement search and the link study, written as fleet.md, fleet.json and plots."""
    import json
    import pathlib

    from minipd.sim import fleet as fl

    out = pathlib.Path(args.out)  # made by _ready_out
    s = fl.fixed_duration(settings, args.probe_seconds)
    name = args.workloads.split(",")[0]
    sizes = [int(x) for x in (args.fleet_sizes or str(args.workers)).split(",")]
    say = lambda text: print(text, file=sys.stderr)  # noqa: E731
    doc = {"profile": profile.source, "workload": name, "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms}
    lines = ["# Fleet studies (simulated, not measured)", "", "Made with:", "", "```",
             "python -m minipd sim " + " ".join(sys.argv[2:]), "```", "", profile_note(profile), "",
             f"Workload `{name}`{' (--quick sizes)' if args.quick else ''}, SLOs TTFT {args.slo_ttft_ms:g} ms and TPOT "
             f"{args.slo_tpot_ms:g} ms; goodput is DistServe's (the highest rate with >= 90% of requests within both), "
             f"each probe {args.probe_seconds:g} s of Poisson arrivals.", ""]  # fmt: skip
    if args.fleet_sizes:
        rows = fl.placement_search(profile, name, sizes, s, args.per_worker_rate, args.search_max_runs, say=say)
        best = fl.best_by_size(rows)
        doc["placement"] = rows
        lines += ["## Placement search", "", "| workers | split | goodput (req/s) | per worker | requests simulated | "
                  "simulated in (s) |", "|---|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            mark = "**" if best[r["workers"]] is r else ""
            lines.append(f"| {r['workers']} | {mark}{r['label']}{mark} | {r['goodput']:.2f} | {r['per_worker']:.3f} | "
                         f"{r['requests']} | {r['sim_seconds']:.1f} |")  # fmt: skip
        lines += ["", "![goodput per worker against fleet size](fleet_placement.png)", ""]
        _plot_placement(out / "fleet_placement.png", rows, name)
    if args.fleet_link_gbps:
        gbps = [float(x) for x in args.fleet_link_gbps.split(",")]
        n_link = args.fleet_link_workers or max(sizes)
        study = fl.link_study(profile, name, n_link, gbps, s, args.per_worker_rate, args.search_max_runs, say=say)
        doc["link_study"] = study
        cross = study["crossover_gbps"]
        lines += ["## KV link crossover", "", f"{study['workers']} workers; colocated goodput {study['colocated']:.2f} req/s.",
                  "", "| link (Gb/s) | best disagg goodput (req/s) |", "|---|---|"]  # fmt: skip
        lines += [f"| {g:g} | {v:.2f} |" for g, v in study["points"]]
        lines += ["", f"Crossover: {f'from {cross:g} Gb/s' if cross is not None else 'none in the range simulated'}.",
                  "", "![goodput against link rate](fleet_link.png)", ""]  # fmt: skip
        from minipd.bench import report

        report.plot_link_study(str(out / "fleet_link.png"), study["points"], {"colocated": study["colocated"]},
                               f"Simulated: goodput against KV link rate ({study['workers']} workers, {name})")  # fmt: skip
    (out / "fleet.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / "fleet.md").write_text("\n".join(lines))
    print(f"wrote {out}/fleet.md, fleet.json and the plots", file=sys.stderr)
    return 0


def _plot_placement(path, rows, workload: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    sizes = sorted({r["workers"] for r in rows})
    ax.plot(sizes, [max(r["per_worker"] for r in rows if r["workers"] == n and r["label"] == "colocated") for n in sizes],
            "o-", label="colocated")  # fmt: skip
    for share in sorted({round(r["prefill"] / r["workers"], 3) for r in rows if r["prefill"]}):
        pts = [(r["workers"], r["per_worker"]) for r in rows if r["prefill"] and round(r["prefill"] / r["workers"], 3) == share]
        ax.plot([p for p, _ in pts], [v for _, v in pts], "s--", label=f"disagg, {share:.0%} prefill")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers in the fleet")
    ax.set_ylabel("goodput per worker (req/s)")
    ax.set_title(f"Simulated placement search ({workload})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
