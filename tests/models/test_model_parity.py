"""Logits parity with transformers on tiny random models of every family, over the paged KV pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.testing.hf_reference import hf_logits
from jaxserve.testing.tiny_models import make_tiny_model
from jaxserve.weights import load_model
from tests.forward import PagedForward

TOKENS = [1, 17, 200, 3, 99, 45, 45, 8, 120, 250, 11, 64, 7, 31]

FAMILIES = {
    "llama-gqa-untied": ("llama", {}),
    "llama-mha-tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama3-rope-scaling": (
        "llama",
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
         "rope_theta": 500000.0},
    ),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 6}),
    "qwen2-bias-tied": ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    family, overrides = FAMILIES[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), family, **overrides)
    return path, load_model(str(path), "float32")


# (tie_word_embeddings, attention_bias, sliding_window, rope_type, num_kv_heads) read from config.json
EXPECTED_CONFIG = {
    "llama-gqa-untied": (False, False, None, "default", 2),
    "llama-mha-tied": (True, False, None, "default", 4),
    "llama3-rope-scaling": (False, False, None, "llama3", 2),
    "llama-linear-rope": (False, False, None, "linear", 2),
    "mistral-sliding-window": (False, False, 6, "default", 2),
    "qwen2-bias-tied": (True, True, None, "default", 1),
}


def test_config_reads_family_features(tiny):
    path, loaded = tiny
    cfg = loaded.config
    got = (cfg.tie_word_embeddings, cfg.attention_bias, cfg.sliding_window, cfg.rope.rope_type, cfg.num_kv_heads)
    assert got == EXPECTED_CONFIG[path.name[:-1]]


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_prefill_logits_match_transformers(tiny, scan_layers):
    path, loaded = tiny
    expected = hf_logits(path, TOKENS)
    forward = PagedForward(loaded.config, loaded.params, scan_layers=scan_layers)
    got = forward.run(TOKENS, [0, 1, 2, 3], [len(TOKENS)])
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=0)
    assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero numbers


def test_scattered_blocks_and_chunks_match_contiguous(tiny):
    _, loaded = tiny
    contiguous = PagedForward(loaded.config, loaded.params).run(TOKENS, [0, 1, 2, 3], [len(TOKENS)])
    scattered_table = [9, 2, 30, 17]
    chunked = PagedForward(loaded.config, loaded.params).run(TOKENS, scattered_table, [6, 6, 1, 1])
    np.testing.assert_allclose(chunked, contiguous, atol=2e-5, rtol=0)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_bfloat16_tracks_float32(tmp_path, scan_layers):
    path = make_tiny_model(tmp_path / "m", "llama")
    expected = hf_logits(path, TOKENS)
    loaded = load_model(str(path), "bfloat16")
    forward = PagedForward(loaded.config, loaded.params, dtype="bfloat16", scan_layers=scan_layers)
    got = forward.run(TOKENS, [0, 1, 2, 3], [7, 7])
    assert got.dtype == np.float32
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() < 0.05 * scale
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.85


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_the_layer_stack_traces_one_layer_and_initializes_the_loaders_layout(tmp_path, monkeypatch, scan_layers):
    """A step traces its decoder layer once however many layers it has (`common.LayerStack`), and the model's
    initialization builds the tree the loaders build (stacked, or one subtree per layer unrolled)."""
    from jaxserve.compilation.precompile import _plain_dicts
    from jaxserve.models import llama

    loaded = load_model(str(make_tiny_model(tmp_path / "m", "llama", num_hidden_layers=5)), "float32")
    forward = PagedForward(loaded.config, loaded.params, scan_layers=scan_layers)
    traces = []
    layer_call = llama.DecoderLayer.__call__
    monkeypatch.setattr(llama.DecoderLayer, "__call__", lambda self, *a: traces.append(1) or layer_call(self, *a))
    meta = AttentionMetadata(block_tables=jnp.zeros((1, 4), jnp.int32), q_start=jnp.zeros(1, jnp.int32),
                             lengths=jnp.full(1, 3, jnp.int32))
    forward._apply.lower(forward.params, forward.pool, jnp.ones((1, 3), jnp.int32), meta)
    assert len(traces) == 1

    init = jax.eval_shape(forward.model.init, jax.random.key(0), jnp.ones((1, 3), jnp.int32), forward.pool, meta)
    shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), _plain_dicts(tree)["params"]["layers"])
    assert shapes(init) == shapes(forward.params)
