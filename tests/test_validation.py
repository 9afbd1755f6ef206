"""Bad input raises ValueError naming the field, and never disturbs other requests."""

from __future__ import annotations

import pytest

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.request import RequestStatus


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", max_model_len=128)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(n=0), "n"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(logprobs=-1), "logprobs"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="prompt.*empty"):
        llm.generate([""])
    with pytest.raises(ValueError, match="prompt.*empty"):
        llm.generate([[]])


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt: 200 tokens.*max_model_len=128"):
        llm.generate([[1, 2, 3], [5] * 200])


def test_token_ids_out_of_vocab(llm):
    with pytest.raises(ValueError, match="prompt: token ids must be in"):
        llm.generate([[10**7]])


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match="^model: "):
        LLM(model=str(tmp_path / "nope"))


def test_bad_engine_args(tiny_llama):
    with pytest.raises(ValueError, match="^kv_cache_memory"):
        LLM(model=str(tiny_llama), kv_cache_memory="lots")
    with pytest.raises(ValueError, match="^block_size"):
        LLM(model=str(tiny_llama), block_size=0)
    with pytest.raises(ValueError, match="^dtype"):
        LLM(model=str(tiny_llama), dtype="int3")


def test_bad_batch_leaves_engine_clean(llm):
    """A rejected generate() queues nothing; the next call works normally."""
    good = SamplingParams(max_tokens=5, temperature=0)
    expected = llm.generate([[1, 2, 3]], good)[0].outputs[0].token_ids
    with pytest.raises(ValueError):
        llm.generate([[1, 2, 3], [5] * 500], good)
    assert not llm.engine.has_unfinished()
    assert llm.generate([[1, 2, 3]], good)[0].outputs[0].token_ids == expected


def test_bad_request_does_not_disturb_running_ones(llm):
    """Requests already running keep going, with unchanged output, when another
    request is rejected or aborted in the middle of their generation."""
    engine = llm.engine
    greedy = SamplingParams(max_tokens=12, temperature=0)
    expected = [o.outputs[0].token_ids for o in llm.generate([[4, 5, 6], [7, 8, 9, 10]], greedy)]

    engine.add_request("a", [4, 5, 6], greedy)
    engine.add_request("b", [7, 8, 9, 10], greedy)
    engine.add_request("victim", [11, 12], SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    engine.step()
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("bad", [1] * 1000, greedy)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("a", [1], greedy)
    engine.abort("victim")
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    assert set(done) == {"a", "b"}
    assert [done["a"].outputs[0].token_ids, done["b"].outputs[0].token_ids] == expected
    assert all(o.outputs[0].finish_reason == RequestStatus.FINISHED_LENGTH.value for o in done.values())
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_blocks
