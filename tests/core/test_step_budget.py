"""The mixed-step token budget from a latency target and step costs, alone and as the scheduler uses it."""

import random

import pytest

from jaxserve.core.block_manager import BlockManager
from jaxserve.core.buckets import BucketGrid, MixedBucket
from jaxserve.core.cost_model import StepCosts
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sequence import SequenceStatus
from jaxserve.core.step_budget import StepBudget
from tests.core.test_scheduler import SPEC, advance, make_scheduler, make_seq, start_mixed_decoders

BUDGET_SPEC = SPEC.replace(mixed_batch_sizes=(4, 8), mixed_token_counts=(8, 16, 32, 64))
# 10 ms per step plus 1 ms per token; 8 rows cost 2 ms more than 4
COSTS = StepCosts.from_seconds({(t, b): (10 + t + (2 if b == 8 else 0)) / 1e3 for t in (8, 16, 32, 64)
                                for b in (4, 8)})


def grid(budget=64) -> BucketGrid:
    return BucketGrid(BUDGET_SPEC, block_size=4, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=budget,
                      num_blocks=256)


@pytest.mark.parametrize(("target_ms", "decode_rows", "tokens"), [
    (100, 0, 64), (74, 0, 64), (73.9, 0, 32), (42, 2, 32), (42, 3, 32), (43.9, 4, 16), (44, 4, 32),
    (20, 1, 8), (5, 2, 8),  # nothing within 5 ms: the smallest bucket with room for a chunk
    (5, 7, 8),  # 7 decode rows: the 8-token bucket still has room for a chunk
])
def test_the_budget_is_the_largest_bucket_within_the_target(target_ms, decode_rows, tokens):
    assert StepBudget(grid(), 64, target_ms, COSTS).mixed_tokens(decode_rows) == tokens


def test_without_a_target_or_costs_the_budget_is_the_largest_mixed_bucket_within_the_token_budget():
    assert StepBudget(grid(), 64).mixed_tokens(3) == 64
    assert StepBudget(grid(), 64, 20.0).mixed_tokens(3) == 64  # a target without costs cannot be followed
    assert StepBudget(grid(48), 48, 1000.0, COSTS).mixed_tokens(3) == 32  # 64 is past max_num_batched_tokens
    assert StepBudget(grid(), 64).describe() == "mixed steps up to 64 tokens (no --max-itl-ms)"


@pytest.mark.parametrize("bad", [0, -5.0])
def test_a_target_must_be_positive(bad):
    with pytest.raises(ValueError, match=f"max_itl_ms must be a positive number of milliseconds, got {bad}"):
        StepBudget(grid(), 64, bad, COSTS)


def budget_scheduler(target_ms: float, spec=BUDGET_SPEC, **kwargs):
    sched = make_scheduler(spec=spec, budget=64, num_blocks=256, **kwargs)
    sched.step_budget = StepBudget(sched.bucket_grid, 64, target_ms, COSTS)
    return sched


QUEUE_SPEC = BUDGET_SPEC.replace(mixed_token_budget=8)  # untargeted steps of 8 tokens


# no cost per step, 1 ms per token: two snug steps cost less than one padded one
TOKEN_COSTS = StepCosts.from_seconds({(t, b): t / 1e3 for t in (8, 16, 32, 64) for b in (4, 8)})


