from pathlib import Path

import pytest

from jaxserve.core.buckets import (
    BucketGrid,
    BucketSpec,
    DecodeBucket,
    MixedBucket,
    PaddingStats,
    PrefillBucket,
    load_bucket_spec,
    padding_waste,
)
from tests.paths import REPO_ROOT

CPU_LIKE = """
block_size = 16
[decode]
batch_sizes = [1, 2, 4, 8, 16, 32]
[prefill]
batch_sizes = [1]
lengths = [32, 128, 512]
[context]
lengths = [256, 512, 1024, 2048]
"""


def spec_dict(**overrides):
    data = {
        "block_size": 16,
        "decode": {"batch_sizes": [1, 2, 4, 8]},
        "prefill": {"batch_sizes": [1, 2, 4], "lengths": [16, 64, 256]},
        "context": {"lengths": [64, 256, 1024]},
    }
    for key, value in overrides.items():
        table, _, field = key.partition("__")
        if field:
            data.setdefault(table, {})[field] = value
        else:
            data[table] = value
    return data


def make_grid(spec, **limits):
    kwargs = dict(
        block_size=16, max_model_len=1000, max_num_seqs=3, max_num_batched_tokens=128, num_blocks=200
    )
    kwargs.update(limits)
    return BucketGrid(spec, **kwargs)


# -- spec parsing and validation --------------------------------------------------------------------


def test_parse_toml_text():
    spec = BucketSpec.from_toml_text(CPU_LIKE, source="x.toml")
    assert spec.decode_batch_sizes == (1, 2, 4, 8, 16, 32)
    assert spec.prefill_batch_sizes == (1,)
    assert spec.prefill_lengths == (32, 128, 512)
    assert spec.context_lengths == (256, 512, 1024, 2048)
    assert spec.block_size == 16
    assert spec.source == "x.toml"


def test_block_size_is_optional():
    data = spec_dict()
    del data["block_size"]
    assert BucketSpec.from_dict(data).block_size is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"decode__batch_sizes": [4, 2]},
            "x.toml: [decode] batch_sizes must be sorted ascending without repeats, got [4, 2]",
        ),
        (
            {"prefill__lengths": [16, 16]},
            "x.toml: [prefill] lengths must be sorted ascending without repeats, got [16, 16]",
        ),
        (
            {"prefill__batch_sizes": [0, 1]},
            "x.toml: [prefill] batch_sizes must contain positive integers, got 0",
        ),
        (
            {"decode__batch_sizes": [1, True]},
            "x.toml: [decode] batch_sizes must contain positive integers, got True",
        ),
        (
            {"decode__batch_sizes": [1, 2.0]},
            "x.toml: [decode] batch_sizes must contain positive integers, got 2.0",
        ),
        (
            {"context__lengths": []},
            "x.toml: [context] lengths must be a non-empty list of positive integers, got []",
        ),
        (
            {"context__lengths": [64, 100]},
            "x.toml: [context] lengths must be multiples of block_size 16, got 100",
        ),
        ({"block_size": 0}, "x.toml: block_size must be a positive integer, got 0"),
        ({"decode": None}, "x.toml: missing table [decode]"),
        ({"prefill": {"batch_sizes": [1]}}, "x.toml: missing [prefill] lengths"),
        ({"decode__sizes": [1]}, "x.toml: unknown key [decode] sizes (known: batch_sizes)"),
        ({"extra": {}}, "x.toml: unknown table [extra] (known: decode, prefill, context, mixed)"),
    ],
)
def test_validation_errors(overrides, message):
    data = spec_dict(**overrides)
    if data.get("decode") is None:
        del data["decode"]
    with pytest.raises(ValueError) as info:
        BucketSpec.from_dict(data, source="x.toml")
    assert str(info.value) == message


def test_invalid_toml_names_the_file():
    with pytest.raises(ValueError, match=r"^bad.toml: invalid TOML: "):
        BucketSpec.from_toml_text("[decode\n", source="bad.toml")


# -- loading shipped and user files -----------------------------------------------------------------


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_shipped_specs_load_and_build(platform):
    spec = load_bucket_spec(None, platform)
    assert Path(spec.source) == REPO_ROOT / "jaxserve" / "_buckets" / f"{platform}.toml"
    assert spec == load_bucket_spec(str(REPO_ROOT / "buckets" / f"{platform}.toml"), "cpu")  # the repo-root link
    assert spec == load_bucket_spec(platform, "cpu")
    assert spec.block_size is not None
    grid = BucketGrid(
        spec,
        block_size=spec.block_size,
        max_model_len=spec.context_lengths[-1],
        max_num_seqs=spec.decode_batch_sizes[-1],
        max_num_batched_tokens=8192,
        num_blocks=100_000,
    )
    assert grid.max_context_len == spec.context_lengths[-1]
    assert grid.max_decode_batch_size == spec.decode_batch_sizes[-1]


