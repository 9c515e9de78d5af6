"""An engine that serves on its covering set while the rest of its grid builds in the background: the same tokens as
an engine whose grid was built first, buckets used once they land, nothing compiled on the step path."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.compilation.background import BackgroundCompiler
from jaxserve.core.buckets import DecodeBucket, MixedBucket, PrefillBucket
from jaxserve.testing.tiny_models import VOCAB, make_tiny_model
from tests.engine.test_engine import GRID, workload_subset


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=1)


def _llm(model_dir, **kwargs) -> LLM:
    buckets = model_dir.parent / "grid.toml"
    buckets.write_text(GRID)
    return LLM(str(model_dir), dtype="float32", max_model_len=1024, max_num_seqs=16, buckets=str(buckets),
               strict_no_compile=True, **kwargs)


def _tokens(llm: LLM, requests) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


def test_serves_on_the_covering_set_then_on_each_bucket_that_lands(model_dir, monkeypatch):
    requests = workload_subset(6, 12, VOCAB)
    reference = _tokens(_llm(model_dir), requests)
    monkeypatch.setattr(BackgroundCompiler, "start", lambda self: self)  # nothing builds until the test says so
    llm = _llm(model_dir, background_compile=True)
    engine = llm.llm_engine
    assert engine.grid.covering_buckets() == [PrefillBucket(1, 128, 1024), DecodeBucket(16, 1024),
                                             MixedBucket(128, 16, 1024)]
    stats = engine.make_stats().engine
    assert (stats.num_buckets, stats.num_buckets_ready, engine.grid.is_complete) == (7, 3, False)
    assert _tokens(llm, requests) == reference  # every step padded up to the covering set: the same tokens
    covering_padding = engine.stats.num_padded_tokens
    wanted = engine.parts.background._wanted
    assert wanted[DecodeBucket(4, 1024)] > 0 and wanted[PrefillBucket(1, 32, 1024)] > 0
    monkeypatch.undo()
    engine.parts.background.start()
    assert engine.parts.background.wait(timeout=300)
    stats = engine.make_stats().engine
    assert (stats.num_buckets_ready, engine.grid.is_complete) == (7, True)
    before = engine.stats.num_padded_tokens
    assert _tokens(llm, requests) == reference
    assert engine.stats.num_padded_tokens - before < covering_padding  # the smaller buckets serve now
    assert engine.stats.num_compiles_after_warm_up == 0
    engine.close()
