"""Beam search against a straightforward reference beam search over transformers' logits, on a tiny model
whose EOS is likely enough that beams complete early; beams share KV blocks; preempted beams roll back."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.compilation.compile_cache import num_backend_compiles
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.engine.beam_search import BeamSearchGroup
from jaxserve.sampling_params import BeamSearchParams
from jaxserve.testing.tiny_models import make_tiny_model
from tests.generation_fixtures import (
    BUCKETS,
    EOS,
    MAX_MODEL_LEN,
    NUM_KV_BLOCKS,
    HFReference,
    tokens_prompt,
)

PROMPT = [9, 40, 41, 77, 78, 100, 120, 130, 3, 4, 5]


def boost_eos(model_dir) -> None:
    """Scales the EOS row of the output layer so that EOS often is among the top candidates."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 6.0
    model.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("beam")
    model_dir = make_tiny_model(path / "model", "llama", seed=4)
    boost_eos(model_dir)
    (path / "buckets.toml").write_text(BUCKETS)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, buckets=str(path / "buckets.toml"),
              num_kv_blocks=NUM_KV_BLOCKS)
    return llm, HFReference(model_dir), num_backend_compiles()


@pytest.fixture(scope="module")
def llm(setup):
    return setup[0]


def reference_beam_search(hf, prompt, width, max_tokens, *, ignore_eos=False, length_penalty=1.0,
                          stops=lambda generated, token: False):
    """vLLM's algorithm in plain numpy: (tokens incl. prompt, cum_logprob) best first. ``stops(generated, token)``:
    whether the token completes the beam (a stop token or string)."""

    def score(beam):
        tokens, cum = beam
        length = len(tokens) - (1 if tokens[-1] == EOS else 0)
        return cum / length**length_penalty

    beams, completed = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            logprobs = hf.logprobs(tokens)[-1]
            for token in np.argsort(-logprobs, kind="stable")[: 2 * width].tolist():
                beam = (tokens + [token], cum + logprobs[token])
                done = (token == EOS and not ignore_eos) or stops(tokens[len(prompt):], token)
                (completed if done else candidates).append(beam)
        beams = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(completed + beams, key=score, reverse=True)[:width]


def assert_matches_reference(output, reference):
    assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in reference]
    np.testing.assert_allclose([s.cum_logprob for s in output.sequences], [c for _, c in reference], atol=2e-4)


@pytest.mark.parametrize(
    "width, max_tokens, kwargs",
    [(3, 6, {}), (2, 9, {"length_penalty": 0.5}), (4, 5, {"ignore_eos": True}), (1, 7, {"length_penalty": 2.0})],
)
def test_beam_search_equals_a_reference_over_hf_logits(setup, width, max_tokens, kwargs):
    llm, hf, _ = setup
    reference = reference_beam_search(hf, PROMPT, width, max_tokens, **kwargs)
    output = llm.beam_search([tokens_prompt(PROMPT)], BeamSearchParams(width, max_tokens, **kwargs))[0]
    assert_matches_reference(output, reference)
    for seq in output.sequences:
        generated = seq.tokens[len(PROMPT):]
        assert seq.text == llm.get_tokenizer().decode(seq.tokens)  # vLLM's LLM.beam_search decodes all tokens
        assert len(seq.logprobs) == len(generated)
        assert seq.finish_reason == ("stop" if generated[-1] == EOS and not kwargs.get("ignore_eos") else "length")
        for token, entry in zip(generated, seq.logprobs, strict=True):
            assert token in entry and len(entry) == 2 * width