def test_cpu_spec_stays_small():
    spec = load_bucket_spec("cpu", "cpu")
    grid = BucketGrid(
        spec, block_size=16, max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=512, num_blocks=4096
    )
    assert (len(grid.decode_buckets), len(grid.prefill_buckets), len(grid.mixed_buckets)) == (20, 12, 20)
    assert grid.num_executables == 52
    short = BucketGrid(
        spec, block_size=16, max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=512, num_blocks=2048
    )
    assert (len(short.decode_buckets), len(short.prefill_buckets), len(short.mixed_buckets)) == (10, 6, 10)
    assert short.num_executables == 26
    assert short.mixed_buckets == [MixedBucket(t, r, 2048) for r in (16, 64) for t in (32, 64, 128, 256, 512)]
    assert spec.mixed_token_budget == 128
    offline = BucketGrid(spec, block_size=16, max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=512,
                         num_blocks=2048, mixed_token_limit=spec.mixed_token_budget)
    assert offline.mixed_buckets == [MixedBucket(t, r, 2048) for r in (16, 64) for t in (32, 64, 128)]
    assert offline.num_executables == 22
    text = Path(spec.source).read_text()
    assert "# 26 executables (10 decode + 6 prefill + 10 mixed) at max_model_len 2048, 52 at 8192" in text
    assert "22 and\n# 44 without one (offline)" in text


def test_mixed_token_budget_is_optional_and_checked():
    base = {"decode": {"batch_sizes": [1]}, "prefill": {"batch_sizes": [1], "lengths": [8]},
            "context": {"lengths": [16]}}
    without = BucketSpec.from_dict({**base, "mixed": {"batch_sizes": [2], "token_counts": [8, 16]}})
    assert without.mixed_token_budget is None
    spec = BucketSpec.from_dict({**base, "mixed": {"batch_sizes": [2], "token_counts": [8, 16], "token_budget": 8}})
    assert spec.mixed_token_budget == 8
    for bad in (0, 17, 2.5, True):
        with pytest.raises(ValueError, match=r"\[mixed\] token_budget must be a positive integer within the largest"):
            BucketSpec.from_dict({**base, "mixed": {"batch_sizes": [2], "token_counts": [8, 16], "token_budget": bad}})
    with pytest.raises(ValueError, match=r"unknown key \[mixed\] budget \(known: batch_sizes, token_counts, "
                       r"token_budget\)"):
        BucketSpec.from_dict({**base, "mixed": {"batch_sizes": [2], "token_counts": [8], "budget": 8}})


def test_tpu_spec_is_lane_aligned():
    spec = load_bucket_spec(None, "tpu")
    assert spec.block_size % 64 == 0
    assert all(c % 128 == 0 for c in spec.context_lengths)
    assert all(n % 128 == 0 for n in spec.prefill_lengths)
    assert all(t % 128 == 0 for t in spec.mixed_token_counts)
    assert all(b % 8 == 0 for b in (*spec.decode_batch_sizes, *spec.mixed_batch_sizes))


@pytest.mark.parametrize(
    ("platform", "mixed", "counts", "num_samplers"),
    [
        ("cpu", ((16, 64), (32, 64, 128, 256, 512)), None, None),
        ("gpu", ((32, 256), (256, 512, 1024, 2048)), (7, 9, 8), 7),
        ("tpu", ((64, 256), (256, 512, 1024, 2048)), (6, 9, 8), 8),
    ],
)
def test_shipped_mixed_tables_and_quoted_counts(platform, mixed, counts, num_samplers):
    """The TPU and GPU files quote their programs at max_model_len 8192 and the engine's defaults (max_num_seqs and
    max_num_batched_tokens from the largest decode and prefill buckets): steps, a sampler per batch size, and the 7
    allocation and fork programs (tests/compilation/test_targets.py counts them through the runner)."""
    spec = load_bucket_spec(None, platform)
    assert (spec.mixed_batch_sizes, spec.mixed_token_counts) == mixed
    if counts is None:  # cpu.toml quotes the engine's defaults: test_cpu_spec_stays_small
        return
    grid = BucketGrid(
        spec,
        block_size=spec.block_size,
        max_model_len=8192,
        max_num_seqs=spec.decode_batch_sizes[-1],
        max_num_batched_tokens=spec.prefill_batch_sizes[-1] * spec.prefill_lengths[-1],
        num_blocks=100_000,
    )
    assert (len(grid.decode_buckets), len(grid.prefill_buckets), len(grid.mixed_buckets)) == counts
    assert len({b.batch_size for b in grid.buckets}) == num_samplers
    total = sum(counts) + num_samplers + 7
    quoted = (f"# {total} programs at max_model_len 8192 and the engine's defaults (max_num_seqs 256, "
              f"max_num_batched_tokens\n# 16 x 2048 = 32768): {sum(counts)} steps ({counts[0]} decode + {counts[1]} "
              f"prefill + {counts[2]} mixed), {num_samplers} samplers")
    assert quoted in Path(spec.source).read_text()


