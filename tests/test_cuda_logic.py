"""The CUDA path's arguments and checks, on any machine: torch's view of the GPUs is stood in for."""

import argparse

import pytest
import torch
from torch.cuda._utils import _get_device_index

from minipd.__main__ import build_parser
from minipd.config import EngineConfig
from minipd.engine.engine import Engine
from minipd.server import cli
from minipd.server.cli import UserError, preflight, worker_configs


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(cli, "_cuda_device_count", lambda: 2)


def test_a_bare_cuda_device_is_the_current_card(two_gpus):
    assert EngineConfig(device="cuda").device == "cuda:1"
    assert EngineConfig(device="cuda:0").device == "cuda:0"
    assert EngineConfig(device="cpu").device == "cpu"


def test_a_cuda_index_past_the_cards_is_refused(two_gpus):
    with pytest.raises(ValueError, match="cuda:2.*2 CUDA devices"):
        EngineConfig(device="cuda:2")


def test_an_engine_on_bare_cuda_selects_a_card_torch_accepts(two_gpus, monkeypatch, tiny_model):
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: chosen.append(_get_device_index(device)))
    Engine(EngineConfig(device="cuda", kv_cache_tokens=64), model=tiny_model)  # LLM(device="cuda") builds this
    assert chosen == [1]


def test_int8_on_cuda_is_refused(two_gpus):
    with pytest.raises(ValueError, match="int8.*cpu"):
        EngineConfig(device="cuda:0", quantization="int8")
    assert EngineConfig(device="cpu", quantization="int8").quantization == "int8"


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "--model", "tiny-random", "--port", "0", "--device", "cuda", *argv])


def test_serve_refuses_int8_on_cuda_before_anything_starts(two_gpus):
    with pytest.raises(UserError, match="--quantization int8.*--device cuda"):
        preflight(serve_args("--quantization", "int8"))


@pytest.mark.parametrize(
    "gpus,words",
    [
        ("0,2", "GPU 2 is not among the 2 visible (0..1)"),
        ("-1", "GPU -1 is not among the 2 visible (0..1)"),
        ("0,x", "--gpus takes comma-separated GPU indices, got '0,x'"),
        ("0,", "--gpus takes comma-separated GPU indices, got '0,'"),
    ],
)
def test_gpus_are_checked_against_the_visible_count(two_gpus, gpus, words):
    with pytest.raises(UserError) as err:
        worker_configs(serve_args("--gpus", gpus))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_gpus_in_range_get_one_worker_each(two_gpus):
    assert [c["device"] for c in worker_configs(serve_args("--gpus", "1,0,0"))] == ["cuda:1", "cuda:0", "cuda:0"]
    assert [c["device"] for c in worker_configs(serve_args())] == ["cuda:0", "cuda:1"]


def test_no_visible_gpu_is_one_line(monkeypatch):
    monkeypatch.setattr(cli, "_cuda_device_count", lambda: 0)
    with pytest.raises(UserError, match="no GPU is visible"):
        worker_configs(serve_args("--gpus", "0"))


def test_workers_on_cuda_are_spread_over_the_gpus_not_ignored(two_gpus):
    """Defect: `--device cuda --workers 4` started 2 workers (one per GPU) without a word."""
    assert [c["device"] for c in worker_configs(serve_args("--workers", "4"))] == ["cuda:0", "cuda:1"] * 2
    assert [c["device"] for c in worker_configs(serve_args("--workers", "1"))] == ["cuda:0"]
    assert len(worker_configs(serve_args("--workers", "2", "--gpus", "0,0"))) == 2
    with pytest.raises(UserError, match="--workers 3 and --gpus 0,1 disagree"):
        worker_configs(serve_args("--workers", "3", "--gpus", "0,1"))
    with pytest.raises(UserError, match="--workers must be >= 1"):
        worker_configs(serve_args("--workers", "0"))
