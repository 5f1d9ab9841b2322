"""Where blocked_linear's speed is not known for the ISA (AVX2, NEON), it runs only if it measured
faster than the paths it replaces on this CPU, once per build; MINIPD_BLOCKED_LINEAR overrides."""

import json
import sys

import pytest

from minipd.models import blocked_choice, cpu_kernels


def test_it_runs_every_product_only_if_faster_for_decode_and_no_slower_for_prefill():
    every = sys.maxsize
    assert blocked_choice.decide({1: 1.10, 8: 1.56, 16: 1.2, 32: 1.1, 128: 1.03, 1024: 1.05}) == every  # Zen 1 AVX2
    assert blocked_choice.decide({1: 1.02, 8: 1.03, 16: 1.3, 32: 1.3, 128: 1.3, 1024: 1.3}) == 0  # decode gains under 5%
    assert blocked_choice.decide({1: 0.98, 8: 1.20, 16: 1.0, 32: 1.0, 128: 1.0, 1024: 1.0}) == every  # the decode mean


def test_where_only_a_decode_steps_few_rows_gain_the_blocks_take_those_rows_alone():
    """Defect (the Zen 3 AVX2 EPYC, blocked_choice.json): blocked_linear was 1.18x and 1.39x faster at 1
    and 8 rows but 0.80x and 0.71x at 128 and 1,024, so it was turned off for every product and a
    decode step lost what it gains. It now runs up to the largest measured row count, past the decode
    rows, where it is still no slower; the products of more rows keep oneDNN's and MKL's paths."""
    assert blocked_choice.decide({1: 1.18, 8: 1.39, 16: 1.23, 32: 0.86, 128: 0.80, 1024: 0.71}) == 16  # Zen 3
    assert blocked_choice.decide({1: 1.18, 8: 1.39, 16: 0.97, 32: 1.1, 128: 0.80, 1024: 0.71}) == 8
    assert blocked_choice.decide({1: 1.5, 8: 1.5, 16: 1.2, 32: 1.0, 128: 1.0, 1024: 0.90}) == 128  # 1,024 10% slower
    assert blocked_choice.decide({1: 1.5, 8: 1.5, 128: 0.99, 1024: 0.90}) == 8  # (a measurement without middle rows)


def test_the_environment_forces_it_either_way_and_refuses_other_values(monkeypatch):
    if not cpu_kernels.small_linear_available():
        pytest.skip("no vector kernels here: blocked_linear is off whatever is asked")
    monkeypatch.setenv(cpu_kernels.BLOCKED_ENV, "1")
    assert cpu_kernels.blocked_linear_in_use()
    monkeypatch.setenv(cpu_kernels.BLOCKED_ENV, "0")
    assert not cpu_kernels.blocked_linear_in_use()
    monkeypatch.setenv(cpu_kernels.BLOCKED_ENV, "yes")
    with pytest.raises(ValueError, match="MINIPD_BLOCKED_LINEAR"):
        cpu_kernels.blocked_linear_in_use()


def test_a_measurement_times_both_paths_at_every_row_count_and_is_kept_and_reused(tmp_path, monkeypatch):
    if not cpu_kernels.small_linear_available():
        pytest.skip("no vector kernels built here")
    monkeypatch.setattr(blocked_choice, "DECODE_BYTES", 4 << 20)  # a small pass: the test checks the bookkeeping
    monkeypatch.setattr(blocked_choice, "PREFILL_ROWS", (64,))
    monkeypatch.setattr(blocked_choice, "path", lambda: tmp_path / "blocked_choice.json")
    got = blocked_choice.choice()
    assert set(got["speedup"]) == {"1", "8", "16", "32", "64"} and all(s > 0 for s in got["speedup"].values())
    assert all(t["blocked"] > 0 and t["other"] > 0 for t in got["ms"].values())
    rows = blocked_choice.decide({int(r): s for r, s in got["speedup"].items()})
    assert got["use"] == (rows > 0) and got["rows"] == (None if rows == sys.maxsize else rows)
    assert blocked_choice.rows_of(got) == rows
    assert got["isa"] == cpu_kernels.kernel_isa()
    assert json.loads((tmp_path / "blocked_choice.json").read_text()) == got
    monkeypatch.setattr(blocked_choice, "measure", lambda: pytest.fail("measured twice"))
    assert blocked_choice.choice() == got
    assert "64 rows" in blocked_choice.summary(got) and blocked_choice.summary(got).startswith("in use" if got["use"] else "off")


@pytest.mark.parametrize("text", ["{}", "[]", "not json", '{"use": "yes", "speedup": {}}',
                                  '{"use": true, "speedup": {"1": 1.2}}'])  # (before the rows were kept: measured again)
def test_a_kept_file_that_is_not_a_measurement_is_measured_again_not_trusted(tmp_path, monkeypatch, text):
    """Review: any JSON was trusted, and a file without "use" raised in every worker at model load."""
    (tmp_path / "blocked_choice.json").write_text(text)
    monkeypatch.setattr(blocked_choice, "path", lambda: tmp_path / "blocked_choice.json")
    assert blocked_choice.cached() is None
    kept = {"use": True, "rows": 16, "speedup": {"1": 1.2}}
    monkeypatch.setattr(blocked_choice, "measure", lambda: kept)
    assert blocked_choice.choice() == kept and blocked_choice.cached() == kept


def test_a_measurement_that_fails_leaves_blocked_linear_off_and_says_why(tmp_path, monkeypatch):
    """Review: an exception in the measurement escaped the build's child (which then reported the
    kernels as not built, and the session ran on the portable paths) or a worker's model load."""
    monkeypatch.setattr(blocked_choice, "path", lambda: tmp_path / "blocked_choice.json")

    def fails():
        raise RuntimeError("no oneDNN here")

    monkeypatch.setattr(blocked_choice, "measure", fails)
    got = blocked_choice.choice()
    assert got["use"] is False and blocked_choice.rows_of(got) == 0 and "no oneDNN here" in got["error"]
    assert "failed" in blocked_choice.summary(got) and blocked_choice.cached() == got
