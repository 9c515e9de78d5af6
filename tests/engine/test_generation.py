"""Generation features end to end on a tiny model: penalties and logit_bias against transformers' logits,
seeded sampling alone vs batched (and across preemption), stop strings split across tokens, min_tokens,
logprobs and prompt logprobs against log_softmax of transformers' logits, n / best_of sharing KV blocks,
output kinds, finish reasons, chat, every engine-level validation error, and no compile after warm-up."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.compilation.compile_cache import num_backend_compiles
from jaxserve.sampling_params import BeamSearchParams, RequestOutputKind
from tests.generation_fixtures import EOS, LETTERS, HFReference, build_llm, tokens_prompt

PROMPT = list(range(5, 21))  # 16 tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir, llm = build_llm(tmp_path_factory.mktemp("gen"))
    return llm, HFReference(model_dir), num_backend_compiles()


@pytest.fixture(scope="module")
def llm(setup):
    return setup[0]


@pytest.fixture(scope="module")
def hf(setup):
    return setup[1]


def one(llm, prompt, params):
    return llm.generate([tokens_prompt(prompt)], params, use_tqdm=False)[0]


def run_to_completion(engine, request_id, prompt, params):
    engine.add_request(request_id, tokens_prompt(prompt), params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


# ----- logits processing end to end --------------------------------------------------------------------


def test_greedy_penalties_and_logit_bias_follow_a_reference_over_hf_logits(llm, hf):
    bias = {LETTERS["a"]: 2.5, LETTERS["b"]: -4.0, 100: 3.0}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.6,
                            frequency_penalty=0.5, presence_penalty=0.4, logit_bias=bias)
    generated: list[int] = []
    for _ in range(12):
        logits = hf.logits(PROMPT + generated)[-1]
        for token, value in bias.items():
            logits[token] += value
        counts = np.bincount(generated, minlength=logits.size)
        seen = (counts > 0) | np.isin(np.arange(logits.size), PROMPT)
        logits = np.where(seen, np.where(logits > 0, logits / 1.6, logits * 1.6), logits)
        logits = logits - 0.5 * counts - 0.4 * (counts > 0)
        generated.append(int(logits.argmax()))
    out = one(llm, PROMPT, params).outputs[0]
    assert out.token_ids == generated
    plain = one(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)).outputs[0]
    assert plain.token_ids != generated  # the parameters changed the output


@pytest.mark.parametrize(("penalty", "on_the_device"), [(1e300, np.finfo(np.float32).max),
                                                        (1e-300, np.finfo(np.float32).tiny)])
def test_a_repetition_penalty_beyond_float32_acts_as_float32s_limit(llm, penalty, on_the_device):
    """vLLM takes any finite positive repetition_penalty; one beyond float32's range is held at its limit, not cast
    to inf or 0 (a NaN logit, a division by zero)."""
    params = lambda value: SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "overflow encountered in cast" fails the test
        extreme = one(llm, PROMPT, params(penalty)).outputs[0].token_ids
    assert extreme == one(llm, PROMPT, params(float(on_the_device))).outputs[0].token_ids


def every_parameter(seed: int, **overrides) -> SamplingParams:
    return SamplingParams(**{
        "temperature": 0.9, "top_k": 40, "top_p": 0.9, "min_p": 0.02, "presence_penalty": 0.3,
        "frequency_penalty": 0.2, "repetition_penalty": 1.1, "logit_bias": {LETTERS["c"]: 1.5},
        "min_tokens": 4, "seed": seed, "max_tokens": 20, "logprobs": 3, **overrides,
    })


def test_seeded_requests_with_every_parameter_are_the_same_alone_and_batched(llm):
    mine = every_parameter(11)
    alone = one(llm, PROMPT, mine).outputs[0]
    others = [
        SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=25, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, top_k=5, max_tokens=18, logit_bias={LETTERS["d"]: 5.0}, min_tokens=2),
        SamplingParams(temperature=1.2, top_p=0.5, seed=8, max_tokens=22, presence_penalty=-0.5, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=10, frequency_penalty=1.0, ignore_eos=True),
    ]
    prompts = [list(range(30 + i, 40 + 3 * i)) for i in range(5)]
    batch = llm.generate([tokens_prompt(p) for p in prompts[:2] + [PROMPT] + prompts[2:]],
                         others[:2] + [mine] + others[2:], use_tqdm=False)
    batched = batch[2].outputs[0]
    assert batched.token_ids == alone.token_ids and batched.text == alone.text
    assert [list(d) for d in batched.logprobs] == [list(d) for d in alone.logprobs]
    np.testing.assert_allclose(batched.cumulative_logprob, alone.cumulative_logprob, rtol=1e-5)
    assert len(alone.token_ids) >= 4


def test_preemption_recomputes_counts_and_keeps_seeded_outputs(llm):
    """8 requests of 100 tokens need 104 blocks of the pool's 64: sequences are preempted and recomputed."""
    prompts = [list(range(3 + i, 63 + i)) for i in range(8)]
    params = [every_parameter(100 + i, max_tokens=40, min_tokens=0, ignore_eos=True, logprobs=None)
              for i in range(8)]
    alone = [one(llm, p, sp).outputs[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    engine = llm.llm_engine
    before = engine.stats.num_preemptions
    batched = llm.generate([tokens_prompt(p) for p in prompts], params, use_tqdm=False)
    assert engine.stats.num_preemptions > before
    assert [o.outputs[0].token_ids for o in batched] == alone
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.step_runner.slots.num_free == engine.step_runner.slots.num_slots


def test_async_scheduling_changes_nothing(llm, monkeypatch):
    """Tokens read back one step late (placeholders fed on the device) give the same outputs as reading
    every step at once: penalties count fed tokens, stops drop the extra rows, forks happen at dispatch."""
    requests = [
        (PROMPT, every_parameter(31)),
        (list(range(50, 75)), letters_params(n=3, stop=["dab", "ce"], logprobs=2)),
        (list(range(80, 90)), SamplingParams(temperature=0.0, max_tokens=9, logit_bias={EOS: 6.0}, min_tokens=3)),
        (list(range(7, 47)), SamplingParams(n=2, best_of=3, temperature=1.1, seed=4, max_tokens=7,
                                            frequency_penalty=0.8, prompt_logprobs=2)),
    ]
    engine = llm.llm_engine
    runs = {}
    for mode in (False, True):
        monkeypatch.setattr(engine, "async_scheduling", mode)  # the engine's own mode comes back after the test
        outputs = llm.generate([tokens_prompt(p) for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)
        runs[mode] = [(o.prompt_logprobs is None, [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason,
                                                   None if c.logprobs is None else [list(d) for d in c.logprobs])
                                                  for c in o.outputs]) for o in outputs]
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert runs[True] == runs[False]
    assert any(c[3] == "stop" for c in runs[True][1][1])  # some samples stopped mid-stream


# ----- stopping ----------------------------------------------------------------------------------------


def letters_params(**kwargs) -> SamplingParams:
    """Sampling among a-e only (a strong bias), so the text is plain ASCII, one character per token."""
    bias = {LETTERS[ch]: 40.0 for ch in "abcde"}
    return SamplingParams(temperature=1.0, seed=21, max_tokens=24, logit_bias=bias, **kwargs)


def test_stop_string_split_across_tokens(llm):
    free = one(llm, PROMPT, letters_params()).outputs[0]
    text = free.text
    assert len(text) == 24 and set(text) <= set("abcde")
    stop = text[5:8]  # three tokens
    first = text.find(stop)
    out = one(llm, PROMPT, letters_params(stop=[stop, "zzz"])).outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:first], "stop", stop)
    assert out.token_ids == free.token_ids[: first + 3]  # the token that completed the stop string is kept
    kept = one(llm, PROMPT, letters_params(stop=stop, include_stop_str_in_output=True)).outputs[0]
    assert kept.text == text[: first + 3]