def test_platform_alias_and_paths(tmp_path):
    assert load_bucket_spec(None, "cuda") == load_bucket_spec("gpu", "cpu")
    path = tmp_path / "mine.toml"
    path.write_text(CPU_LIKE)
    spec = load_bucket_spec(str(path), "tpu")
    assert spec.source == str(path) and spec.decode_batch_sizes[-1] == 32
    assert load_bucket_spec(path, "cpu") == spec
    with pytest.raises(FileNotFoundError, match="bucket spec file .*nope.toml does not exist"):
        load_bucket_spec(str(tmp_path / "nope.toml"), "cpu")
    with pytest.raises(
        ValueError, match=r"unknown bucket spec 'h100': pass a .toml path or one of cpu, gpu, tpu"
    ):
        load_bucket_spec("h100", "cpu")


# -- selection --------------------------------------------------------------------------------------


def cpu_like_grid(**limits):
    kwargs = dict(
        block_size=16, max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=512, num_blocks=4096
    )
    kwargs.update(limits)
    return BucketGrid(BucketSpec.from_toml_text(CPU_LIKE), **kwargs)


@pytest.mark.parametrize(
    ("num_seqs", "batch_size"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (9, 16), (17, 32), (32, 32)]
)
def test_select_decode_batch(num_seqs, batch_size):
    assert cpu_like_grid().select_decode(num_seqs, 100) == DecodeBucket(batch_size, 256)


@pytest.mark.parametrize(
    ("context", "context_len"), [(1, 256), (256, 256), (257, 512), (1000, 1024), (1025, 2048), (2048, 2048)]
)
def test_select_decode_context(context, context_len):
    assert cpu_like_grid().select_decode(3, context) == DecodeBucket(4, context_len)


def test_select_decode_raises_beyond_the_grid():
    grid = cpu_like_grid()
    with pytest.raises(ValueError) as info:
        grid.select_decode(33, 10)
    assert (
        str(info.value)
        == "no decode bucket fits 33 sequences at context 10 (largest: batch 32, context 2048)"
    )
    with pytest.raises(ValueError, match="no decode bucket fits 1 sequences at context 2049"):
        grid.select_decode(1, 2049)
    with pytest.raises(ValueError, match="num_seqs >= 1"):
        grid.select_decode(0, 10)


def test_select_prefill():
    grid = make_grid(BucketSpec.from_dict(spec_dict()))
    assert grid.select_prefill(1, 10, 10) == PrefillBucket(1, 16, 64)
    assert grid.select_prefill(2, 50, 100) == PrefillBucket(2, 64, 256)
    assert grid.select_prefill(3, 16, 64) == PrefillBucket(4, 16, 64)
    assert grid.select_prefill(1, 200, 200) == PrefillBucket(1, 256, 256)
    assert grid.select_prefill(1, 200, 300) == PrefillBucket(1, 256, 1024)
    # 3 sequences with chunks over 16 tokens: batch 4 x 64 = 256 padded tokens > budget 128, pruned
    with pytest.raises(ValueError) as info:
        grid.select_prefill(3, 17, 64)
    assert str(info.value) == (
        "no prefill bucket fits 3 sequences with chunks of 17 tokens at context 64 "
        "(largest: batch 4, chunk 256, context 1024)"
    )
    with pytest.raises(ValueError, match="max_chunk_len <= max_context_len"):
        grid.select_prefill(1, 20, 10)


# -- pruning ----------------------------------------------------------------------------------------


