"""What a newcomer meets first: help with defaults, one-line errors before anything heavy starts,
metrics in Prometheus' format with minipd's own families, and a first handoff as fast as the rest."""

import argparse
import importlib
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from minipd.__main__ import TOOLS, build_parser
from minipd.cli_help import DefaultsFormatter
from tests.helpers import serving


def subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def tool_parser(module: str) -> argparse.ArgumentParser:
    """The parser a tool (bench, plan, demo) builds in its parse_args."""

    class Built(Exception):
        pass

    def stop(self, *args, **kwargs):
        raise Built(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", stop), pytest.raises(Built) as built:
        importlib.import_module(module).parse_args([])
    return built.value.args[0]


@pytest.mark.parametrize("command", ["serve", "generate", "bench", "plan", "demo"])
def test_help_shows_a_default_for_every_option_that_takes_a_value(command):
    p = tool_parser(TOOLS[command]) if command in TOOLS else subparser(command)
    fmt = DefaultsFormatter(p.prog)
    for action in p._actions:
        if action.option_strings and action.nargs != 0 and not action.required:
            assert action.help, action.option_strings
            assert "default" in fmt._get_help_string(action), action.option_strings
    text = p.format_help()
    for group in ("server", "modes", "disagg and KV transfer", "workers", "engine") if command == "serve" else ():
        assert f"\n{group}:" in text


def test_help_says_what_no_value_means_and_never_shows_the_api_key(monkeypatch):
    monkeypatch.setenv("MINIPD_API_KEY", "sekrit")
    p = subparser("serve")
    fmt = DefaultsFormatter(p.prog)
    helps = {o: fmt._get_help_string(a) % vars(a) for a in p._actions for o in a.option_strings}
    assert helps["--api-key"].endswith("(default: none; env MINIPD_API_KEY)")
    assert helps["--kv-link-gbps"].endswith("(default: unpaced)")
    assert helps["--kv-link-latency-ms"].endswith("(default: 0.0)")
    assert helps["--quantization"].endswith("(default: off)")
    assert "sekrit" not in p.format_help()
    gen = subparser("generate")
    temperature = gen._option_string_actions["--temperature"]
    assert DefaultsFormatter(gen.prog)._get_help_string(temperature) % vars(temperature) == "0 = greedy (default: 0.0)"


def run_cli(*args, timeout=20):
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "minipd", *args], capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - started


def test_help_is_instant_and_lists_the_tools():
    out, took = run_cli("--help")
    assert out.returncode == 0 and all(t in out.stdout for t in ("serve", "generate", "demo", "bench", "plan"))
    out, took = run_cli("serve", "--help")
    assert out.returncode == 0 and "(default: 8000)" in out.stdout and took < 5
    out, _ = run_cli("--version")
    assert out.stdout.startswith("minipd ")


def test_a_port_in_use_is_one_line_and_exit_code_2_within_a_second():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out, took = run_cli("serve", "--model", "tiny-random", "--port", str(port))
    assert out.returncode == 2 and took < 1.5
    assert out.stderr.count("\n") == 1 and str(port) in out.stderr and "--port" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


@pytest.mark.parametrize("args,words", [
    (("--model", "/no/such/model"), "neither a .gguf file nor a folder"),
    (("--model", "tiny-random", "--mode", "disagg", "--workers", "1"), "P + D <= 1"),
    (("--model", "tiny-random", "--kv-link-gbps", "1"), "need --kv-transport tcp"),
    (("--model", "tiny-random", "--kv-transport", "cuda-ipc"), "does not work with --device cpu"),
    (("--model", "tiny-random", "--device", "cuda", "--quantization", "int8"), "--quantization int8"),
    (("--model", "tiny-random", "--mode", "auto", "--advisor-profile", "/no/such.json"), "--advisor-profile"),
])  # fmt: skip
def test_usual_mistakes_are_one_line_before_anything_heavy(args, words):
    out, took = run_cli("serve", "--port", "0", *args)
    assert out.returncode == 2 and words in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert took < 5


@pytest.mark.slow
def test_metrics_are_prometheus_text_with_minipds_families():
    with serving("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1") as s:
        s.post("/admin/mode", {"mode": "disagg"})
        assert s.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3})[0] == 200
        import urllib.request

        with urllib.request.urlopen(s.url + "/metrics") as resp:
            assert resp.headers["Content-Type"] == CONTENT_TYPE_LATEST
            text = resp.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("minipd:mode_info", "minipd:mode_switches", "minipd:seats_reserved", "minipd:seats_waiting",
                 "minipd:kv_handoffs", "minipd:worker_restarts", "minipd:request_redos",
                 "minipd:time_to_first_token_seconds", "minipd:kv_cache_usage_perc"):  # fmt: skip
        assert name in families, name
    assert not any(s.name.endswith("_created") for f in families.values() for s in f.samples)
    mode = next(s for s in families["minipd:mode_info"].samples)
    assert mode.labels["mode"] == "disagg"
    workers = {s.labels["worker"] for s in families["minipd:kv_cache_usage_perc"].samples}
    assert workers == {"0", "1"}
    handoffs = {s.labels["outcome"]: s.value for s in families["minipd:kv_handoffs"].samples if s.name.endswith("_total")}
    assert handoffs.get("imported") == 1


@pytest.mark.slow
def test_the_first_handoff_after_a_switch_is_as_fast_as_the_next_ten():
    with serving("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1",
                 "--kv-cache-tokens", "65536") as s:  # fmt: skip
        assert s.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 2})[0] == 200
        assert s.post("/admin/mode", {"mode": "disagg"})[0] == 200
        seconds = []
        for i in range(11):
            status, body = s.post("/v1/completions", {"prompt": [7 + i] * 300, "max_tokens": 2})
            assert status == 200
            seconds.append(s.get(f"/v1/requests/{body['id']}/timeline")[1]["kv_transfer"]["seconds"])
        assert seconds[0] <= 3 * statistics.median(seconds[1:]), seconds


@pytest.mark.parametrize("script", sorted(p.name for p in (Path(__file__).parent.parent / "scripts").glob("*.py")))
def test_every_script_explains_itself_at_once(script):
    path = Path(__file__).parent.parent / "scripts" / script
    code = (f"import runpy, sys; sys.argv = [{str(path)!r}, '--help']\n"
            f"try:\n    runpy.run_path({str(path)!r}, run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'imported torch before parsing its arguments'")  # fmt: skip
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    first_line = path.read_text().split('"""')[1].split("\n")[0].strip()
    assert first_line[:40] in " ".join(out.stdout.split()) and time.monotonic() - started < 5