def test_min_tokens_suppresses_eos_and_stop_token_ids(llm):
    to_eos = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={EOS: 100.0})
    out = one(llm, PROMPT, to_eos).outputs[0]
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == ([EOS], "", "stop", None)
    held = one(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=10, logit_bias={EOS: 100.0},
                                            min_tokens=5)).outputs[0]
    assert len(held.token_ids) == 6 and EOS not in held.token_ids[:5] and held.token_ids[5] == EOS
    assert (held.finish_reason, held.stop_reason) == ("stop", None)
    a = LETTERS["a"]
    stop_token = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={a: 100.0}, stop_token_ids=[a],
                                min_tokens=3)
    out = one(llm, PROMPT, stop_token).outputs[0]
    assert len(out.token_ids) == 4 and a not in out.token_ids[:3] and out.token_ids[3] == a
    assert (out.finish_reason, out.stop_reason) == ("stop", a)
    assert not out.text.endswith("a")  # a stop token's text is not part of the output ...
    with_stop = one(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=10, logit_bias={a: 100.0},
                                                stop_token_ids=[a], min_tokens=3,
                                                include_stop_str_in_output=True)).outputs[0]
    assert with_stop.text == out.text + "a"  # ... unless asked for


def test_special_tokens_in_the_text(llm):
    tokenizer = llm.get_tokenizer()
    base = dict(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={EOS: 100.0})
    hidden = one(llm, PROMPT, SamplingParams(**base)).outputs[0]
    assert hidden.token_ids == [EOS] * 3 and hidden.text == ""
    for spaces in (True, False):
        shown = one(llm, PROMPT, SamplingParams(**base, skip_special_tokens=False,
                                                spaces_between_special_tokens=spaces)).outputs[0]
        expected = tokenizer.decode([EOS] * 3, skip_special_tokens=False, spaces_between_special_tokens=spaces)
        assert shown.text == expected and "</s>" in expected