def test_pruning_exact_lists():
    grid = make_grid(BucketSpec.from_dict(spec_dict()))
    # D1: batch 8 needs >= 5 running sequences > max_num_seqs=3
    assert grid.decode_buckets == [DecodeBucket(b, c) for b in (1, 2, 4) for c in (64, 256, 1024)]
    assert grid.prefill_buckets == [
        # batch 1 (alone, may pad beyond the budget): chunk 256 needs context > 64 (P5)
        PrefillBucket(1, 16, 64), PrefillBucket(1, 16, 256), PrefillBucket(1, 16, 1024),
        PrefillBucket(1, 64, 64), PrefillBucket(1, 64, 256), PrefillBucket(1, 64, 1024),
        PrefillBucket(1, 256, 256), PrefillBucket(1, 256, 1024),
        # batch 2: 2 x 256 > 128 tokens (P2)
        PrefillBucket(2, 16, 64), PrefillBucket(2, 16, 256), PrefillBucket(2, 16, 1024),
        PrefillBucket(2, 64, 64), PrefillBucket(2, 64, 256), PrefillBucket(2, 64, 1024),
        # batch 4: 4 x 64 > 128 tokens (P2)
        PrefillBucket(4, 16, 64), PrefillBucket(4, 16, 256), PrefillBucket(4, 16, 1024),
    ]  # fmt: skip
    assert (grid.max_context_len, grid.max_decode_batch_size, grid.max_prefill_batch_size) == (1024, 4, 4)
    assert grid.max_chunk_len == 256
    assert grid.num_executables == 9 + 17


def test_pruning_by_max_model_len():
    grid = make_grid(BucketSpec.from_dict(spec_dict()), max_model_len=200, max_num_seqs=1)
    # context 1024 is only selected above 256 tokens > max_model_len (D2, P3)
    assert grid.decode_buckets == [DecodeBucket(1, 64), DecodeBucket(1, 256)]
    assert grid.prefill_buckets == [
        PrefillBucket(1, 16, 64), PrefillBucket(1, 16, 256),
        PrefillBucket(1, 64, 64), PrefillBucket(1, 64, 256),
        PrefillBucket(1, 256, 256),
    ]  # fmt: skip
    assert grid.context_lengths == [64, 256]
    assert grid.max_context_len == 256


def test_max_model_len_rounds_up_to_a_context_bucket():
    grid = make_grid(BucketSpec.from_dict(spec_dict()), max_model_len=256)
    assert grid.max_context_len == 256
    grid = make_grid(BucketSpec.from_dict(spec_dict()), max_model_len=257)
    assert grid.max_context_len == 1024


def test_pruning_by_kv_pool():
    spec = BucketSpec.from_dict(
        spec_dict(
            decode__batch_sizes=[1, 2, 4, 8, 16, 32], context__lengths=[256, 512], prefill__lengths=[16]
        )
    )
    grid = make_grid(spec, max_model_len=512, max_num_seqs=32, num_blocks=32)
    # D3: 17 sequences, one of 257 tokens, need 16 + 17 = 33 blocks > 32
    assert [b for b in grid.decode_buckets if b.context_len == 512] == [
        DecodeBucket(b, 512) for b in (1, 2, 4, 8, 16)
    ]
    assert DecodeBucket(32, 256) in grid.decode_buckets


def test_budget_rounds_up_for_a_lone_sequence():
    # a 100-token budget: one sequence may run a 100-token chunk on the 128 bucket
    spec = BucketSpec.from_toml_text(CPU_LIKE)
    grid = cpu_like_grid(max_num_batched_tokens=100, max_num_seqs=4)
    assert spec.prefill_batch_sizes == (1,)
    assert sorted({b.chunk_len for b in grid.prefill_buckets}) == [32, 128]
    assert grid.select_prefill(1, 100, 100) == PrefillBucket(1, 128, 256)


def test_grid_limit_errors():
    spec = BucketSpec.from_dict(spec_dict(), source="x.toml")
    with pytest.raises(ValueError) as info:
        make_grid(spec, max_model_len=1025)
    assert str(info.value) == (
        "max_model_len=1025 exceeds the largest context bucket 1024 in x.toml; "
        "lower max_model_len or add a larger [context] lengths entry"
    )
    with pytest.raises(ValueError) as info:
        make_grid(spec, num_blocks=10)
    assert str(info.value) == (
        "The model's max seq len (1000) is larger than the maximum number of tokens that can be stored "
        "in the KV cache (160 = 10 blocks of 16). Increase the KV cache (gpu_memory_utilization or "
        "num_kv_blocks) or decrease max_model_len."
    )
    with pytest.raises(ValueError) as info:
        make_grid(spec, max_num_seqs=9)
    assert str(info.value) == (
        "max_num_seqs=9 exceeds the largest decode batch size 8 in x.toml; "
        "lower max_num_seqs or add a larger [decode] batch_sizes entry"
    )
    with pytest.raises(
        ValueError, match="x.toml: \\[context\\] lengths must be multiples of block_size 128, got 64"
    ):
        make_grid(spec, block_size=128, num_blocks=100)
    with pytest.raises(ValueError, match="num_blocks must be a positive integer, got 0"):
        make_grid(spec, num_blocks=0)