@pytest.mark.parametrize(("decode_rows", "pending", "costs", "tokens"), [
    (2, 5, COSTS, 8),  # at least the untargeted budget
    (2, 14, COSTS, 16),  # the pending prompts in one step
    (2, 28, COSTS, 32),  # one 32-token step (42 ms) costs less than 16 then 16 (52 ms)
    (2, 28, TOKEN_COSTS, 32),  # 32 against 16 then 16: a tie goes to one step
    (2, 18, TOKEN_COSTS, 16),  # 32 against 16 then 8 (24 ms): the first of two steps
    (2, 29, COSTS, 32),  # 31 tokens: one 32-token step either way
    (2, 300, COSTS, 32),  # a long queue: the target's ceiling (64 would take 74 ms)
    (2, None, COSTS, 32),  # unknown queue: the ceiling
])
def test_under_the_ceiling_the_queue_goes_in_one_step_or_the_cheaper_two(decode_rows, pending, costs, tokens):
    grid = BucketGrid(QUEUE_SPEC, block_size=4, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                      num_blocks=256)
    assert StepBudget(grid, 64, 50.0, costs).mixed_tokens(decode_rows, pending) == tokens


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("target_ms", [20.0, 30.0, 50.0])
def test_a_step_with_decode_rows_never_exceeds_the_target_bucket(seed, target_ms):
    """Random arrivals and lengths: every mixed step's bucket stays within the target's budget for its decode
    rows (and so within the target, which some bucket meets here); every request finishes. The untargeted
    budget (8 tokens) is within every target and every shape is measured, so a backlog has nothing to grow to."""
    rng = random.Random(seed)
    sched = budget_scheduler(target_ms, QUEUE_SPEC)
    arrivals = {rng.randrange(60): None for _ in range(12)}
    seqs, steps = [], 0
    while steps < 2000 and (sched.has_unfinished() or any(t >= steps for t in arrivals)):
        if steps in arrivals:
            seqs.append(make_seq(f"r{steps}", rng.randint(2, 40), float(steps), max_tokens=rng.randint(2, 12)))
            sched.add(seqs[-1])
        s = sched.schedule()
        if s.is_mixed:
            decode_rows = len(s.decode_seqs)
            assert s.bucket.num_tokens <= sched.step_budget.mixed_tokens(decode_rows)
            assert 1e3 * COSTS.of(s.bucket.num_tokens, s.bucket.batch_size) <= target_ms
        for seq in advance(s, [5] * len(s.rows)):
            if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
        steps += 1
    assert all(seq.is_finished for seq in seqs) and len(seqs) == len(arrivals)


def chunk_tokens(sched, queue_lengths: list[int]) -> int:
    """Prompt tokens the next step takes beside 2 decoding sequences, with these prompts waiting."""
    start_mixed_decoders(sched, 2)
    for i, n in enumerate(queue_lengths):
        sched.add(make_seq(f"q{i}", n, 10.0 + i))
    s = sched.schedule()
    assert s.is_mixed and len(s.decode_seqs) == 2
    return sum(c.num_tokens for c in s.prefill_chunks)


def test_a_queue_that_grows_gets_larger_chunks_up_to_the_target():
    # target 50 ms: steps of at most 32 tokens (42 ms), not 64 (74 ms); untargeted steps of 8 tokens
    assert chunk_tokens(budget_scheduler(50.0, QUEUE_SPEC), [5]) == 5  # 8-token step
    assert chunk_tokens(budget_scheduler(50.0, QUEUE_SPEC), [5, 9]) == 14  # through in one 16-token step
    assert chunk_tokens(budget_scheduler(50.0, QUEUE_SPEC), [9, 9, 9]) == 27  # one 32-token step, cheaper than two
    assert chunk_tokens(budget_scheduler(50.0, QUEUE_SPEC), [9, 9, 9, 9]) == 30  # 36 tokens: 32-token steps
    assert chunk_tokens(budget_scheduler(50.0, QUEUE_SPEC), [40, 40, 40]) == 30  # the target's ceiling
    # a looser target lets the same long queue through in larger steps, a tighter one in smaller
    assert chunk_tokens(budget_scheduler(80.0, QUEUE_SPEC), [40, 40, 40]) == 62
    assert chunk_tokens(budget_scheduler(20.0, QUEUE_SPEC), [40, 40, 40]) == 6  # 8-token steps (18 ms)


def test_the_engine_summary_names_the_budget():
    budget = StepBudget(grid(), 64, 50.0, COSTS)
    assert budget.describe() == "mixed steps within 50 ms: 32 tokens from 0 decode rows, 32 tokens from 4 decode rows"
    assert MixedBucket(32, 4, 16).num_tokens == 32