def test_finish_reasons_length_and_abort(llm):
    out = one(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)).outputs[0]
    assert (len(out.token_ids), out.finish_reason, out.stop_reason) == (3, "length", None)
    engine = llm.llm_engine
    engine.add_request("to-abort", tokens_prompt(PROMPT), SamplingParams(n=2, seed=1, max_tokens=30))
    engine.step()
    engine.step()
    aborted = engine.abort_request("to-abort")
    assert aborted.finished and [o.finish_reason for o in aborted.outputs] == ["abort", "abort"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ----- logprobs -----------------------------------------------------------------------------------------


def test_logprobs_and_prompt_logprobs_match_log_softmax_of_hf_logits(llm, hf, monkeypatch):
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 259, size=70)]  # prefilled as 64 + 6
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True, logprobs=4, prompt_logprobs=3)
    runner = llm.llm_engine.runner
    program, runs = runner.compile_prompt_logprobs(), []
    monkeypatch.setattr(runner, "_prompt_logprobs_executable", lambda *args: runs.append(1) or program(*args))
    result = one(llm, prompt, params)
    assert len(runs) == 2  # after each of the two prefill steps; never after a decode step
    out = result.outputs[0]
    ref = hf.logprobs(prompt + out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        check_position(entry, token, ref[len(prompt) - 1 + i], 4, llm)
    expected_cum = sum(ref[len(prompt) - 1 + i][t] for i, t in enumerate(out.token_ids))
    np.testing.assert_allclose(out.cumulative_logprob, expected_cum, atol=1e-4)
    assert len(result.prompt_logprobs) == 70 and result.prompt_logprobs[0] is None
    for p in range(1, 70):
        check_position(result.prompt_logprobs[p], prompt[p], ref[p - 1], 3, llm)
    no_logprobs = one(llm, prompt, SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True))
    assert no_logprobs.outputs[0].token_ids == out.token_ids  # asking for logprobs changes no token
    assert (no_logprobs.outputs[0].logprobs, no_logprobs.outputs[0].cumulative_logprob) == (None, None)
    assert no_logprobs.prompt_logprobs is None
    assert len(runs) == 2  # no row of its steps asked


def check_position(entry, token, ref_row, k, llm):
    """vLLM's dict: the chosen token first (its true rank), then the top k (ranks 1..k) with decoded text."""
    top = np.argsort(-ref_row)[:k].tolist()
    assert list(entry)[0] == token and list(entry)[1:] == [t for t in top if t != token]
    assert entry[token].rank == int(np.sum(ref_row >= ref_row[token]))
    for rank, t in enumerate(top, start=1):
        assert entry[t].rank == rank
    for t, lp in entry.items():
        np.testing.assert_allclose(lp.logprob, ref_row[t], atol=1e-4)
        assert lp.decoded_token == llm.get_tokenizer().decode([t])


def test_logprobs_zero_and_cap(llm):
    out = one(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=0)).outputs[0]
    assert [list(d) for d in out.logprobs] == [[t] for t in out.token_ids]
    assert all(d[t].rank == 1 for d, t in zip(out.logprobs, out.token_ids, strict=True))
    full = one(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=20)).outputs[0]
    assert [len(d) for d in full.logprobs] == [20, 20]


# ----- n and best_of --------------------------------------------------------------------------------------


