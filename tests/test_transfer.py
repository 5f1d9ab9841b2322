"""KV transfer pieces, in one process over real ZeroMQ sockets."""

import time

import torch
import zmq

from minipd.sampling_params import SamplingParams
from minipd.transfer.channel import KVReceiver, KVSender, Peer
from minipd.transfer.link import LinkEmulator
from minipd.transfer.peer_cache import block_runs, copy_blocks
from tests.conftest import make_engine


def test_block_runs_merge_consecutive_pairs():
    assert block_runs([4, 5, 6, 9, 10], [0, 1, 7, 8, 9]) == [(4, 0, 2), (6, 7, 1), (9, 8, 2)]
    assert block_runs([], []) == []


def test_copy_blocks_moves_exactly_the_prompt_slots():
    src = torch.randn(2, 3, 8 * 4, 2, 5)
    dst = torch.zeros_like(src)
    copy_blocks(src, [6, 7, 2], dst, [1, 2, 5], num_tokens=10, block_size=4)
    for s, d, n in ((6, 1, 4), (7, 2, 4), (2, 5, 2)):
        assert torch.equal(dst[:, :, d * 4 : d * 4 + n], src[:, :, s * 4 : s * 4 + n])


def test_link_emulator_paces_to_rate_and_latency():
    link = LinkEmulator(gbps=8.0, latency_ms=5.0)
    assert abs(link.due(10**9) - (0.005 + 1.0)) < 1e-9
    start = time.perf_counter()
    link.wait(start, 10**7)  # 10 MB at 8 Gb/s = 10 ms, plus 5 ms
    assert time.perf_counter() - start >= 0.015


def test_tcp_handoff_writes_the_prefill_kv_into_the_decode_seat(tiny_model):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prefill = make_engine(tiny_model, role="prefill")
    decode = make_engine(tiny_model, role="decode")
    prompt = list(range(10, 47))
    prefill.add_request("r", prompt, params)
    while not prefill.scheduler.handoffs:
        prefill.step()
    seat = decode.reserve_seat("r", len(prompt))
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    port = inbox.bind_to_random_port("tcp://127.0.0.1")
    sender = KVSender(ctx, "tcp", LinkEmulator(gbps=1.0))
    try:
        n = sender.send(prefill, "r", Peer(f"tcp://127.0.0.1:{port}"), seat, {})
        assert n == len(prompt) * tiny_model.config.kv_bytes_per_token(4)
        receiver, done = KVReceiver(), None
        while done is None:
            done = receiver.on_message(inbox.recv_multipart(), decode, lambda rid: True)
        deadline = time.monotonic() + 5
        while not (finished := sender.finished()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert finished == [("r", None)]
        src = prefill.runner.export_kv(prefill.scheduler.handoffs["r"].block_table, len(prompt))
        assert torch.equal(decode.runner.export_kv(seat, len(prompt)), src)
    finally:
        sender.close()
        ctx.destroy(linger=0)