def test_stop_token_ids_and_stop_strings_complete_beams(setup):
    """jaxserve's extension of vLLM's beams: a stop token or a completed stop string ends a beam as EOS does,
    with finish_reason "stop" and its stop_reason; the text ends before it unless include_stop_str_in_output."""
    llm, hf, _ = setup
    tokenizer = llm.get_tokenizer()
    plain = llm.beam_search([tokens_prompt(PROMPT)], BeamSearchParams(3, 6, ignore_eos=True))[0]
    best = plain.sequences[0].tokens[len(PROMPT):]
    stop_token = best[2]
    output = llm.beam_search([tokens_prompt(PROMPT)],
                             BeamSearchParams(3, 6, ignore_eos=True, stop_token_ids=[stop_token]))[0]
    reference = reference_beam_search(hf, PROMPT, 3, 6, ignore_eos=True,
                                      stops=lambda generated, token: token == stop_token)
    assert_matches_reference(output, reference)
    stopped = [s for s in output.sequences if s.tokens[-1] == stop_token]
    assert stopped and all((s.finish_reason, s.stop_reason) == ("stop", stop_token) for s in stopped)
    stop = tokenizer.decode(best[:2])  # the best beam's first two tokens: stopped that early, it ranks first

    def completes_stop(generated, token):
        before = tokenizer.decode(generated, skip_special_tokens=True)
        return tokenizer.decode(generated + [token], skip_special_tokens=True).find(
            stop, max(len(before) - len(stop) + 1, 0)) >= 0

    engine = llm.llm_engine
    for include in (False, True):
        params = BeamSearchParams(3, 6, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
        engine.add_request(f"stop-{include}", tokens_prompt(PROMPT), params)
        (final,) = [o for o in _run(engine) if o.request_id == f"stop-{include}"]
        reference = reference_beam_search(hf, PROMPT, 3, 6, ignore_eos=True, stops=completes_stop)
        assert [PROMPT + c.token_ids for c in final.outputs] == [tokens for tokens, _ in reference]
        first = final.outputs[0]
        full = tokenizer.decode(first.token_ids, skip_special_tokens=True)
        assert (first.token_ids, first.finish_reason, first.stop_reason) == (best[:2], "stop", stop)
        assert first.text == full[: full.find(stop) + (len(stop) if include else 0)]


def _run(engine) -> list:
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    return finished


def test_logprobs_and_seed_of_a_beam_search(setup):
    """logprobs above 2 * beam_width give that many entries per token; a seed makes a sampling beam search
    (temperature > 0) repeat itself, alone or beside another request."""
    llm, _, _ = setup
    (wide,) = llm.beam_search([tokens_prompt(PROMPT)], BeamSearchParams(2, 4, ignore_eos=True, logprobs=7))
    assert all(len(entry) == 7 for seq in wide.sequences for entry in seq.logprobs)
    params = BeamSearchParams(2, 6, ignore_eos=True, temperature=1.5, seed=123)
    first = llm.beam_search([tokens_prompt(PROMPT)], params)[0]
    again = llm.beam_search([tokens_prompt(PROMPT[:5]), tokens_prompt(PROMPT)], params)[1]
    assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]
    with pytest.raises(ValueError, match=r"^Requested sample logprobs of 21, which is greater than max allowed: 20$"):
        llm.beam_search([tokens_prompt(PROMPT)], BeamSearchParams(2, 4, logprobs=21))

def test_some_beams_complete_at_eos(setup):
    """The EOS path is exercised: completed beams of different lengths compete (length penalty)."""
    llm, hf, _ = setup
    output = llm.beam_search([tokens_prompt(PROMPT)], BeamSearchParams(2, 9, length_penalty=0.5))[0]
    assert any(s.tokens[-1] == EOS for s in output.sequences)
    assert len({len(s.tokens) for s in output.sequences}) > 1


def test_several_prompts_and_text_prompts(setup):
    llm, hf, _ = setup
    other = list(range(60, 75))
    params = BeamSearchParams(2, 5)
    both = llm.beam_search([tokens_prompt(PROMPT), tokens_prompt(other)], params)
    assert_matches_reference(both[0], reference_beam_search(hf, PROMPT, 2, 5))
    assert_matches_reference(both[1], reference_beam_search(hf, other, 2, 5))
    text = llm.beam_search(["hello"], params)[0]
    ids = llm.get_tokenizer()("hello").input_ids
    assert_matches_reference(text, reference_beam_search(hf, ids, 2, 5))