def test_n_samples_share_the_prompt_blocks_copy_on_write_and_are_reproducible(llm):
    engine = llm.llm_engine
    prompt = list(range(40, 60))  # 20 tokens: blocks of 8, 8 and a partial 4
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    engine.add_request("n3", tokens_prompt(prompt), params)
    group = engine.requests["n3"]
    while len(group.seqs) < 3:  # the prefill step that samples the first token forks two children
        engine.step()
    tables = [list(s.block_table) for s in group.seqs]
    assert len(tables) == 3 and tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    assert [int(engine.block_manager.ref_counts[b]) for b in tables[0]] == [3, 3, 3]
    engine.step()  # decode: the last, partial block is written by all three, so two of them copy it
    tables = [s.block_table for s in group.seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    assert engine.block_manager.num_used_blocks == 5
    while engine.has_unfinished_requests():
        engine.step()
    first = one(llm, prompt, params)
    again = one(llm, prompt, params)
    tokens = [o.token_ids for o in first.outputs]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert tokens == [o.token_ids for o in again.outputs]
    assert len({tuple(t) for t in tokens}) == 3
    assert tokens[0] == one(llm, prompt, SamplingParams(temperature=1.0, seed=5, max_tokens=8,
                                                        ignore_eos=True)).outputs[0].token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_forked_samples_read_the_shared_and_copied_blocks_correctly(llm):
    """Samples through the random path restricted to their top token (top_k 1) follow the greedy path: the forks'
    KV is the parent's. (Not a low temperature: vLLM's floor of 0.01 lets 5% of samples leave this path at its
    fifth token, whose top-2 logit gap is 0.025.)"""
    prompt = list(range(40, 61))
    greedy = one(llm, prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)).outputs[0]
    cold = one(llm, prompt, SamplingParams(n=4, temperature=1.0, top_k=1, seed=2, max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in cold.outputs] == [greedy.token_ids] * 4


def test_best_of_keeps_the_n_highest_cumulative_logprobs(llm):
    four = one(llm, PROMPT, SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=6, ignore_eos=True, logprobs=0))
    ranked = sorted(four.outputs, key=lambda o: o.cumulative_logprob, reverse=True)
    best = one(llm, PROMPT, SamplingParams(n=2, best_of=4, temperature=1.0, seed=9, max_tokens=6, ignore_eos=True,
                                           logprobs=0))
    assert [o.token_ids for o in best.outputs] == [o.token_ids for o in ranked[:2]]
    assert [o.index for o in best.outputs] == [0, 1]
    np.testing.assert_allclose([o.cumulative_logprob for o in best.outputs],
                               [o.cumulative_logprob for o in ranked[:2]], rtol=1e-6)
    streamed = run_to_completion(llm.llm_engine, "best-of-stream", PROMPT, SamplingParams(
        n=2, best_of=4, temperature=1.0, seed=9, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.DELTA))
    assert len(streamed) == 1 and streamed[0].finished  # the best are only known at the end
    assert [o.token_ids for o in streamed[0].outputs] == [o.token_ids for o in ranked[:2]]


# ----- output kinds -------------------------------------------------------------------------------------


def _stop_in_the_first_sample_only(llm) -> str:
    """Three letters that the first of two seeded samples writes before its end and the second never writes: with
    them as a stop string one sample stops mid-stream and the other runs to its length."""
    first, second = (o.text for o in one(llm, PROMPT, letters_params(n=2)).outputs)
    candidates = (first[i : i + 3] for i in range(len(first) - 4))
    return next(stop for stop in candidates if stop not in second and first.find(stop) > 0)


def test_cumulative_and_delta_streams(llm):
    engine = llm.llm_engine
    stop = _stop_in_the_first_sample_only(llm)
    final = one(llm, PROMPT, letters_params(n=2, stop=stop, logprobs=1))
    assert [o.finish_reason for o in final.outputs] == ["stop", "length"]  # one stops mid-stream
    cumulative = run_to_completion(engine, "cum", PROMPT, letters_params(n=2, stop=stop, logprobs=1))
    for out in cumulative:
        for c in out.outputs:
            assert final.outputs[c.index].text.startswith(c.text)  # text that may start a stop is held back
    assert [c.text for c in cumulative[-1].outputs] == [c.text for c in final.outputs]
    deltas = run_to_completion(engine, "delta", PROMPT, letters_params(
        n=2, stop=stop, logprobs=1, output_kind=RequestOutputKind.DELTA))
    assert deltas[-1].finished and not any(o.finished for o in deltas[:-1])
    for index, expected in enumerate(final.outputs):
        parts = [c for o in deltas for c in o.outputs if c.index == index]
        assert "".join(c.text for c in parts) == expected.text
        assert sum((c.token_ids for c in parts), []) == expected.token_ids
        assert [list(d) for c in parts for d in c.logprobs] == [list(d) for d in expected.logprobs]
        assert parts[-1].finish_reason == expected.finish_reason
    assert len(run_to_completion(engine, "final", PROMPT, letters_params(
        output_kind=RequestOutputKind.FINAL_ONLY))) == 1


