import random
from types import SimpleNamespace

import numpy as np
import pytest

from jaxserve.config.engine_config import EngineConfig
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.buckets import BucketGrid, BucketSpec, DecodeBucket, MixedBucket, PrefillBucket
from jaxserve.core.schedule import PrefillChunk, Schedule
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sequence import Sequence, SequenceStatus

SPEC = BucketSpec.from_dict(
    {
        "block_size": 4,
        "decode": {"batch_sizes": [1, 2, 4, 8]},
        "prefill": {"batch_sizes": [1, 2, 4], "lengths": [4, 8, 16]},
        "context": {"lengths": [16, 32, 64]},
    }
)
VOCAB = 97


MIXED_SPEC = SPEC.replace(mixed_batch_sizes=(4, 8), mixed_token_counts=(8, 16))


def make_scheduler(*, num_blocks=64, max_model_len=64, max_num_seqs=8, budget=16, spec=SPEC, **kwargs):
    grid = BucketGrid(
        spec,
        block_size=4,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        num_blocks=num_blocks,
    )
    bm = BlockManager(num_blocks, 4)
    return Scheduler(bm, grid, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, **kwargs)


def make_seq(request_id, num_prompt_tokens, arrival_time, max_tokens=8, first_token=1):
    prompt = [(first_token + i) % VOCAB for i in range(num_prompt_tokens)]
    return Sequence(request_id, prompt, SimpleNamespace(max_tokens=max_tokens), arrival_time=arrival_time)


def advance(schedule, tokens) -> list[Sequence]:
    """What the engine does after a step: its rows count as computed (``Schedule.advance``) and each row that
    samples appends its token, ``tokens[row]``. Returns those rows' sequences, in row order."""
    rows, tokens = schedule.rows, list(tokens)
    updated = []
    for row in schedule.advance():
        seq = rows[row][0]
        seq.append_token(tokens[row])
        updated.append(seq)
    return updated


def next_token(context: list[int]) -> int:
    """A deterministic 'model' whose output depends on the whole context, in order."""
    h = 17
    for t in context:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


