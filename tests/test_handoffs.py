"""The handoff state machine and the reader's seats: who may give a seat's blocks back, and when."""

import time

import pytest

from minipd.transfer import wire
from minipd.transfer.handoffs import Handoff, Handoffs, IllegalTransition, Stage
from minipd.transfer.receiver import SeatTable
from tests.conftest import make_engine


def test_stages_only_move_forward():
    h = Handoff("k", writer=0, reader=1, seat=[3], stage=Stage.SEAT_RESERVED)
    h.to(Stage.WRITING)
    h.to(Stage.WRITTEN)
    h.to(Stage.IMPORTED)
    with pytest.raises(IllegalTransition):
        h.to(Stage.WRITING)
    h.to(Stage.RELEASED)
    assert h.ended and [s for s, _ in h.history] == ["seat_reserved", "writing", "written", "imported", "released"]
    table = Handoffs()
    table.open(Handoff("a", 0, 1, [], Stage.PREFILLING))
    with pytest.raises(ValueError):
        table.open(Handoff("a", 0, 1, [], Stage.PREFILLING))
    assert table.end("a").stage is Stage.RELEASED and table.get("a") is None and table.end("a") is None


def end_message(key, outcome, **extra):
    return wire.header(wire.END, {"key": key, "outcome": outcome, "start": time.time(), **extra})


@pytest.fixture
def decode(tiny_model):
    return make_engine(tiny_model, role="decode", kv_cache_tokens=256, block_size=16)


def test_an_aborted_in_place_seat_is_kept_until_its_writer_is_done(decode):
    """Defect: the decode worker freed a seat as soon as an abort came, while the prefill worker
    could still be copying into those blocks; the next request given them got corrupted KV."""
    released = []
    seats = SeatTable(decode, worker_id=1, in_place=True, on_release=lambda k, s: released.append((k, s)))
    seats.reserve("a", 40, 0, writer=0)
    used = decode.blocks.num_used
    seats.abort("a")
    assert decode.blocks.num_used == used and not released  # the writer may be copying right now
    assert seats.on_message(end_message("a", wire.WRITTEN, meta={})) is None  # its last word
    assert decode.blocks.num_used == 0 and released == [("a", Stage.RELEASED)]
    decode.blocks.check_integrity()


def test_a_seat_goes_back_at_once_when_nobody_writes_into_it_in_place(decode):
    seats = SeatTable(decode, worker_id=1, in_place=False)
    seats.reserve("tcp", 40, 0, writer=0)
    seats.abort("tcp")  # tcp: only the reader writes its own cache
    assert decode.blocks.num_used == 0
    seats = SeatTable(decode, worker_id=1, in_place=True)
    seats.reserve("never-sent", 40, 0, writer=0)
    seats.abort("never-sent", writer_done=True)  # the router knows the writer never got it
    assert decode.blocks.num_used == 0


def test_seats_of_a_dead_writer_come_back(decode):
    seats = SeatTable(decode, worker_id=1, in_place=True)
    seats.reserve("a", 40, 0, writer=0)
    seats.reserve("b", 40, 0, writer=2)
    seats.abort("a")
    assert seats.writer_gone(0) == ["a"]
    assert len(seats) == 1 and decode.blocks.num_used == decode.blocks.num_seated > 0
    seats.writer_gone(2)
    assert decode.blocks.num_used == 0


def test_a_cancelled_handoff_frees_the_seat_and_reports_why(decode):
    seats = SeatTable(decode, worker_id=1, in_place=True)
    seats.reserve("a", 40, 0, writer=0)
    arrival = seats.on_message(end_message("a", wire.CANCELLED, reason="the request finished during prefill"))
    assert not arrival.imported and "finished during prefill" in arrival.error
    assert decode.blocks.num_used == 0


def test_a_seat_past_its_lease_is_reported_and_asked_about_again_each_lease(decode):
    seats = SeatTable(decode, worker_id=1, in_place=True)
    seats.reserve("a", 40, 0, writer=0)
    assert seats.overdue(lease=10) == []
    assert [h.key for h in seats.overdue(lease=0)] == ["a"]
    seats.abort("a")  # aborted: it waits for its writer's last word, which may have been lost...
    assert seats.overdue(lease=10) == []
    assert [h.key for h in seats.overdue(lease=0)] == ["a"]  # ...so its writer is asked again
    seats.on_message(end_message("a", wire.CANCELLED))
    assert seats.overdue(lease=0) == [] and decode.blocks.num_used == 0


def test_a_seat_asked_again_while_the_old_one_awaits_its_writer_is_not_now_not_an_error(decode):
    """Defect (12 long replies streaming, a switch to 1P1D): a move the source refused was asked
    for again on the same decode worker before the source's cancel, which travels on the KV
    channel, reached it; "a seat for 'x.1' already exists" then ended the reply with an error."""
    seats = SeatTable(decode, worker_id=1, in_place=True)
    first = seats.reserve("x.1", 40, 0, writer=0)
    assert seats.reserve("x.1", 40, 0, writer=0) is None  # not now: ask again once it has gone
    assert decode.blocks.num_used == len(first)
    seats.on_message(end_message("x.1", wire.CANCELLED, reason="the move was refused"))
    assert decode.blocks.num_used == 0
    assert len(seats.reserve("x.1", 40, 0, writer=0)) == len(first)
    decode.blocks.check_integrity()