# ----- chat ----------------------------------------------------------------------------------------------


def test_chat_renders_the_template_and_generates(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    conversation = [{"role": "user", "content": "hi"}]
    out = llm.chat(conversation, params, use_tqdm=False)
    assert len(out) == 1 and out[0].prompt == "<user>hi\n<assistant>"
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("<user>hi\n<assistant>", add_special_tokens=False)
    assert out[0].prompt_token_ids == ids
    assert out[0].outputs[0].token_ids == one(llm, ids, params).outputs[0].token_ids
    two = llm.chat([conversation, [{"role": "user", "content": "yo"}]], params, use_tqdm=False)
    assert [o.prompt for o in two] == ["<user>hi\n<assistant>", "<user>yo\n<assistant>"]
    custom = llm.chat(conversation, params, use_tqdm=False, chat_template="{{ messages[0]['content'] }}!")
    assert custom[0].prompt == "hi!"
    cont = llm.chat(conversation + [{"role": "assistant", "content": "Hel"}], params, use_tqdm=False,
                    add_generation_prompt=False, continue_final_message=True)
    assert cont[0].prompt == "<user>hi\n<assistant>Hel"


def test_chat_errors(llm):
    conversation = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"^continue_final_message and add_generation_prompt cannot both be True"):
        llm.chat(conversation, continue_final_message=True, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^each chat message must be a dict with a 'role', got 'hi'$"):
        llm.chat(["hi"], use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        with pytest.raises(ValueError, match=r"^this model's tokenizer has no chat template and none was given"):
            llm.chat(conversation, use_tqdm=False)
    finally:
        tokenizer.chat_template = template


# ----- token filters and prompt truncation (vLLM's allowed_token_ids, bad_words, truncate_prompt_tokens) ------


def hf_greedy(hf, prompt: list[int], num_tokens: int, banned) -> list[int]:
    """transformers' greedy tokens with ``banned(output so far)`` -> token ids set to -inf at each step."""
    output: list[int] = []
    for _ in range(num_tokens):
        logits = hf.logits(prompt + output)[-1]
        logits[list(banned(output))] = -np.inf
        output.append(int(np.argmax(logits)))
    return output


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, **kwargs)


def test_allowed_token_ids_sample_only_those_tokens(llm, hf):
    allowed = [LETTERS["a"], LETTERS["c"], 100]
    out = one(llm, PROMPT, greedy(allowed_token_ids=allowed)).outputs[0]
    others = sorted(set(range(hf.logits(PROMPT).shape[-1])) - set(allowed))
    assert out.token_ids == hf_greedy(hf, PROMPT, 10, lambda _: others)
    assert set(out.token_ids) <= set(allowed)


def _vllm_bad_word_bans(words: list[list[int]]):
    """vLLM's rule, written out: a word's last token is banned where the output ends with its other tokens."""
    return lambda output: {w[-1] for w in words if len(w) - 1 <= len(output)
                           and output[len(output) - len(w) + 1:] == w[:-1]}


def _letters_only(output: list[int]) -> set[int]:
    return set(range(320)) - set(LETTERS.values())


def test_bad_words_of_one_and_several_tokens_follow_vllms_rule(llm, hf):
    """Among the letters a-j (one byte token each, so the words tokenize back to the same tokens)."""
    letters = list(LETTERS.values())
    plain = one(llm, PROMPT, greedy(allowed_token_ids=letters)).outputs[0].token_ids
    tokenizer = llm.get_tokenizer()
    one_token, two_tokens = tokenizer.decode(plain[:1]), tokenizer.decode(plain[3:5])
    words = [tokenizer.encode(w, add_special_tokens=False) for w in (one_token, two_tokens)]
    assert words == [plain[:1], plain[3:5]]  # " word" is one token longer: not a second form (vLLM)
    out = one(llm, PROMPT, greedy(allowed_token_ids=letters, bad_words=[one_token, two_tokens])).outputs[0]
    bans = _vllm_bad_word_bans(words)
    expected = hf_greedy(hf, PROMPT, 10, lambda output: bans(output) | _letters_only(output))
    assert out.token_ids == expected and expected != plain
    assert expected[0] != plain[0]  # the one-token word is banned from the start


def test_bad_words_with_a_batch_neighbour(llm, hf):
    """A multi-token word's mask follows the request's own output; a request in the same steps is untouched."""
    letters = list(LETTERS.values())
    plain = one(llm, PROMPT, greedy(allowed_token_ids=letters)).outputs[0].token_ids
    word = llm.get_tokenizer().decode(plain[2:4])
    filtered, unfiltered = llm.generate(
        [tokens_prompt(PROMPT)] * 2,
        [greedy(allowed_token_ids=letters, bad_words=[word]), greedy(allowed_token_ids=letters)], use_tqdm=False)
    bans = _vllm_bad_word_bans([plain[2:4]])
    expected = hf_greedy(hf, PROMPT, 10, lambda output: bans(output) | _letters_only(output))
    assert filtered.outputs[0].token_ids == expected != plain
    assert unfiltered.outputs[0].token_ids == plain


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    out = one(llm, PROMPT, greedy(truncate_prompt_tokens=5))
    alone = one(llm, PROMPT[-5:], greedy())
    assert out.prompt_token_ids == PROMPT[-5:]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert one(llm, PROMPT, greedy(truncate_prompt_tokens=-1)).prompt_token_ids == PROMPT  # -1: max_model_len


# ----- engine-level validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(logprobs=21), "Requested sample logprobs of 21, which is greater than max allowed: 20"),
        (SamplingParams(prompt_logprobs=25), "Requested prompt logprobs of 25, which is greater than max allowed: 20"),
        (SamplingParams(top_k=321), "top_k cannot be greater than vocabulary size(320), but got 321."),
        (SamplingParams(logit_bias={5: 1.0, 320: 2.0, -1: 1.0}),
         "token_id(s) [-1, 320] in logit_bias contain out-of-vocab token ids. Vocabulary size: 320"),
        (SamplingParams(n=2, best_of=9), "best_of=9 sequences cannot run at once: max_num_seqs is 8"),
        (SamplingParams(allowed_token_ids=[5, 320]), "allowed_token_ids contains out-of-vocab token id!"),
        (SamplingParams(truncate_prompt_tokens=129),
         "truncate_prompt_tokens value (129) is greater than max_model_len (128). Please, select a smaller "
         "truncation size."),
        (BeamSearchParams(beam_width=11, max_tokens=4),
         "beam_width=11 needs the top 22 logprobs per step, more than max_logprobs=20; raise max_logprobs or "
         "lower beam_width"),
        (BeamSearchParams(beam_width=6, max_tokens=100),
         "beam_width=6 beams of up to 116 tokens need up to 90 KV blocks, more than the pool's 64"),
    ],
)
def test_engine_validation_errors(llm, params, message):
    engine = llm.llm_engine
    with pytest.raises(ValueError) as err:
        engine.add_request("invalid", tokens_prompt(PROMPT), params)
    assert str(err.value) == message
    assert "invalid" not in engine.requests and not engine.has_unfinished_requests()


def test_a_priority_needs_the_priority_policy(llm):
    """vLLM's message; this engine schedules first come, first served."""
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"^Got priority 1 but Priority scheduling is not enabled\.$"):
        engine.add_request("prioritized", tokens_prompt(PROMPT), SamplingParams(), priority=1)
    assert "prioritized" not in engine.requests and not engine.has_unfinished_requests()


def test_engine_rejects_other_params_and_long_requests(llm):
    engine = llm.llm_engine
    with pytest.raises(TypeError, match=r"^params must be SamplingParams or BeamSearchParams, got dict$"):
        engine.add_request("bad", tokens_prompt(PROMPT), {"temperature": 0.0})
    with pytest.raises(ValueError, match="maximum context length is 128 tokens"):
        engine.add_request("long", tokens_prompt(PROMPT), BeamSearchParams(beam_width=2, max_tokens=120))
    assert not engine.has_unfinished_requests()


def test_nothing_compiled_after_warm_up(setup):
    """Runs last in this file: every feature above used only the warmed-up executables."""
    assert num_backend_compiles() == setup[2]
