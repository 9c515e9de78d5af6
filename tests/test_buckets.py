from pathlib import Path

import pytest

from jaxserve.buckets import (
    BucketGrid,
    BucketSpec,
    DecodeBucket,
    PaddingStats,
    PrefillBucket,
    load_bucket_spec,
    padding_waste,
)

REPO = Path(__file__).resolve().parent.parent

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
            data[table][field] = value
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
        ({"extra": {}}, "x.toml: unknown table [extra] (known: decode, prefill, context)"),
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
    assert Path(spec.source) == REPO / "jaxserve" / "_buckets" / f"{platform}.toml"
    assert spec == load_bucket_spec(str(REPO / "buckets" / f"{platform}.toml"), "cpu")  # the repo-root link
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
    assert grid.num_executables == 26
    short = BucketGrid(
        spec, block_size=16, max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=512, num_blocks=2048
    )
    assert short.num_executables == 13


def test_tpu_spec_is_lane_aligned():
    spec = load_bucket_spec(None, "tpu")
    assert spec.block_size % 64 == 0
    assert all(c % 128 == 0 for c in spec.context_lengths)
    assert all(n % 128 == 0 for n in spec.prefill_lengths)


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