def test_beams_share_kv_blocks(llm, monkeypatch):
    engine = llm.llm_engine
    monkeypatch.setattr(engine, "async_scheduling", True)  # the step that forks also dispatches the next (TPU/GPU)
    copies = []
    original = engine.runner.copy_blocks
    monkeypatch.setattr(engine.runner, "copy_blocks", lambda blocks, slots: (copies.append(blocks),
                                                                           original(blocks, slots)))
    prompt = list(range(30, 50))  # 20 tokens: two full blocks and a partial one
    engine.add_request("beams", tokens_prompt(prompt), BeamSearchParams(beam_width=3, max_tokens=6))
    group = engine.requests["beams"]
    while len(group.seqs) < 3:  # the step that reads the prompt's logprobs forks three beams ...
        engine.step()
    # ... and dispatches their first decode: all three write the shared partial block, two copy it
    tables = [list(s.block_table) for s in group.seqs]
    assert all(t[:2] == tables[0][:2] for t in tables) and len({t[2] for t in tables}) == 3
    assert [int(engine.block_manager.ref_counts[b]) for b in tables[0][:2]] == [3, 3]
    assert len(copies) == 1 and len(copies[0]) == 2
    sources = {src for src, _ in copies[0]}
    assert len(sources) == 1 and sources < {t[2] for t in tables}
    for _ in range(3):
        engine.step()
        assert all(s.block_table[:2] == tables[0][:2] for s in group.seqs)  # the full blocks stay shared
        assert [int(engine.block_manager.ref_counts[b]) for b in tables[0][:2]] == [3, 3]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preempted_beams_roll_back_and_give_the_same_result(llm, monkeypatch):
    """Older long requests fill the pool; the newest sequences (the beams) are preempted and recomputed."""
    rollbacks = []
    original = BeamSearchGroup._roll_back
    monkeypatch.setattr(BeamSearchGroup, "_roll_back", lambda self: (rollbacks.append(1), original(self)))
    prompt = list(range(100, 140))
    params = BeamSearchParams(beam_width=4, max_tokens=30)
    expected = llm.beam_search([tokens_prompt(prompt)], params)[0]
    engine = llm.llm_engine
    before = engine.stats.num_preemptions
    for i in range(4):  # 4 x 13 blocks at admission, 4 x 15 at their end: the beams soon lack blocks
        engine.add_request(f"long{i}", tokens_prompt(list(range(3 + i, 103 + i))),
                           SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    engine.step()
    result = llm.beam_search([tokens_prompt(prompt)], params)[0]
    assert engine.stats.num_preemptions > before and rollbacks
    assert [s.tokens for s in result.sequences] == [s.tokens for s in expected.sequences]
    # the second run's prompt comes from the prefix cache, so its logits are summed in another order
    np.testing.assert_allclose([s.cum_logprob for s in result.sequences],
                               [s.cum_logprob for s in expected.sequences], rtol=1e-5)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_reports_the_beams_so_far(llm):
    engine = llm.llm_engine
    engine.add_request("beam-abort", tokens_prompt(PROMPT), BeamSearchParams(beam_width=2, max_tokens=20))
    group = engine.requests["beam-abort"]
    while group.seq.num_output_tokens < 3:
        engine.step()
    expansions = group.seq.num_output_tokens
    out = engine.abort_request("beam-abort")  # a step in flight is dropped
    assert out.finished and [o.finish_reason for o in out.outputs] == ["abort", "abort"]
    assert not engine.has_unfinished_requests()
    # the best so far are those of a search that stops after the same number of expansions
    shorter = llm.beam_search([tokens_prompt(PROMPT)], BeamSearchParams(beam_width=2, max_tokens=expansions))[0]
    assert [PROMPT + o.token_ids for o in out.outputs] == [s.tokens for s in shorter.sequences]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_async_engine_runs_beam_search_requests(llm):
    async def run():
        engine = AsyncLLMEngine(llm.llm_engine)
        outputs = [o async for o in engine.generate(tokens_prompt(PROMPT), BeamSearchParams(3, 6), "beam-async")]
        await engine.shutdown()
        return outputs

    outputs = asyncio.run(run())
    expected = llm.beam_search([tokens_prompt(PROMPT)], BeamSearchParams(3, 6))[0]
    assert len(outputs) == 1 and outputs[0].finished
    final = outputs[0].outputs
    assert [PROMPT + c.token_ids for c in final] == [s.tokens for s in expected.sequences]
    assert [c.index for c in final] == [0, 1, 2]
    eos_free = [c.token_ids[:-1] if c.token_ids[-1] == EOS else c.token_ids for c in final]
    assert [c.text for c in final] == [llm.get_tokenizer().decode(t, skip_special_tokens=True) for t in eos_free]


def test_nothing_compiled_after_warm_up(setup):
    assert num_backend_compiles() == setup[2]