# -- speculative decoding: a row with drafts is one row of its tokens ---------------------------------------------


@pytest.mark.parametrize(("target_ms", "decode_rows", "drafts", "tokens"), [
    (43.9, 2, 2, 32),  # 3 rows with the chunk's: the 4-row column, where 32 tokens take 42 ms (44 in the 8-row one)
    (43.9, 4, 0, 16),  # 5 rows: the 8-row column, as without drafts
    (42, 2, 6, 32),  # 8 decode tokens on 3 rows: still the target's 32, not every bucket (64: 74 ms)
    (42, 4, 12, 32),  # 16 decode tokens: room for a chunk only past 16
    (20, 2, 6, 16),  # nothing past 8 tokens within 20 ms: the smallest bucket with room for a chunk
])
def test_drafts_take_tokens_of_their_rows_not_rows(target_ms, decode_rows, drafts, tokens):
    assert StepBudget(grid(), 64, target_ms, COSTS).mixed_tokens(decode_rows, None, drafts) == tokens


def speculative_scheduler(target_ms: float) -> Scheduler:
    """A scheduler on a speculative grid (3 drafts at most per row) whose budget follows ``target_ms``."""
    spec_grid = BucketGrid(BUDGET_SPEC, block_size=4, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                           num_blocks=256, speculative=(3, 8))
    sched = Scheduler(BlockManager(256, 4), spec_grid, max_num_seqs=8, max_num_batched_tokens=64)
    sched.step_budget = StepBudget(spec_grid, 64, target_ms, COSTS)
    return sched


@pytest.mark.parametrize(("target_ms", "drafts_per_row", "chunk", "bucket_tokens"), [
    (43.9, 1, 28, 32),  # 4 decode tokens on 2 rows: the 4-row column allows 32 tokens (the 8-row one only 16)
    (42, 3, 24, 32),  # 8 decode tokens on 2 rows: the target's 32 tokens, as without drafts (not 64: 74 ms)
])
def test_a_speculative_step_with_a_target_budgets_its_rows_and_drafts(target_ms, drafts_per_row, chunk,
                                                                       bucket_tokens):
    sched = speculative_scheduler(target_ms)
    decoders = start_mixed_decoders(sched, 2)
    for seq in decoders:
        seq.spec_token_ids = [7] * drafts_per_row
    prompt = make_seq("p", 40, 10.0)
    sched.add(prompt)
    s = sched.schedule()
    assert s.decode_seqs == decoders and s.num_draft_tokens == 2 * drafts_per_row
    assert [(c.seq, c.start, c.num_tokens) for c in s.prefill_chunks] == [(prompt, 0, chunk)]
    assert (s.bucket.num_tokens, s.bucket.batch_size, s.num_padded_tokens) == (bucket_tokens, 4, 0)
    assert 1e3 * COSTS.of(s.bucket.num_tokens, s.bucket.batch_size) <= target_ms


# -- costs learned while serving ------------------------------------------------------------------------------------


def queue_grid(token_budget: int = 8) -> BucketGrid:
    return BucketGrid(BUDGET_SPEC.replace(mixed_token_budget=token_budget), block_size=4, max_model_len=64,
                      max_num_seqs=8, max_num_batched_tokens=64, num_blocks=256)


def observe(costs: StepCosts, ms_of, shapes, times: int = 3) -> None:
    """``times`` samples of each of ``shapes``, ``ms_of(tokens)`` milliseconds each."""
    for _ in range(times):
        for t, b in shapes:
            costs.observe(t, b, ms_of(t) / 1e3)


def test_before_any_shape_is_measured_the_budget_is_the_untargeted_one():
    costs = StepCosts()
    budget = StepBudget(queue_grid(), 64, 50.0, costs)
    observe(costs, lambda t: 10 + t, [(8, 4), (16, 4)], times=2)
    assert not budget.follows_target and budget.mixed_tokens(2, 300) == 8
    assert budget.describe() == ("mixed steps up to 8 tokens (until steps are measured, then within 50 ms: step "
                                 "costs are learned while serving)")


