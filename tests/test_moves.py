"""Moving a running reply between workers at a token boundary (a handoff whose source is a decode):
two real Workers on the tiny model, in this process, the test playing the router. The reply must
go on with no token missing, repeated or changed, in every transport; a move that fails or is
called off leaves no block on either side."""

import pytest

from minipd.engine.block_manager import blocks_for
from minipd.transfer.handoffs import Stage
from minipd.workers import messages as m
from tests import test_transfer_faults
from tests.test_transfer_faults import event, finished, greedy, seen, tokens_of
from tests.test_worker import of

pair = test_transfer_faults.pair  # the fixture: a prefill and a decode Worker in this process
GREEDY = {"max_tokens": 30, "temperature": 0.0, "ignore_eos": True}
SEEDED = {"max_tokens": 30, "temperature": 0.9, "top_p": 0.95, "seed": 1234, "ignore_eos": True}
PROMPT = list(range(3, 40))


def unmoved(model, params: dict) -> list[int]:
    return greedy(model, PROMPT, params)


def move(pair, key: str, made: int, slack: int = 32) -> list[int]:
    """Reserve a seat on worker 1 big enough for what worker 0 may have made by the time the
    Move is read, and send the Move (what the router does)."""
    seat = pair.decode.worker.seats.reserve(key, len(PROMPT) + made + slack, 0, writer=0)
    assert seat is not None
    pair.prefill.send(m.Move(key, 1, seat))
    return seat


@pytest.mark.parametrize("transport", ["shm", "tcp", "tcp-paced"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_reply_moved_mid_decode_goes_on_token_for_token(pair, tiny_model, transport, params):
    p = pair("tcp" if transport == "tcp-paced" else transport)
    if transport == "tcp-paced":
        p.prefill.worker.sender.link.gbps, p.prefill.worker.sender.link.latency_ms = 0.01, 5.0
    p.prefill.send(m.AddRequest("r.1", PROMPT, params))  # running on worker 0 as in colocated
    p.pump(lambda got: sum(len(x.token_ids) for x in of(m.Tokens, got)) >= 6)
    move(p, "r.1", 6)
    got = p.pump(finished("r.1"), timeout=20)
    by_worker = {x.worker_id for x in of(m.Tokens, got) if x.key == "r.1"}
    assert by_worker == {0, 1}, "the reply did not move"
    assert [x for x in got if isinstance(x, m.Event) and x.kind == "move_start"][0].data["now"] is True
    assert tokens_of("r.1", got) == unmoved(tiny_model, params)
    assert not of(m.RequestError, got)
    p.pump(lambda got: p.idle())


def test_a_move_asked_for_during_the_prompt_hands_off_after_the_first_token(pair, tiny_model):
    p = pair("shm")
    p.prefill.send(m.AddRequest("r.1", PROMPT, GREEDY))
    move(p, "r.1", 0, slack=1)
    got = p.pump(finished("r.1"), timeout=20)
    start = [x for x in got if isinstance(x, m.Event) and x.kind == "move_start"][0]
    assert start.data["now"] is False
    assert [x.worker_id for x in sorted(of(m.Tokens, got), key=lambda x: x.index)][:2] == [0, 1]
    assert tokens_of("r.1", got) == unmoved(tiny_model, GREEDY)
    p.pump(lambda got: p.idle())


def test_a_move_into_a_seat_too_small_is_refused_and_the_reply_stays(pair, tiny_model):
    p = pair("tcp")
    p.prefill.send(m.AddRequest("r.1", PROMPT, GREEDY))
    p.pump(lambda got: sum(len(x.token_ids) for x in of(m.Tokens, got)) >= 20)
    seat = p.decode.worker.seats.reserve("r.1", 3, 0, writer=0)  # one block: far too small
    p.prefill.send(m.Move("r.1", 1, seat))
    got = p.pump(finished("r.1"), timeout=20)
    refused = [x for x in got if isinstance(x, m.Event) and x.kind == "move_refused"]
    assert refused and "outgrew its seat" in refused[0].data["reason"]
    assert {x.worker_id for x in of(m.Tokens, got)} == {0}
    assert tokens_of("r.1", got) == unmoved(tiny_model, GREEDY)
    assert not of(m.RequestError, got), "the reader's seat went back quietly; the reply is fine"
    p.pump(lambda got: p.idle())


def test_a_move_of_a_request_that_is_not_there_gives_the_seat_back(pair):
    p = pair("shm")
    seat = p.decode.worker.seats.reserve("gone.1", 10, 0, writer=0)
    p.prefill.send(m.Move("gone.1", 1, seat))
    got = p.pump(seen(event("move_refused", "gone.1")))
    p.pump(lambda got: p.idle())
    assert not of(m.RequestError, got)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_an_abort_during_a_move_leaves_no_block_on_either_side(pair, transport):
    p = pair(transport)
    if transport == "tcp":
        p.prefill.worker.sender.link.gbps = 0.0005  # the KV takes seconds: the abort lands mid-transfer
    p.prefill.send(m.AddRequest("r.1", PROMPT, GREEDY))
    p.pump(lambda got: len(of(m.Tokens, got)) >= 3)
    move(p, "r.1", 3)
    p.pump(seen(event("transfer_start", "r.1")))
    p.abort("r.1")
    p.pump(lambda got: p.idle(), timeout=10)
    assert p.prefill.worker.engine.scheduler.find("r.1") is None
    assert p.decode.worker.engine.scheduler.find("r.1") is None


def test_a_reader_that_dies_during_a_move_frees_the_writers_blocks(pair):
    p = pair("tcp")
    p.prefill.worker.sender.link.gbps = 0.0005
    p.prefill.send(m.AddRequest("r.1", PROMPT, GREEDY))
    p.pump(lambda got: len(of(m.Tokens, got)) >= 3)
    move(p, "r.1", 3)
    p.pump(seen(event("transfer_start", "r.1")))
    p.prefill.send(m.Peers({}, gone=[1]))  # what the router says when the reader dies
    # the router hears the move failed (it redoes it); the blocks may be freed a turn before it does
    # (on a loaded machine the pump stopped in between: a CI failure)
    p.pump(lambda got: any(x.key == "r.1" for x in of(m.RequestError, got)))
    p.pump(lambda got: p.prefill.worker.engine.blocks.num_used == 0 and not len(p.prefill.worker.outgoing))


def test_the_handoff_record_of_a_move_starts_from_decoding():
    from minipd.transfer.handoffs import Handoff, IllegalTransition

    h = Handoff("k", 0, 1, [1, 2], Stage.DECODING)
    h.to(Stage.WRITING)
    h.to(Stage.WRITTEN)
    h.to(Stage.RELEASED)
    with pytest.raises(IllegalTransition):
        Handoff("k", 0, 1, [1], Stage.DECODING).to(Stage.IMPORTED)
    assert blocks_for(17, 16) == 2