def test_check_request():
    grid = make_grid(BucketSpec.from_dict(spec_dict()))
    grid.check_request(900, 100)
    grid.check_request(999, None)
    with pytest.raises(ValueError) as info:
        grid.check_request(900, 200)
    assert str(info.value) == (
        "This model's maximum context length is 1000 tokens. However, you requested 1100 tokens "
        "(900 in the messages, 200 in the completion). "
        "Please reduce the length of the messages or completion."
    )
    with pytest.raises(ValueError) as info:
        grid.check_request(1000, None)
    assert str(info.value) == (
        "This model's maximum context length is 1000 tokens. However, your messages resulted in 1000 "
        "tokens, which leaves no room for the completion. Please reduce the length of the messages."
    )
    with pytest.raises(ValueError, match="The prompt is empty"):
        grid.check_request(0, 10)


def test_format_table():
    grid = make_grid(BucketSpec.from_dict(spec_dict(), source="x.toml"), max_model_len=200, max_num_seqs=2)
    assert grid.format_table() == "\n".join(
        [
            "bucket grid from x.toml (block_size=16, max_model_len=200, max_num_seqs=2, "
            "max_num_batched_tokens=128, num_blocks=200)",
            "decode: 4 executables",
            "         batch    64   256  1024",
            "             1     x     x     -",
            "             2     x     x     -",
            "             4     -     -     -",
            "             8     -     -     -",
            "prefill: 9 executables",
            "  batch x chunk    64   256  1024",
            "        1 x 16     x     x     -",
            "        1 x 64     x     x     -",
            "       1 x 256     -     x     -",
            "        2 x 16     x     x     -",
            "        2 x 64     x     x     -",
            "       2 x 256     -     -     -",
            "        4 x 16     -     -     -",
            "        4 x 64     -     -     -",
            "       4 x 256     -     -     -",
            "total: 13 executables (columns: context length; x = compiled, - = pruned, "
            "no admissible batch selects it)",
        ]
    )


def test_padding_accounting():
    assert padding_waste(3, DecodeBucket(4, 256)) == 0.25
    assert padding_waste(100, PrefillBucket(2, 64, 256)) == pytest.approx(28 / 128)
    stats = PaddingStats()
    stats.record(DecodeBucket(4, 256), num_real_tokens=3, real_context_tokens=300)
    stats.record(PrefillBucket(1, 128, 256), num_real_tokens=96, real_context_tokens=96)
    assert (stats.decode_real_tokens, stats.decode_padded_tokens) == (3, 4)
    assert (stats.prefill_real_tokens, stats.prefill_padded_tokens) == (96, 128)
    assert stats.decode_waste == 0.25 and stats.prefill_waste == 0.25
    assert stats.context_waste == pytest.approx(1 - 396 / 1280)
    assert PaddingStats().decode_waste == 0.0


# -- mixed buckets ----------------------------------------------------------------------------------


def mixed_spec(batch_sizes, token_counts, **overrides):
    data = spec_dict(mixed__batch_sizes=batch_sizes, mixed__token_counts=token_counts, **overrides)
    return BucketSpec.from_dict(data, source="x.toml")


def test_mixed_bucket():
    bucket = MixedBucket(num_tokens=64, batch_size=4, context_len=256)
    assert (bucket.num_tokens, bucket.batch_size, bucket.context_len) == (64, 4, 256)
    assert bucket.num_pages(16) == 16
    assert sorted([MixedBucket(128, 2, 64), MixedBucket(64, 8, 256), MixedBucket(64, 4, 1024)]) == [
        MixedBucket(64, 4, 1024), MixedBucket(64, 8, 256), MixedBucket(128, 2, 64)
    ]  # fmt: skip
    assert padding_waste(48, bucket) == 0.25


def test_parse_mixed_table():
    spec = BucketSpec.from_toml_text(CPU_LIKE + "[mixed]\nbatch_sizes = [8, 32]\ntoken_counts = [64, 256]\n")
    assert (spec.mixed_batch_sizes, spec.mixed_token_counts) == ((8, 32), (64, 256))
    without = BucketSpec.from_toml_text(CPU_LIKE)
    assert (without.mixed_batch_sizes, without.mixed_token_counts) == ((), ())
    assert spec != without and spec.replace(mixed_batch_sizes=(), mixed_token_counts=()) == without
    built = BucketSpec((1,), (1,), (16,), (64,), 16, mixed_batch_sizes=[2, 4], mixed_token_counts=[8])
    assert (built.mixed_batch_sizes, built.mixed_token_counts) == ((2, 4), (8,))  # lists become tuples