def generate_alone(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class FakePagedModel:
    """Writes each row's new tokens into a paged 'KV cache' through its block table, then rebuilds every
    row's context from the cache. A wrong block table, a shared or reused block, or a wrong chunk start
    gives a wrong context, hence a wrong token."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.cache = np.full((num_blocks, block_size), -1, dtype=np.int64)

    def slot(self, seq, pos):
        return seq.block_table[pos // self.block_size], pos % self.block_size

    def step(self, schedule: Schedule) -> list[int]:
        bucket = schedule.bucket
        rows = schedule.rows
        if schedule.is_mixed:
            assert isinstance(bucket, MixedBucket) and sum(n for _, _, n in rows) <= bucket.num_tokens
        elif schedule.is_prefill:
            assert isinstance(bucket, PrefillBucket)
        else:
            assert isinstance(bucket, DecodeBucket)
        assert len(rows) <= bucket.batch_size
        for seq, start, n in rows:
            assert seq.status is SequenceStatus.RUNNING
            assert start == seq.num_computed_tokens and 1 <= n <= getattr(bucket, "chunk_len", bucket.num_tokens)
            assert start + n <= bucket.context_len
            assert -(-(start + n) // self.block_size) <= len(seq.block_table)
            for pos in range(start, start + n):
                self.cache[self.slot(seq, pos)] = seq.all_token_ids[pos]
        sampled = []
        for seq, start, n in rows:
            context = [int(self.cache[self.slot(seq, pos)]) for pos in range(start + n)]
            assert context == seq.all_token_ids[: start + n]
            sampled.append(next_token(context))
        return sampled + [0] * (bucket.batch_size - len(rows))  # padding rows sample garbage


def run_engine(scheduler, arrivals, max_steps=10_000):
    """Drive schedule()/advance() like LLMEngine.step(); ``arrivals`` maps step index -> sequences."""
    model = FakePagedModel(scheduler.block_manager.num_blocks, scheduler.block_manager.block_size)
    finished, log = [], []
    for step in range(max_steps):
        for seq in arrivals.get(step, []):
            scheduler.add(seq)
        if not scheduler.has_unfinished() and step > max(arrivals):
            return finished, log
        schedule = scheduler.schedule()
        log.append(schedule)
        finished += schedule.ignored
        if schedule.is_idle:
            assert not scheduler.has_unfinished() or step < max(arrivals), "idle with work left"
            continue
        for seq in advance(schedule, model.step(schedule)):
            if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
                finished.append(seq)
    raise AssertionError("the engine loop did not finish")


def assert_all_free(scheduler):
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not bm.ref_counts.any()
    assert scheduler.num_waiting == scheduler.num_running == 0


# -- admission --------------------------------------------------------------------------------------


def test_admission_is_capped_by_max_num_seqs():
    sched = make_scheduler(max_num_seqs=3)
    seqs = [make_seq(f"r{i}", 3, float(i)) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    s = sched.schedule()
    assert s.is_prefill and not s.is_decode and not s.is_idle
    assert [(c.seq, c.start, c.num_tokens) for c in s.prefill_chunks] == [(q, 0, 3) for q in seqs[:3]]
    assert s.bucket == PrefillBucket(4, 4, 16)
    assert (s.num_batched_tokens, s.num_padded_tokens) == (9, 7)
    assert (sched.num_running, sched.num_waiting) == (3, 2)
    assert [q.block_table for q in seqs] == [[0], [1], [2], [], []]
    assert [q.status for q in seqs] == [SequenceStatus.RUNNING] * 3 + [SequenceStatus.WAITING] * 2


def test_admission_counts_the_sequences_a_request_will_fork():
    sched = make_scheduler(max_num_seqs=4)
    parent = make_seq("n3", 3, 0.0)
    parent.num_pending_forks = 2  # n=3: two children will be forked after its prefill
    others = [make_seq(f"r{i}", 3, float(i + 1)) for i in range(3)]
    for seq in [parent, *others]:
        sched.add(seq)
    s = sched.schedule()
    assert [c.seq for c in s.prefill_chunks] == [parent, others[0]]  # 1 + 2 pending + 1 = 4
    assert (sched.num_running, sched.num_waiting) == (2, 2)
    advance(s, [5, 6])
    parent.num_pending_forks = 0
    children = []
    for _ in range(2):
        child = Sequence("n3", parent.prompt_token_ids, arrival_time=0.0)
        child.num_computed_tokens, child.status = 2, SequenceStatus.RUNNING
        sched.block_manager.fork(parent, child)
        sched.add_forked(child)
        children.append(child)
    s = sched.schedule()  # the four running sequences decode; nothing more is admitted
    assert s.is_decode and set(s.decode_seqs) == {parent, others[0], *children}
    assert sched.num_waiting == 2


def test_add_forked_needs_a_running_sequence_with_a_token_to_compute():
    sched = make_scheduler()
    seq = make_seq("r", 3, 0.0)
    with pytest.raises(ValueError, match="a forked sequence must be RUNNING with a token to compute"):
        sched.add_forked(seq)  # still WAITING
    seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, 3
    with pytest.raises(ValueError, match="a forked sequence must be RUNNING with a token to compute"):
        sched.add_forked(seq)  # nothing to compute


def test_a_lone_prompt_is_chunked_to_the_token_budget():
    sched = make_scheduler(budget=8)
    seq = make_seq("r", 30, 0.0)
    sched.add(seq)
    s = sched.schedule()
    assert [(c.start, c.num_tokens) for c in s.prefill_chunks] == [(0, 8)]
    assert s.bucket == PrefillBucket(1, 8, 16)
    assert seq.block_table == list(range(8))  # admission takes the blocks of the whole prompt


def test_admission_needs_blocks_for_the_whole_prompt_and_the_decoders_next_token():
    sched = make_scheduler(num_blocks=8, max_model_len=32, waiting_served_ratio=0.0)
    (a,) = start_decoders(sched, 1)  # 4 tokens, 3 computed, block 0; its next token (index 3) fits block 0
    b = make_seq("b", 28, 1.0)  # 7 blocks: exactly what is free
    sched.add(b)
    s = sched.schedule()
    assert [(c.seq, c.num_tokens) for c in s.prefill_chunks] == [(b, 16)]
    assert b.block_table == [1, 2, 3, 4, 5, 6, 7]

    sched = make_scheduler(num_blocks=8, max_model_len=32, waiting_served_ratio=0.0)
    (a,) = start_decoders(sched, 1)
    advance(sched.schedule(), [1])  # a: 5 tokens, 4 computed; its next token (index 4) needs a 2nd block
    assert a.block_table == [0]
    sched.add(make_seq("c", 28, 1.0))  # 7 blocks + 1 kept for a > 7 free: not admitted
    s = sched.schedule()
    assert s.is_decode and a.block_table == [0, 1] and sched.num_waiting == 1
    advance(s, [1])
    sched.abort("c")
    sched.add(make_seq("d", 24, 2.0))  # 6 blocks, a's next token (index 5) fits block 1: admitted
    assert sched.schedule().is_prefill


def test_joining_sequences_keep_the_padded_bucket_within_the_budget():
    # a 14-token chunk pads to 16 (splitting it as 8 + 8 saves nothing): a second sequence would need
    # the 2 x 16 bucket (> 16 tokens)
    sched = make_scheduler()
    a, b = make_seq("a", 14, 0.0), make_seq("b", 3, 1.0)
    sched.add(a)
    sched.add(b)
    s = sched.schedule()
    assert [(c.seq, c.num_tokens) for c in s.prefill_chunks] == [(a, 14)]
    assert s.bucket == PrefillBucket(1, 16, 16)
    # the other way round, the second sequence joins with a shorter chunk that fits the 2 x 8 bucket
    sched = make_scheduler()
    a, b = make_seq("a", 3, 0.0), make_seq("b", 10, 1.0)
    sched.add(a)
    sched.add(b)
    s = sched.schedule()
    assert [(c.seq, c.start, c.num_tokens) for c in s.prefill_chunks] == [(a, 0, 3), (b, 0, 8)]
    assert s.bucket == PrefillBucket(2, 8, 16)
    assert (s.num_batched_tokens, s.num_padded_tokens) == (11, 5)


@pytest.mark.parametrize(
    ("prompt_len", "chunks"),
    [
        (10, [8, 2]),  # 16 padded one-shot vs 8 + 4: saves 4 = the smallest chunk bucket
        (9, [8, 1]),  # 16 vs 8 + 4
        (12, [8, 4]),  # 16 vs 8 + 4
        (14, [14]),
        (6, [6]),  # 8 vs 4 + 4: saves nothing
        (16, [16]),  # exact bucket
        (3, [3]),
    ],
)
def test_first_chunk_is_split_when_that_saves_padding(prompt_len, chunks):
    sched = make_scheduler()
    seq = make_seq("a", prompt_len, 0.0)
    sched.add(seq)
    taken = []
    while sum(taken) < prompt_len:
        s = sched.schedule()
        taken.append(s.prefill_chunks[0].num_tokens if s.is_prefill else 1)  # a 1-token rest decodes
        advance(s, [1])
    assert taken == chunks


def test_without_chunked_prefill_short_prompts_are_not_split():
    sched = make_scheduler(enable_chunked_prefill=False)
    a, b = make_seq("a", 3, 0.0), make_seq("b", 10, 1.0)
    sched.add(a)
    sched.add(b)
    s = sched.schedule()
    assert [(c.seq, c.num_tokens) for c in s.prefill_chunks] == [(a, 3)]


@pytest.mark.parametrize("chunked", [True, False])
def test_long_prompt_is_prefilled_in_chunks(chunked):
    sched = make_scheduler(enable_chunked_prefill=chunked)
    seq = make_seq("r", 40, 0.0, max_tokens=3)
    finished, log = run_engine(sched, {0: [seq]})
    assert [(c.start, c.num_tokens) for s in log if s.is_prefill for c in s.prefill_chunks] == [
        (0, 16),
        (16, 16),
        (32, 8),
    ]
    assert [s.bucket for s in log] == [
        PrefillBucket(1, 16, 16),
        PrefillBucket(1, 16, 32),
        PrefillBucket(1, 8, 64),
        DecodeBucket(1, 64),
        DecodeBucket(1, 64),
    ]
    assert finished == [seq]
    assert seq.output_token_ids == generate_alone(seq.prompt_token_ids, 3)
    assert_all_free(sched)


def test_chunk_is_last_and_token_ids():
    seq = make_seq("r", 10, 0.0)
    chunk = PrefillChunk(seq, 8, 2)
    assert chunk.is_last and chunk.end == chunk.context_len == 10
    assert chunk.token_ids == seq.prompt_token_ids[8:]
    assert not PrefillChunk(seq, 0, 8).is_last


# -- prefill vs decode ------------------------------------------------------------------------------


def start_decoders(sched, n):
    seqs = [make_seq(f"d{i}", 3, float(i), max_tokens=100) for i in range(n)]
    for seq in seqs:
        sched.add(seq)
    s = sched.schedule()
    assert s.is_prefill and len(s.prefill_chunks) == n
    advance(s, [1] * n)
    return seqs


def test_waiting_served_ratio_decides_prefill_or_decode():
    sched = make_scheduler(waiting_served_ratio=1.2, max_waiting_steps=100)
    decoders = start_decoders(sched, 4)
    for i in range(4):
        sched.add(make_seq(f"w{i}", 3, 10.0 + i))
    # 4 waiting / 4 decoding = 1.0 < 1.2: decode
    s = sched.schedule()
    assert s.is_decode and s.decode_seqs == decoders and s.bucket == DecodeBucket(4, 16)
    assert s.context_lens == [4, 4, 4, 4]
    advance(s, [1] * 4)
    sched.add(make_seq("w4", 3, 20.0))
    # 5 / 4 = 1.25 >= 1.2: prefill, up to max_num_seqs=8 running
    s = sched.schedule()
    assert s.is_prefill and [c.seq.request_id for c in s.prefill_chunks] == ["w0", "w1", "w2", "w3"]
    assert sched.num_waiting == 1 and sched.num_running == 8


def test_default_ratio_is_prefill_first():
    sched = make_scheduler()
    assert sched.waiting_served_ratio == 0.0
    start_decoders(sched, 4)
    sched.add(make_seq("w", 3, 10.0))
    assert sched.schedule().is_prefill


def test_ratio_zero_always_admits():
    sched = make_scheduler(waiting_served_ratio=0.0)
    start_decoders(sched, 4)
    sched.add(make_seq("w", 3, 10.0))
    assert sched.schedule().is_prefill


def test_max_waiting_steps_forces_a_prefill():
    sched = make_scheduler(waiting_served_ratio=100.0, max_waiting_steps=3)
    start_decoders(sched, 2)
    sched.add(make_seq("w", 3, 10.0))
    kinds = []
    for _ in range(5):
        s = sched.schedule()
        kinds.append("prefill" if s.is_prefill else "decode")
        advance(s, [1] * len(s.seqs))
    assert kinds == ["decode", "decode", "decode", "prefill", "decode"]
    assert sched.num_decode_steps_waited == 0


def test_a_sequence_mid_prefill_keeps_priority():
    sched = make_scheduler(waiting_served_ratio=100.0, max_waiting_steps=1)
    (a,) = start_decoders(sched, 1)
    b = make_seq("b", 40, 10.0, max_tokens=100)
    sched.add(b)
    steps = []
    for _ in range(6):
        s = sched.schedule()
        steps.append([(c.seq.request_id, c.start, c.num_tokens) for c in s.prefill_chunks] or s.decode_seqs)
        advance(s, [1] * len(s.seqs))
    assert steps == [
        [a],  # ratio 1/1 < 100: decode, then max_waiting_steps=1 forces the admission
        [("b", 0, 16)],
        [("b", 16, 16)],  # b is mid-prefill: prefill again although the ratio says decode
        [("b", 32, 8)],
        [a, b],
        [a, b],
    ]


def test_idle_when_nothing_to_do():
    sched = make_scheduler()
    s = sched.schedule()
    assert s.is_idle and s.bucket is None and s.num_padded_tokens == 0
    assert not sched.has_unfinished()


# -- preemption -------------------------------------------------------------------------------------


def test_decode_preempts_the_newest_sequence():
    # 4 blocks of 4 tokens: three 4-token prompts fill 3 blocks; their 5th tokens need 3 more
    sched = make_scheduler(num_blocks=4, max_model_len=16, waiting_served_ratio=0.0)
    a, b, c = (make_seq(name, 4, float(i)) for i, name in enumerate("abc"))
    for seq in (a, b, c):
        sched.add(seq)
    s = sched.schedule()
    assert s.bucket == PrefillBucket(4, 4, 16) and [q.block_table for q in (a, b, c)] == [[0], [1], [2]]
    advance(s, [5, 6, 7])
    s = sched.schedule()
    assert s.is_decode and s.decode_seqs == [a, b] and s.preempted == [c]
    assert s.bucket == DecodeBucket(2, 16)
    assert (a.block_table, b.block_table, c.block_table) == ([0, 3], [1, 2], [])
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert c.output_token_ids == [7] and list(sched.waiting) == [c]
    advance(s, [8, 9])
    # c cannot come back yet (it needs 2 blocks, none free): decode again
    s = sched.schedule()
    assert s.is_decode and s.decode_seqs == [a, b] and s.preempted == []


def test_preempted_sequences_go_back_in_arrival_order():
    sched = make_scheduler(num_blocks=4, max_model_len=16, waiting_served_ratio=0.0)
    seqs = [make_seq(f"r{i}", 4, float(i)) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    s = sched.schedule()
    assert len(s.prefill_chunks) == 4 and sched.block_manager.num_free_blocks == 0
    advance(s, [1, 2, 3, 4])
    s = sched.schedule()
    # r0 needs a block: r3 goes; r1 needs one: r2 goes
    assert s.decode_seqs == seqs[:2] and s.preempted == [seqs[3], seqs[2]]
    assert list(sched.waiting) == [seqs[2], seqs[3]]



# -- the priority policy (vLLM's --scheduling-policy priority) ----------------------------------------


def with_priority(seq: Sequence, priority: int) -> Sequence:
    seq.priority = priority
    return seq


def test_priority_policy_admits_lower_values_first_then_by_arrival():
    sched = make_scheduler(max_num_seqs=2, policy="priority")
    seqs = [with_priority(make_seq(f"r{i}", 3, float(i)), p) for i, p in enumerate([5, 1, 5, 0, 1])]
    for seq in seqs:
        sched.add(seq)
    assert list(sched.waiting) == [seqs[3], seqs[1], seqs[4], seqs[0], seqs[2]]
    s = sched.schedule()
    assert [c.seq for c in s.prefill_chunks] == [seqs[3], seqs[1]]
    fcfs = make_scheduler(max_num_seqs=2)
    for seq in [with_priority(make_seq(f"f{i}", 3, float(i)), p) for i, p in enumerate([5, 1, 5, 0, 1])]:
        fcfs.add(seq)
    assert [c.seq.request_id for c in fcfs.schedule().prefill_chunks] == ["f0", "f1"]  # fcfs: arrival alone


def test_priority_policy_preempts_the_largest_value_and_requeues_it_in_order():
    """r3 needs a block first (priority 0): r0 (priority 9, the oldest) goes, not the newest; r2 (priority 1)
    needs one next: r1 (priority 2) goes. The waiting queue holds them by priority."""
    sched = make_scheduler(num_blocks=4, max_model_len=16, waiting_served_ratio=0.0, policy="priority")
    seqs = [with_priority(make_seq(f"r{i}", 4, float(i)), p) for i, p in enumerate([9, 2, 1, 0])]
    for seq in seqs:
        sched.add(seq)
    s = sched.schedule()
    assert [c.seq for c in s.prefill_chunks] == [seqs[3], seqs[2], seqs[1], seqs[0]]
    advance(s, [1, 2, 3, 4])
    s = sched.schedule()
    assert s.decode_seqs == [seqs[3], seqs[2]] and s.preempted == [seqs[0], seqs[1]]
    assert list(sched.waiting) == [seqs[1], seqs[0]]


def test_a_fork_keeps_its_requests_priority():
    """Beam search forks running beams: they must stay in their request's place in the priority order."""
    assert with_priority(make_seq("r", 3, 0.0), 7).fork().priority == 7


def test_the_policy_is_checked():
    with pytest.raises(ValueError, match=r"^policy must be one of fcfs, priority, got 'lifo'$"):
        make_scheduler(policy="lifo")
    with pytest.raises(ValueError, match=r"^scheduling_policy must be one of fcfs, priority, got 'lifo'$"):
        EngineConfig(scheduling_policy="lifo")
    assert EngineConfig().scheduling_policy == "fcfs"  # vLLM's default

@pytest.mark.parametrize(("ratio", "chunked"), [(0.0, True), (1.2, True), (1.2, False), (5.0, True)])
def test_tiny_pool_with_preemption_gives_the_same_tokens_as_alone(ratio, chunked):
    sched = make_scheduler(
        num_blocks=16, max_model_len=64, waiting_served_ratio=ratio, enable_chunked_prefill=chunked
    )
    prompts = [5, 9, 14, 3, 20, 7]
    seqs = [make_seq(f"r{i}", n, float(i), max_tokens=24, first_token=i * 7) for i, n in enumerate(prompts)]
    finished, log = run_engine(sched, {0: seqs[:4], 3: seqs[4:]})
    assert sorted(finished, key=lambda q: q.seq_id) == seqs
    for seq in seqs:
        assert seq.output_token_ids == generate_alone(seq.prompt_token_ids, 24), seq
        assert seq.status is SequenceStatus.FINISHED_LENGTH
    assert sum(len(s.preempted) for s in log) == sum(seq.num_preemptions for seq in seqs) > 0
    assert any(seq.num_preemptions > 0 for seq in seqs)
    assert_all_free(sched)


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_finish_with_exact_tokens(seed):
    rng = random.Random(seed)
    max_model_len = 64
    num_blocks = rng.choice([16, 24, 40, 64])
    sched = make_scheduler(
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=rng.choice([2, 4, 8]),
        budget=rng.choice([8, 16]),
        waiting_served_ratio=rng.choice([0.0, 0.5, 1.2, 3.0]),
        max_waiting_steps=rng.choice([1, 5, 20]),
        enable_chunked_prefill=rng.random() < 0.7,
    )
    arrivals, seqs = {}, []
    for i in range(rng.randint(3, 14)):
        prompt = rng.randint(1, 40)
        max_tokens = rng.randint(1, max_model_len - prompt)
        seq = make_seq(f"r{i}", prompt, float(i), max_tokens=max_tokens, first_token=rng.randrange(VOCAB))
        arrivals.setdefault(rng.randint(0, 30), []).append(seq)
        seqs.append(seq)
    finished, log = run_engine(sched, arrivals)
    assert sorted(finished, key=lambda q: q.seq_id) == seqs
    for seq in seqs:
        assert seq.output_token_ids == generate_alone(seq.prompt_token_ids, seq.sampling_params.max_tokens)
    assert_all_free(sched)
    for s in log:
        assert s.is_idle or s.num_batched_tokens <= sched.max_num_batched_tokens


def test_a_sequence_beyond_max_model_len_is_ignored_not_looped():
    sched = make_scheduler(num_blocks=4, max_model_len=16)
    seq = make_seq("r", 16, 0.0, max_tokens=100)
    sched.add(seq)
    s = sched.schedule()
    assert s.prefill_chunks[0].num_tokens == 16
    advance(s, [1])  # 17 tokens now: the next step would attend to 17 > max_model_len
    s = sched.schedule()
    assert s.is_idle and s.ignored == [seq]
    assert seq.status is SequenceStatus.FINISHED_LENGTH
    assert_all_free(sched)
    with pytest.raises(ValueError, match="17 tokens exceed max_model_len=16"):
        sched.add(make_seq("too-long", 17, 1.0))


def test_engine_must_advance_before_scheduling_again():
    sched = make_scheduler()
    sched.add(make_seq("r", 3, 0.0))
    s = sched.schedule()
    s.prefill_chunks[0].seq.num_computed_tokens += 3  # advanced without appending the sampled token
    with pytest.raises(RuntimeError, match="the engine must append the sampled token"):
        sched.schedule()


def test_advance_counts_every_row_and_returns_the_rows_that_sample():
    sched = make_scheduler(spec=MIXED_SPEC)
    decoding, long_prompt = make_seq("a", 2, 0.0), make_seq("b", 20, 1.0)
    sched.add(decoding)
    advance(sched.schedule(), [9])  # a's prompt: it decodes from now on
    sched.add(long_prompt)
    s = sched.schedule()
    assert [(seq.request_id, start, n) for seq, start, n in s.rows] == [("a", 2, 1), ("b", 0, 15)]
    assert s.advance() == [0]  # b's chunk does not reach its last token: it samples nothing
    assert (decoding.num_computed_tokens, long_prompt.num_computed_tokens) == (3, 15)
    assert decoding.output_token_ids == [9]  # nothing appended: the engine appends the sampled tokens


# -- abort and finish -------------------------------------------------------------------------------


def test_abort_waiting_and_running_frees_blocks():
    sched = make_scheduler(max_num_seqs=2)
    a, b, c = make_seq("a", 6, 0.0), make_seq("b", 6, 1.0), make_seq("c", 6, 2.0)
    for seq in (a, b, c):
        sched.add(seq)
    s = sched.schedule()
    assert [ch.seq for ch in s.prefill_chunks] == [a, b]
    advance(s, [1, 2])
    assert sched.block_manager.num_used_blocks == 4
    assert sched.abort("b") == [b]
    assert b.status is SequenceStatus.FINISHED_ABORTED and b.block_table == []
    assert sched.block_manager.num_used_blocks == 2
    assert sched.abort("c") == [c]
    assert c.status is SequenceStatus.FINISHED_ABORTED and sched.num_waiting == 0
    assert sched.abort("nope") == []
    assert sched.num_running == 1
    sched.finish(a)
    assert a.status is SequenceStatus.FINISHED_STOPPED
    assert_all_free(sched)
    assert not sched.has_unfinished()


def test_abort_all_sequences_of_a_request():
    sched = make_scheduler()
    a1, a2, b = make_seq("a", 3, 0.0), make_seq("a", 3, 1.0), make_seq("b", 3, 2.0)
    for seq in (a1, a2, b):
        sched.add(seq)
    sched.schedule()
    assert sched.abort("a") == [a1, a2]
    assert sched.num_running == 1


def test_finish_rejects_an_unfinished_status():
    sched = make_scheduler()
    seq = make_seq("a", 3, 0.0)
    sched.add(seq)
    with pytest.raises(ValueError, match="finish needs a FINISHED_\\* status, got RUNNING"):
        sched.finish(seq, SequenceStatus.RUNNING)


def test_constructor_checks_the_grid_matches():
    grid = BucketGrid(
        SPEC, block_size=4, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16, num_blocks=64
    )
    with pytest.raises(
        ValueError, match="pruned for 64 blocks of 4, but the block manager has 32 blocks of 4"
    ):
        Scheduler(BlockManager(32, 4), grid, max_num_seqs=8, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="max_num_seqs must be in \\[1, 8\\]"):
        Scheduler(BlockManager(64, 4), grid, max_num_seqs=9, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be in \\[1, 16\\]"):
        Scheduler(BlockManager(64, 4), grid, max_num_seqs=8, max_num_batched_tokens=17)


# -- mixed steps --------------------------------------------------------------------------------------


def test_mixed_steps_never_make_a_decoding_sequence_wait_for_a_prefill():
    """Requests arrive while others decode; long prompts prefill in chunks over several steps. Every sequence
    that is decoding when a step is planned decodes in it, and every token equals the model run alone."""
    sched = make_scheduler(spec=MIXED_SPEC, budget=16)
    arrivals = {0: [make_seq(f"a{i}", 5, float(i), max_tokens=12) for i in range(3)],
                3: [make_seq("long", 30, 3.0, max_tokens=6)],
                5: [make_seq("b", 9, 5.0, max_tokens=6), make_seq("c", 20, 5.5, max_tokens=6)]}
    model = FakePagedModel(sched.block_manager.num_blocks, sched.block_manager.block_size)
    finished, kinds = [], []
    for step in range(200):
        for seq in arrivals.get(step, []):
            sched.add(seq)
        if not sched.has_unfinished() and step > max(arrivals):
            break
        decoding = {s.seq_id for s in sched.running if s.num_uncomputed_tokens == 1}
        schedule = sched.schedule()
        assert decoding <= {s.seq_id for s in schedule.decode_seqs}
        kinds.append("mixed" if schedule.is_mixed else "prefill" if schedule.is_prefill else "decode")
        for seq in advance(schedule, model.step(schedule)):
            if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
                finished.append(seq)
    assert len(finished) == 6
    for seq in finished:
        assert seq.output_token_ids == generate_alone(seq.prompt_token_ids, seq.sampling_params.max_tokens)
    assert kinds[0] == "prefill" and kinds.count("mixed") >= 5 and kinds.count("prefill") == 1  # only the first
    assert_all_free(sched)


def start_mixed_decoders(sched, n):
    """n sequences of 3-token prompts, all decoding (prefilled over as many steps as it takes)."""
    seqs = [make_seq(f"d{i}", 3, float(i), max_tokens=100) for i in range(n)]
    for seq in seqs:
        sched.add(seq)
    while any(s.status is SequenceStatus.WAITING or s.num_uncomputed_tokens > 1 for s in seqs):
        s = sched.schedule()
        advance(s, [1] * len(s.rows))
    return seqs


def test_a_mixed_step_puts_decode_rows_first_and_cuts_the_chunk_to_fill_a_bucket():
    sched = make_scheduler(spec=MIXED_SPEC, budget=14)
    decoders = start_mixed_decoders(sched, 3)
    prompt = make_seq("p", 30, 10.0)
    sched.add(prompt)
    s = sched.schedule()
    # 14 tokens: 3 decode rows, then 11 tokens left; the chunk is cut to 5 so the step fills the 8-token bucket
    assert s.decode_seqs == decoders and [(c.seq, c.start, c.num_tokens) for c in s.prefill_chunks] == [(prompt, 0, 5)]
    assert s.is_mixed and s.bucket == MixedBucket(8, 4, 16) and s.num_padded_tokens == 0
    assert [seq for seq, _, _ in s.rows] == [*decoders, prompt]
    assert len(prompt.block_table) == 8  # admission took the blocks of the whole prompt
    advance(s, [7, 7, 7, 0])
    s = sched.schedule()
    assert [(c.start, c.num_tokens) for c in s.prefill_chunks] == [(5, 5)] and s.bucket == MixedBucket(8, 4, 16)


def test_the_last_chunk_of_a_prompt_is_not_cut_and_pads_to_the_next_bucket():
    sched = make_scheduler(spec=MIXED_SPEC, budget=16)
    decoders = start_mixed_decoders(sched, 2)
    prompt = make_seq("p", 7, 10.0)
    sched.add(prompt)
    s = sched.schedule()
    assert [(c.start, c.num_tokens) for c in s.prefill_chunks] == [(0, 7)]
    assert s.bucket == MixedBucket(16, 4, 16) and (s.num_batched_tokens, s.num_padded_tokens) == (9, 7)
    assert advance(s, [3, 4, 5]) == [*decoders, prompt] and prompt.output_token_ids == [5]


def test_decode_rows_that_fill_the_token_budget_leave_no_room_for_a_prefill():
    sched = make_scheduler(spec=MIXED_SPEC, budget=6)
    decoders = start_mixed_decoders(sched, 6)
    sched.add(make_seq("p", 5, 10.0))
    s = sched.schedule()
    assert not s.is_mixed and s.decode_seqs == decoders and s.bucket == DecodeBucket(8, 16)
    assert sched.num_waiting == 1
    advance(s, [1] * 6)
    sched.finish(decoders[0], SequenceStatus.FINISHED_STOPPED)
    s = sched.schedule()  # five decode rows leave one token of the budget: a one-token chunk
    assert s.is_mixed and [(c.start, c.num_tokens) for c in s.prefill_chunks] == [(0, 1)]
    assert s.bucket == MixedBucket(8, 8, 16)


def test_decode_rows_that_fill_the_largest_mixed_batch_leave_no_room_for_a_prefill():
    spec = SPEC.replace(mixed_batch_sizes=(4,), mixed_token_counts=(8, 16))
    sched = make_scheduler(spec=spec, budget=16)
    decoders = start_mixed_decoders(sched, 4)
    sched.add(make_seq("p", 5, 10.0))
    s = sched.schedule()
    assert not s.is_mixed and s.decode_seqs == decoders and sched.num_waiting == 1