def test_the_budget_follows_the_target_over_costs_learned_from_two_shapes():
    # 10 ms + 1 ms per token seen on 8 and 16 tokens: 32 tokens are estimated at 42 ms, 64 at 74
    costs = StepCosts()
    budget = StepBudget(queue_grid(), 64, 50.0, costs)
    observe(costs, lambda t: 10 + t, [(8, 4), (16, 4)])
    assert budget.follows_target and [budget.mixed_tokens(d) for d in (0, 2, 5)] == [32, 32, 32]
    assert budget.mixed_tokens(2, 28) == 32 and budget.mixed_tokens(2, 10) == 16
    assert budget.describe() == "mixed steps within 50 ms: 32 tokens from 0 decode rows, 32 tokens from 4 decode rows"


def test_a_slow_start_is_corrected_by_the_quiet_steps_after_it():
    costs = StepCosts()
    budget = StepBudget(queue_grid(), 64, 50.0, costs)
    shapes = [(8, 4), (16, 4), (32, 4)]
    observe(costs, lambda t: 2 * (10 + t), shapes, times=16)  # a busy machine: every step twice as long
    assert budget.mixed_tokens(2) == 8  # 16 tokens take 52 ms
    observe(costs, lambda t: 10 + t, shapes, times=7)
    assert budget.mixed_tokens(2) == 8
    observe(costs, lambda t: 10 + t, shapes, times=1)  # half the window quiet: the low median is quiet
    assert budget.mixed_tokens(2) == 32
    costs.observe(32, 4, 0.420)  # one step 10x as long
    assert budget.mixed_tokens(2) == 32


# -- a backlog outgrows the target -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("pending", "tokens"), [
    (112, 16),  # 8 steps at the ceiling (16 tokens beside 2 decode rows) drain it: the target holds
    (113, 32),  # a backlog: the smallest bucket that drains it in 8 steps (2 + 15 tokens: 32)
    (400, 32),  # 2 + 50 tokens would need 64: at most the untargeted budget (32)
])
def test_a_backlog_grows_the_step_up_to_the_untargeted_budget(pending, tokens):
    # 30 ms: the ceiling is 16 tokens (26 ms; 32 take 42); the untargeted budget is 32 tokens
    assert StepBudget(queue_grid(32), 64, 30.0, COSTS).mixed_tokens(2, pending) == tokens


def test_without_room_past_the_ceiling_a_backlog_keeps_the_target():
    assert StepBudget(queue_grid(8), 64, 30.0, COSTS).mixed_tokens(2, 400) == 16  # 8-token untargeted budget


def test_a_backlog_measures_the_bucket_above_the_ceiling_while_it_is_only_estimated():
    costs = StepCosts()
    budget = StepBudget(queue_grid(8), 64, 30.0, costs)
    observe(costs, lambda t: 10 + t, [(8, 4), (16, 4)])  # 32 tokens estimated at 42 ms
    assert budget.mixed_tokens(2, 112) == 16 and budget.mixed_tokens(2, 400) == 32
    observe(costs, lambda t: 10 + t, [(32, 4)])  # measured: 42 ms, over the target
    assert budget.mixed_tokens(2, 400) == 16
    observe(costs, lambda t: 26, [(32, 4)], times=16)  # as cheap as 16 tokens now: within the target
    assert budget.mixed_tokens(2) == 32 and budget.mixed_tokens(2, 400) == 64  # and 64 is not measured


def test_the_scheduler_grows_a_step_for_a_backlog_of_waiting_prompts():
    spec = BUDGET_SPEC.replace(mixed_token_budget=32)
    assert chunk_tokens(budget_scheduler(30.0, spec), [40, 40]) == 14  # 80 tokens: 16-token steps (26 ms)
    assert chunk_tokens(budget_scheduler(30.0, spec), [40, 40, 40]) == 30  # 120 > 8 x 14: 32-token steps