@pytest.mark.parametrize(
    ("mixed", "message"),
    [
        ({"batch_sizes": [2, 8]}, "x.toml: missing [mixed] token_counts"),
        ({"token_counts": [64]}, "x.toml: missing [mixed] batch_sizes"),
        (
            {"batch_sizes": [2], "token_counts": [64], "rows": [2]},
            "x.toml: unknown key [mixed] rows (known: batch_sizes, token_counts, token_budget)",
        ),
        (
            {"batch_sizes": [], "token_counts": []},
            "x.toml: [mixed] batch_sizes must be a non-empty list of positive integers, got []",
        ),
        (
            {"batch_sizes": [2], "token_counts": []},
            "x.toml: [mixed] token_counts must be a non-empty list of positive integers, got []",
        ),
        (
            {"batch_sizes": [0, 2], "token_counts": [64]},
            "x.toml: [mixed] batch_sizes must contain positive integers, got 0",
        ),
        (
            {"batch_sizes": [2], "token_counts": [64, True]},
            "x.toml: [mixed] token_counts must contain positive integers, got True",
        ),
        (
            {"batch_sizes": [2], "token_counts": [256, 64]},
            "x.toml: [mixed] token_counts must be sorted ascending without repeats, got [256, 64]",
        ),
        (
            {"batch_sizes": [8, 8], "token_counts": [64]},
            "x.toml: [mixed] batch_sizes must be sorted ascending without repeats, got [8, 8]",
        ),
        ([2, 8], "x.toml: [mixed] must be a table, got [2, 8]"),
    ],
)
def test_mixed_validation_errors(mixed, message):
    with pytest.raises(ValueError) as info:
        BucketSpec.from_dict(spec_dict(mixed=mixed), source="x.toml")
    assert str(info.value) == message


def test_mixed_fields_are_both_or_neither():
    with pytest.raises(ValueError) as info:
        BucketSpec((1,), (1,), (16,), (64,), mixed_batch_sizes=(2,), source="x.toml")
    assert str(info.value) == "x.toml: [mixed] token_counts must be a non-empty list of positive integers, got ()"


def test_no_mixed_table_no_mixed_buckets():
    grid = make_grid(BucketSpec.from_dict(spec_dict()))
    assert grid.mixed_buckets == []
    assert (grid.has_mixed, grid.max_mixed_batch_size, grid.max_mixed_tokens) == (False, 0, 0)
    assert grid.find_mixed(2, 2, 2) is None


def test_mixed_pruning_m1_rows():
    # max_num_seqs=3: batch 1 is never mixed (R >= 2); batch 8 needs >= 5 running sequences
    grid = make_grid(mixed_spec([1, 2, 4, 8], [64]))
    assert grid.mixed_buckets == [MixedBucket(64, r, c) for r in (2, 4) for c in (64, 256, 1024)]
    assert (grid.has_mixed, grid.max_mixed_batch_size, grid.max_mixed_tokens) == (True, 4, 64)


def test_mixed_pruning_m2_tokens():
    spec = mixed_spec(
        [2, 8, 16], [2, 4, 64, 256, 512], decode__batch_sizes=[1, 2, 4, 8, 16], context__lengths=[1024]
    )
    grid = make_grid(spec, max_num_seqs=16, max_num_batched_tokens=128)
    # 512: its real tokens (> 256) exceed the budget 128; 256 is kept (> 64 real tokens, padded beyond);
    # batch 8 has >= 3 rows, so >= 3 tokens (not 2); batch 16 has >= 9 rows (not 2 or 4)
    assert grid.mixed_buckets == [
        MixedBucket(2, 2, 1024), MixedBucket(4, 2, 1024), MixedBucket(64, 2, 1024), MixedBucket(256, 2, 1024),
        MixedBucket(4, 8, 1024), MixedBucket(64, 8, 1024), MixedBucket(256, 8, 1024),
        MixedBucket(64, 16, 1024), MixedBucket(256, 16, 1024),
    ]  # fmt: skip
    assert grid.max_mixed_tokens == 256
    # an engine without a latency target: mixed steps stop at the spec's token_budget (here 64)
    limited = make_grid(spec, max_num_seqs=16, max_num_batched_tokens=512, mixed_token_limit=64)
    assert limited.mixed_buckets == [
        MixedBucket(2, 2, 1024), MixedBucket(4, 2, 1024), MixedBucket(64, 2, 1024),
        MixedBucket(4, 8, 1024), MixedBucket(64, 8, 1024), MixedBucket(64, 16, 1024),
    ]  # fmt: skip
    assert limited.mixed_token_limit == 64 and make_grid(spec, max_num_batched_tokens=128).mixed_token_limit == 128


