"""Pieces of the main process, without processes: token order, who holds a request."""

from minipd.sampling_params import SamplingParams
from minipd.server.metrics import Metrics
from minipd.server.relay import Relay
from minipd.server.request_state import Placement, RequestState
from minipd.workers import messages as m


def test_tokens_from_two_workers_are_relayed_in_order():
    """Defect: the prefill worker's first token and the decode worker's next ones come through
    different sockets; read out of order, the reply was garbled (or lost its first token)."""
    relay = Relay(Metrics("m"))
    state = RequestState("r", [1, 2], SamplingParams(max_tokens=3), None)
    second = m.Tokens("r.1", 1, [20], 2.0, index=1)
    third = m.Tokens("r.1", 1, [30], 3.0, finished=True, finish_reason="length", index=2)
    first = m.Tokens("r.1", 0, [10], 1.0, index=0)
    assert relay.in_order(state, second) == [] and relay.in_order(state, third) == []
    ready = relay.in_order(state, first)
    assert [t.token_ids for t in ready] == [[10], [20], [30]]
    reasons = [relay.tokens(state, t)[0] for t in ready]
    assert reasons == [None, None, "length"] and state.output_token_ids == [10, 20, 30]
    assert relay.in_order(state, first) == []  # a duplicate of something already relayed


def test_a_prefill_worker_stops_holding_a_request_once_its_kv_arrived():
    p = Placement("r.1", worker=0, reader=1, dispatched=True)
    assert p.holders == {0, 1}
    p.kv_arrived = True
    assert p.holders == {1}  # its death no longer redoes a request that decodes happily elsewhere
    assert Placement("r.1", worker=0, reader=1).holders == {1}  # not dispatched: only the seat is held
