"""The advisor's sample of steps: the latest few of every shape, for minutes."""

from minipd.server.step_sample import StepSample, shape_of


def step(t: float, prefill: int, decodes: int) -> dict:
    return {"worker": 0, "time": t, "end": t + 0.05, "prefill_tokens": prefill, "decodes": decodes}


def test_shapes_part_prompts_in_powers_of_four_and_decodes_in_powers_of_two():
    assert [shape_of(p, 0)[0] for p in (0, 1, 2, 7, 8, 31, 32, 2048)] == [0, 1, 2, 2, 3, 3, 4, 7]
    assert [shape_of(0, d)[1] for d in (0, 1, 2, 3, 4, 8, 127, 128, 512)] == [0, 1, 2, 2, 3, 4, 7, 8, 8]


def test_each_shape_keeps_its_latest_steps_and_none_older_than_the_horizon():
    sample = StepSample(per_shape=3, kept_for_s=100.0)
    for i in range(10):
        sample.add(step(float(i), 0, 8))  # a decode batch of 8, ten times
    sample.add(step(5.5, 512, 0))  # a prompt read alone, once
    kept = sample.steps(now=20.0)
    assert [s["time"] for s in kept] == [5.5, 7.0, 8.0, 9.0]  # in time order
    assert [s["time"] for s in sample.steps(now=108.0)] == [8.0, 9.0]  # the prompt's step and the oldest decodes aged out
    sample.clear()
    assert sample.steps(now=20.0) == []