def test_mixed_pruning_m3_context():
    # context 1024 is only selected above 256 tokens > max_model_len 200
    grid = make_grid(mixed_spec([2], [16, 64]), max_model_len=200)
    assert grid.mixed_buckets == [
        MixedBucket(16, 2, 64), MixedBucket(16, 2, 256), MixedBucket(64, 2, 64), MixedBucket(64, 2, 256)
    ]  # fmt: skip


def test_mixed_pruning_m4_kv_pool():
    spec = mixed_spec([2, 16, 32], [64], decode__batch_sizes=[1, 2, 4, 8, 16, 32], context__lengths=[256, 512])
    grid = make_grid(spec, max_model_len=512, max_num_seqs=32, num_blocks=32)
    # 17 rows, one of 257 tokens context: 16 + 17 = 33 blocks > 32
    assert grid.mixed_buckets == [
        MixedBucket(64, 2, 256), MixedBucket(64, 2, 512),
        MixedBucket(64, 16, 256), MixedBucket(64, 16, 512),
        MixedBucket(64, 32, 256),
    ]  # fmt: skip


def test_mixed_pruning_m5_rows_hold_their_context():
    # 2 rows at context 64 hold at most 128 tokens: more than 128 never run on (256, 2, 64)
    grid = make_grid(mixed_spec([2, 4], [64, 128, 256]), max_num_seqs=4, max_num_batched_tokens=256)
    assert grid.mixed_buckets == [
        MixedBucket(t, 2, c) for t in (64, 128, 256) for c in (64, 256, 1024) if (t, c) != (256, 64)
    ] + [MixedBucket(t, 4, c) for t in (64, 128, 256) for c in (64, 256, 1024)]
    # closest: more rows at a smaller context before fewer rows at a larger one
    assert grid.select_mixed(2, 200, 60) == MixedBucket(256, 4, 64)


def test_select_mixed():
    grid = make_grid(mixed_spec([2, 4, 8], [16, 64, 256], decode__batch_sizes=[1, 2, 4, 8]), max_num_seqs=8)
    assert len(grid.mixed_buckets) == 27  # nothing pruned
    assert grid.select_mixed(2, 10, 50) == MixedBucket(16, 2, 64)
    assert grid.select_mixed(3, 16, 64) == MixedBucket(16, 4, 64)
    assert grid.select_mixed(3, 20, 100) == MixedBucket(64, 4, 256)
    assert grid.select_mixed(5, 5, 1000) == MixedBucket(16, 8, 1024)
    assert grid.select_mixed(2, 100, 300) == MixedBucket(256, 2, 1024)
    assert grid.select_mixed(8, 256, 1024) == MixedBucket(256, 8, 1024)
    assert grid.find_mixed(9, 10, 10) is None
    with pytest.raises(ValueError) as info:
        grid.select_mixed(9, 10, 10)
    assert str(info.value) == (
        "no mixed bucket fits 9 rows with 10 tokens at context 10 (largest: batch 8, tokens 256, context 1024)"
    )
    with pytest.raises(ValueError, match=r"^no mixed bucket fits 2 rows with 257 tokens at context 300 "):
        grid.select_mixed(2, 257, 300)
    with pytest.raises(ValueError, match=r"^no mixed bucket fits 2 rows with 2 tokens at context 1025 "):
        grid.select_mixed(2, 2, 1025)


@pytest.mark.parametrize(("args"), [(0, 5, 5), (3, 2, 5), (2, 2, 0)])
def test_select_mixed_argument_errors(args):
    grid = make_grid(mixed_spec([2, 4], [16]))
    with pytest.raises(ValueError) as info:
        grid.select_mixed(*args)
    assert str(info.value) == (
        "select_mixed needs num_rows >= 1, num_tokens >= num_rows and max_context_len >= 1, got "
        + ", ".join(map(str, args))
    )


def test_select_mixed_without_mixed_buckets():
    with pytest.raises(ValueError) as info:
        make_grid(BucketSpec.from_dict(spec_dict(), source="x.toml")).select_mixed(2, 2, 2)
    assert str(info.value) == "no mixed bucket fits 2 rows with 2 tokens at context 2 (x.toml has no [mixed] table)"
    with pytest.raises(ValueError) as info:
        make_grid(mixed_spec([1], [16])).select_mixed(2, 2, 2)
    assert str(info.value) == (
        "no mixed bucket fits 2 rows with 2 tokens at context 2 (every mixed bucket of x.toml is pruned at "
        "these limits)"
    )


