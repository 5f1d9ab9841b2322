"""python -m minipd demo: the interference stall, live, on the real engine.

A few chat replies are streaming when one long document arrives. In colocated mode the worker
that writes the replies must read the document too, and every reply freezes while it does; chunked
prefill slices the document so it rides along with the replies; disaggregation reads it on
another worker and hands over only its KV cache. Each mode plays the same scene on the same
workers, with the same replies decoding together (colocated and chunked use one worker, disagg one
prefill and one decode worker), more than once, after a warm-up."""

from __future__ import annotations

import argparse

from minipd.cli_help import DefaultsFormatter, make_writable_folder, positive_int, server_url

EXPLAIN = {
    "colocated": "One worker does everything, like the 32 people sharing one card: while it reads the long "
    "document in one go, nobody else gets a word. Every reply froze for {stall:.1f} s, as long as the "
    "prefill took ({prefill:.1f} s).",
    "chunked": "Same worker, but the document is read {chunk} tokens at a time, riding along with everyone's "
    "next word. No reply freezes for long (the worst gap was {stall:.2f} s, {ratio:.1f}x a normal one); "
    "each pays a little on every step, and the document waits longer for its own answer "
    "(first token after {ttft:.1f} s).",
    "disagg": "The document is read on another worker; only its KV cache ({mb:.1f} MB) crosses to the worker "
    "writing the replies, in {ms:.0f} ms. The replies never wait behind it (worst gap {stall:.2f} s, "
    "{ratio:.1f}x a normal one). The price: the copy, and a second worker for prefill.",
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m minipd demo", description=__doc__.split("\n\n")[1],
                                 formatter_class=DefaultsFormatter)  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a shorter scene (shorter document and replies, 2 runs)")
    ap.add_argument("--out", default="demo-out", help="folder for demo.json and timeline.png")
    ap.add_argument("--url", type=server_url, default=None, help="a running minipd server (default: start one)")
    ap.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    ap.add_argument("--model", default=None, help="model for the server this starts (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--repeats", type=positive_int, default=None, help="runs per mode (default 3, --quick 2)")
    ap.add_argument("--streams", type=positive_int, default=3, help="replies streaming when the document arrives")
    ap.add_argument("--long-tokens", type=positive_int, default=None, help="document length in tokens (default 1500, quick 1000)")
    ap.add_argument("--stream-tokens", type=positive_int, default=None, help="tokens per reply (default 320, quick 220)")
    ap.add_argument("--chunk-tokens", type=positive_int, default=64, help="chunked mode's token budget per step")
    ap.add_argument("--no-live", action="store_true", help="no live view (one line per run)")
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.long_tokens = args.long_tokens or (1000 if args.quick else 1500)
    args.stream_tokens = args.stream_tokens or (220 if args.quick else 320)
    return args


def modes(chunk_tokens: int) -> list[tuple[str, dict]]:
    return [("colocated", {"mode": "colocated", "workers": 1}),
            ("chunked", {"mode": "chunked", "chunk_tokens": chunk_tokens, "workers": 1}),
            ("disagg", {"mode": "disagg", "prefill_workers": 1, "decode_workers": 1})]  # fmt: skip


