"""KV transfer pieces, in one process over real ZeroMQ sockets."""

import dataclasses
import time

import torch
import zmq

from minipd.engine.handoff import KVSlots
from minipd.sampling_params import SamplingParams
from minipd.transfer.link import LinkEmulator
from minipd.transfer.peer_cache import block_runs, copy_blocks
from minipd.transfer.receiver import SeatTable
from minipd.transfer.sender import KVSender
from minipd.transfer.wire import Peer
from tests.conftest import make_engine


def test_block_runs_merge_consecutive_pairs():
    assert block_runs([4, 5, 6, 9, 10], [0, 1, 7, 8, 9]) == [(4, 0, 2), (6, 7, 1), (9, 8, 2)]
    assert block_runs([], []) == []


def test_copy_blocks_moves_exactly_the_prompt_slots():
    src = torch.randn(2, 3, 8 * 4, 2, 5)
    dst = torch.zeros_like(src)
    copy_blocks(KVSlots(src, [6, 7, 2], 10, 4), dst, [1, 2, 5])
    for s, d, n in ((6, 1, 4), (7, 2, 4), (2, 5, 2)):
        assert torch.equal(dst[:, :, d * 4 : d * 4 + n], src[:, :, s * 4 : s * 4 + n])


def test_link_emulator_paces_to_rate_and_latency():
    link = LinkEmulator(gbps=8.0, latency_ms=5.0)
    assert abs(link.due(10**9) - (0.005 + 1.0)) < 1e-9
    start = time.monotonic()
    assert link.wait(start, 10**7)  # 10 MB at 8 Gb/s = 10 ms, plus 5 ms
    assert time.monotonic() - start >= 0.015


def test_tcp_handoff_writes_the_prefill_kv_into_the_decode_seat(tiny_model):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prefill = make_engine(tiny_model, role="prefill")
    decode = make_engine(tiny_model, role="decode")
    prompt = list(range(10, 47))
    prefill.add_request("r", prompt, params)
    while not prefill.scheduler.handoffs:
        prefill.step()
    seats = SeatTable(decode, worker_id=1, in_place=False)
    seat = seats.reserve("r", len(prompt), 0, writer=0)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    port = inbox.bind_to_random_port("tcp://127.0.0.1")
    sender = KVSender(ctx, "tcp", LinkEmulator(gbps=1.0))
    try:
        meta = prefill.handoff_meta("r")
        assert meta.num_bytes == len(prompt) * tiny_model.config.kv_bytes_per_token(4)
        sender.write("r", prefill.handoff_kv("r"), dataclasses.asdict(meta), Peer(f"tcp://127.0.0.1:{port}"), seat,
                     {"start": time.time()})  # fmt: skip
        arrival = None
        while arrival is None:
            arrival = seats.on_message(inbox.recv_multipart())
        assert arrival.imported and arrival.meta.token_ids == meta.token_ids
        deadline = time.monotonic() + 5
        while not (finished := sender.finished()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert finished == [("r", "written", None)]
        src = prefill.handoff_kv("r").read()
        got = decode.scheduler.find("r")
        assert torch.equal(KVSlots(decode.runner.kv_cache, got.block_table, len(prompt), 16).read(), src)
    finally:
        sender.close()
        ctx.destroy(linger=0)


def test_a_send_to_a_reader_that_is_gone_fails_within_its_deadline(tiny_model):
    """Defect: the sender thread blocked forever when the decode worker had died."""
    prefill = make_engine(tiny_model, role="prefill")
    prefill.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    while not prefill.scheduler.handoffs:
        prefill.step()
    ctx = zmq.Context()
    sender = KVSender(ctx, "tcp", timeout=0.5)
    try:
        gone = zmq.Context()  # its own context: destroyed, its listener is closed for sure (a socket's close is not)
        port = gone.socket(zmq.PULL).bind_to_random_port("tcp://127.0.0.1")
        gone.destroy(linger=0)  # nobody listens there any more
        started = time.monotonic()
        sender.write("r", prefill.handoff_kv("r"), dataclasses.asdict(prefill.handoff_meta("r")),
                     Peer(f"tcp://127.0.0.1:{port}"), [0], {"start": time.time()})  # fmt: skip
        while not (finished := sender.finished()):
            assert time.monotonic() - started < 5, "the sender is stuck"
            time.sleep(0.02)
        assert finished[0][:2] == ("r", "timed_out") and "did not take the KV within 0.5 s" in finished[0][2]
    finally:
        sender.close()
        ctx.destroy(linger=0)