def test_max_batch_size_covers_mixed_rows():
    # max_num_seqs 8 selects mixed batch 16 for 3..8 rows: more rows than any decode or prefill bucket
    grid = make_grid(mixed_spec([2, 16], [64], decode__batch_sizes=[1, 2, 4, 8]), max_num_seqs=8)
    assert (grid.max_decode_batch_size, grid.max_prefill_batch_size, grid.max_mixed_batch_size) == (8, 4, 16)
    assert grid.max_batch_size == 16
    assert grid.num_executables == len(grid.decode_buckets) + len(grid.prefill_buckets) + 6
    assert grid.context_lengths == [64, 256, 1024] and grid.max_context_len == 1024


def test_format_table_mixed_section():
    grid = make_grid(mixed_spec([1, 2, 4], [4, 32]), max_model_len=200, max_num_seqs=2)
    lines = grid.format_table().splitlines()
    plain = make_grid(BucketSpec.from_dict(spec_dict(), source="x.toml"), max_model_len=200, max_num_seqs=2)
    assert lines[:18] == plain.format_table().splitlines()[:-1]  # header, decode and prefill as before
    assert lines[18:] == [
        "mixed: 4 executables",
        "  batch x tokens    64   256  1024",
        "           1 x 4     -     -     -",
        "          1 x 32     -     -     -",
        "           2 x 4     x     x     -",
        "          2 x 32     x     x     -",
        "           4 x 4     -     -     -",
        "          4 x 32     -     -     -",
        "total: 17 executables (columns: context length; x = compiled, - = pruned, "
        "no admissible batch selects it)",
    ]


def test_padding_accounting_mixed():
    stats = PaddingStats()
    stats.record(MixedBucket(64, 4, 256), num_real_tokens=40, real_context_tokens=500)
    stats.record(DecodeBucket(4, 256), num_real_tokens=3, real_context_tokens=300)
    assert (stats.mixed_real_tokens, stats.mixed_padded_tokens) == (40, 64)
    assert (stats.decode_real_tokens, stats.decode_padded_tokens) == (3, 4)
    assert (stats.prefill_real_tokens, stats.prefill_padded_tokens) == (0, 0)
    assert stats.mixed_waste == pytest.approx(24 / 64)
    assert stats.context_waste == pytest.approx(1 - 800 / 2048)
    assert PaddingStats().mixed_waste == 0.0


# -- serving before the grid is complete: the covering set ------------------------------------------


def test_covering_buckets_hold_every_kept_bucket():
    grid = make_grid(BucketSpec.from_dict(spec_dict()))
    assert grid.covering_buckets() == [
        PrefillBucket(1, 256, 1024), PrefillBucket(2, 64, 1024), PrefillBucket(4, 16, 1024), DecodeBucket(4, 1024),
    ]
    mixed = make_grid(BucketSpec.from_dict(spec_dict(mixed={"batch_sizes": [2, 4], "token_counts": [16, 64]})))
    assert [b for b in mixed.covering_buckets() if isinstance(b, MixedBucket)] == [MixedBucket(64, 4, 1024)]


def test_serving_on_the_covering_set_pads_and_reports_the_bucket_it_wanted():
    grid = make_grid(BucketSpec.from_dict(spec_dict()))
    wanted = []
    grid.serve_only(grid.covering_buckets())
    grid.on_miss = wanted.append
    assert (grid.is_complete, grid.num_ready) == (False, 4)
    assert not grid.is_ready(DecodeBucket(1, 64))
    assert grid.select_decode(1, 10) == DecodeBucket(4, 1024)
    assert grid.select_prefill(1, 20, 20) == PrefillBucket(2, 64, 1024)  # the fewest padded tokens of the ready
    assert grid.select_prefill(3, 10, 1000) == PrefillBucket(4, 16, 1024)  # ready, and the smallest: no miss
    assert wanted == [DecodeBucket(1, 64), PrefillBucket(1, 64, 64)]
    grid.mark_ready([DecodeBucket(1, 64)])
    assert grid.select_decode(1, 10) == DecodeBucket(1, 64)
    assert grid.select_decode(2, 10) == DecodeBucket(4, 1024)  # (2, 64) is still building
    grid.mark_ready(grid.buckets)
    assert (grid.is_complete, grid.num_ready) == (True, 26)
    assert grid.select_decode(2, 10) == DecodeBucket(2, 64)


def test_serve_only_needs_the_covering_set():
    grid = make_grid(BucketSpec.from_dict(spec_dict()))
    with pytest.raises(ValueError, match=r"must hold every admissible step: missing \[DecodeBucket\(batch_size=4, "
                                         r"context_len=1024\)\]"):
        grid.serve_only(grid.covering_buckets()[:3])