def run(argv=None) -> int:
    args = parse_args(argv)
    import asyncio
    import json
    import os
    import sys

    from rich.console import Console

    from minipd.bench.server_process import ServerProcess
    from minipd.bench.target import Target, Unreachable
    from minipd.demo import analysis
    from minipd.demo.plot import timeline_png
    from minipd.demo.scene import long_document
    from minipd.tokenizer import load_tokenizer

    console = Console()
    if not console.is_terminal:
        console = Console(width=132)  # a file or a pipe: room for the table
    try:  # before the runs, not after them, when what they measured would be lost
        make_writable_folder(args.out)
    except OSError as err:
        print(f"python -m minipd demo: error: cannot write to --out {args.out}: {err}", file=sys.stderr)
        return 2
    server = None
    url = args.url
    if url is None:
        console.print("starting the server on the default model (2 workers, 1 thread each)…")
        extra = ["--model", args.model] if args.model else []
        server = ServerProcess("--workers", "2", "--threads-per-worker", "1", "--log-level", "warning", *extra)
        url = server.url
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    runs: dict[str, list] = {name: [] for name, _ in modes(args.chunk_tokens)}
    try:
        try:
            target = Target.probe(url, args.api_key)
        except Unreachable as err:
            print(f"python -m minipd demo: error: cannot reach a server at {url}: {err}", file=sys.stderr)
            return 2
        if args.long_tokens + 64 > target.max_model_len:  # the question around it, and the reply's 8 tokens
            print(f"python -m minipd demo: error: --long-tokens {args.long_tokens} does not fit the model's context "
                  f"of {target.max_model_len} tokens (with the question around it)", file=sys.stderr)  # fmt: skip
            return 2
        document = long_document(load_tokenizer(args.model, convert_here=False), args.long_tokens)
        console.print("warming up every mode…")
        for _, mode in modes(args.chunk_tokens):
            asyncio.run(_play(url, mode, 0, args, document[: len(document) // 4], headers, None, 2, 16))
        for r in range(1, args.repeats + 1):
            for name, mode in modes(args.chunk_tokens):
                scene = asyncio.run(_play(url, mode, r, args, document, headers, console, args.streams,
                                          args.stream_tokens))  # fmt: skip
                result = analysis.stats(scene)
                runs[name].append({"scene": scene, "stats": result})
                console.print(f"{name:>10} run {r}: stall {result['stall_s'] * 1e3:7.0f} ms, median gap "
                              f"{(result['median_gap_s'] or 0) * 1e3:5.0f} ms, document TTFT "
                              f"{(result['long_ttft_s'] or 0):5.2f} s")  # fmt: skip
    except KeyboardInterrupt:
        console.print("interrupted: the demo needs every mode's runs to compare them; nothing written")
        return 130
    finally:
        if server is not None:
            server.stop()
    summary = {name: analysis.summary([x["stats"] for x in rs]) for name, rs in runs.items()}
    checks = _checks(summary)
    _print_table(console, summary, args)
    for name in runs:
        console.print(f"[bold]{name}[/bold]: " + _explain(name, summary[name], args))
    for text, ok in checks:
        console.print(("[green]✓[/green] " if ok else "[red]✗[/red] ") + text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "demo.json"), "w") as f:
        json.dump({"note": "token times are taken where the client receives them (epoch seconds); step and "
                           "transfer events are the server's, on the same clock",
                   "config": {k: v for k, v in vars(args).items() if k != "api_key"},
                   "modes": {name: {"mode": dict(modes(args.chunk_tokens))[name], "summary": summary[name],
                                    "runs": [{"stats": x["stats"], "scene": x["scene"].as_dict()} for x in rs]}
                             for name, rs in runs.items()},
                   "checks": [{"check": text, "ok": ok} for text, ok in checks]}, f, indent=1)  # fmt: skip
    timeline_png([(f"{name}: stall {rs[-1]['stats']['stall_s']:.2f} s", rs[-1]["scene"]) for name, rs in runs.items()],
                 os.path.join(args.out, "timeline.png"))  # fmt: skip
    console.print(f"wrote {args.out}/demo.json and {args.out}/timeline.png")
    return 0 if all(ok for _, ok in checks) else 1


async def _play(url, mode, run, args, document, headers, console, streams, stream_tokens):
    from minipd.demo.scene import play

    if console is None or args.no_live:
        return await play(url, mode, run, streams=streams, stream_tokens=stream_tokens, document=document,
                          headers=headers)  # fmt: skip
    from rich.live import Live

    from minipd.demo.live import render

    title = f"{mode['mode']}, run {run} of {args.repeats}"
    with Live(console=console, refresh_per_second=10, transient=True) as live:
        return await play(url, mode, run, streams=streams, stream_tokens=stream_tokens, document=document,
                          headers=headers, on_change=lambda scene: live.update(render(scene, title)))  # fmt: skip


def _checks(summary: dict) -> list[tuple[str, bool]]:
    """What the demo teaches, each as (text, held): colocated's replies wait for the whole document,
    disagg's for a small part of it (a reply's worst gap against its median gap is in the table: on
    two busy cores one scheduling hiccup makes it 3-5x, so it is not what is checked)."""
    over_prefill = {name: s.get("stall_over_prefill", {}).get("median") for name, s in summary.items()}
    colocated, disagg = over_prefill.get("colocated"), over_prefill.get("disagg")
    out = [(f"colocated: the replies froze for {colocated or 0:.0%} of the document's prefill (>= 80%)",
            bool(colocated and colocated >= 0.8)),
           (f"disagg: the replies froze for {disagg or 0:.0%} of the document's prefill (<= 10%)",
            disagg is not None and disagg <= 0.1)]  # fmt: skip
    stall = {name: summary[name].get("stall_s", {}).get("median", 0) for name in summary}
    out.append(("chunked lies in between: stall colocated > chunked > disagg "
                f"({stall['colocated']:.2f} > {stall['chunked']:.2f} > {stall['disagg']:.2f} s)",
                stall["colocated"] > stall["chunked"] > stall["disagg"]))  # fmt: skip
    return out


def _print_table(console, summary: dict, args) -> None:
    from rich.table import Table

    table = Table(title=f"{args.streams} replies streaming, then a {args.long_tokens}-token document arrives "
                        f"(median of {args.repeats} runs, \\[min-max]; client-side times)")  # fmt: skip
    for col in ("mode", "stall", "median gap", "stall / gap", "stall / prefill", "document TTFT", "KV moved",
                "KV transfer"):  # fmt: skip
        table.add_column(col, justify="right")

    def cell(s, key, scale=1.0, fmt="{:.0f}", unit=""):
        if key not in s:
            return "-"
        v = s[key]
        return f"{fmt.format(v['median'] * scale)}{unit} [{fmt.format(v['min'] * scale)}-{fmt.format(v['max'] * scale)}]"

    for name, s in summary.items():
        table.add_row(name, cell(s, "stall_s", 1e3, unit=" ms"), cell(s, "median_gap_s", 1e3, unit=" ms"),
                      cell(s, "stall_over_median", fmt="{:.1f}", unit="x"),
                      cell(s, "stall_over_prefill", 100, unit="%"), cell(s, "long_ttft_s", fmt="{:.2f}", unit=" s"),
                      cell(s, "kv_bytes", 1e-6, "{:.1f}", " MB") if name == "disagg" else "-",
                      cell(s, "kv_transfer_s", 1e3, "{:.1f}", " ms") if name == "disagg" else "-")  # fmt: skip
    console.print(table)


def _explain(name: str, s: dict, args) -> str:
    get = lambda key: s.get(key, {}).get("median") or 0.0  # noqa: E731
    return EXPLAIN[name].format(stall=get("stall_s"), prefill=get("prefill_s"), chunk=args.chunk_tokens,
                                ratio=get("stall_over_median"), ttft=get("long_ttft_s"), mb=get("kv_bytes") / 1e6,
                                ms=get("kv_transfer_s") * 1e3)  # fmt: skip
