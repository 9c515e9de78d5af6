"""Orbax checkpoints: scripts/convert_checkpoint.py from a Hugging Face directory and from a GGUF file,
loading with `load_model` / `LLM(model=<dir>)`, identical weights, logits and greedy tokens, dtype cast on
restore, and clear errors. (Restoring into a multi-device sharding is tested in test_tensor_parallel.)"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from jaxserve import LLM, SamplingParams
from jaxserve.testing.hf_reference import hf_logits
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_gguf import make_tiny_gguf
from jaxserve.testing.tiny_models import make_tiny_model
from jaxserve.weights import load_config, load_model
from jaxserve.weights.orbax_dir import MARKER_FILE
from tests.forward import PagedForward
from tests.paths import load_script

TOKENS = [1, 17, 200, 3, 99, 45, 45, 8, 120, 250, 11, 64, 7, 31]


def convert_checkpoint(*argv: str) -> int:
    return load_script("convert_checkpoint").main([str(a) for a in argv])


def assert_same_params(got: dict, expected: dict) -> None:
    got, expected = flatten_dict(got), flatten_dict(expected)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == value.dtype, key
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(value), err_msg=str(key))


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    hf_dir = make_tiny_model(root / "hf", "llama", seed=5)
    assert convert_checkpoint(hf_dir, root / "orbax") == 0
    return hf_dir, root / "orbax"


def test_checkpoint_directory_holds_params_config_and_tokenizer(llama_dirs):
    _, orbax_dir = llama_dirs
    marker = json.loads((orbax_dir / MARKER_FILE).read_text())
    assert (marker["format_version"], marker["dtype"], marker["compressed"]) == (1, "float32", False)
    assert (orbax_dir / "params").is_dir()
    assert (orbax_dir / "config.json").is_file() and (orbax_dir / "tokenizer.json").is_file()


def test_round_trip_gives_identical_config_weights_and_logits(llama_dirs):
    hf_dir, orbax_dir = llama_dirs
    original, restored = load_model(str(hf_dir)), load_model(str(orbax_dir))
    assert restored.config == original.config == load_config(orbax_dir)
    assert_same_params(restored.params, original.params)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(restored.params))  # already on device
    assert restored.tokenizer("héllo wörld").input_ids == original.tokenizer("héllo wörld").input_ids
    expected = PagedForward(original.config, original.params).run(TOKENS, [0, 1, 2, 3], [9, 5])
    got = PagedForward(restored.config, restored.params).run(TOKENS, [0, 1, 2, 3], [9, 5])
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_allclose(got, hf_logits(hf_dir, TOKENS), atol=2e-5, rtol=0)


def test_restore_casts_to_the_serving_dtype(llama_dirs):
    hf_dir, orbax_dir = llama_dirs
    restored = load_model(str(orbax_dir), "bfloat16")
    assert_same_params(restored.params, load_model(str(hf_dir), "bfloat16").params)


def test_llm_serves_the_checkpoint_with_the_same_greedy_tokens(llama_dirs, tmp_path):
    hf_dir, orbax_dir = llama_dirs
    buckets = small_bucket_file(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = ["hello there", "paged attention"]
    outputs = [
        [o.outputs[0].token_ids for o in LLM(str(d), dtype="float32", buckets=buckets, max_model_len=128).generate(
            prompts, params, use_tqdm=False)]
        for d in (hf_dir, orbax_dir)
    ]
    assert outputs[0] == outputs[1]
    assert all(len(t) == 10 for t in outputs[0])


def test_a_quantized_checkpoint_keeps_its_stored_values_in_any_serving_dtype(llama_dirs, tmp_path):
    from jaxserve.config.quantization_config import parse_quantization
    from jaxserve.quantization.weights import quantize_params

    hf_dir, _ = llama_dirs
    assert convert_checkpoint(hf_dir, tmp_path / "int8", "--quantization", "int8_w8a8") == 0
    scheme = parse_quantization("int8_w8a8")
    for dtype in ("float32", "bfloat16"):
        restored = load_model(str(tmp_path / "int8"), dtype)
        assert restored.config.quantization == scheme
        expected = quantize_params(load_model(str(hf_dir), "float32").params, scheme)
        expected = jax.tree_util.tree_map_with_path(  # the float leaves in the serving dtype, the rest as stored
            lambda path, x, dtype=dtype: x if x.dtype.itemsize == 1 or str(path[-1].key).endswith("_scale")
            else x.astype(dtype), expected)
        assert_same_params(restored.params, expected)
        assert flatten_dict(restored.params)[("params", "layers", "self_attn", "q_proj", "kernel")].dtype == np.int8


def test_a_gguf_file_converted_with_its_blocks_restores_them_as_stored(tmp_path):
    import gguf

    hf_dir = make_tiny_model(tmp_path / "hf", "llama", seed=3)
    kinds = {"attn_q": gguf.GGMLQuantizationType.Q4_1, "ffn_down": gguf.GGMLQuantizationType.Q8_0}
    gguf_path = make_tiny_gguf(tmp_path / "tiny.gguf", hf_dir, kinds)
    assert convert_checkpoint(gguf_path, tmp_path / "orbax", "--dtype", "bfloat16", "--quantization", "gguf") == 0
    restored = load_model(str(tmp_path / "orbax"), "bfloat16")
    assert restored.config.quantization.name == "gguf" and restored.config.quantization.group_size == 32
    expected = load_model(str(gguf_path), "bfloat16", quantization="gguf").params
    assert_same_params(restored.params, expected)  # codes int8, group scales and offsets float32, the rest bfloat16
    leaf = flatten_dict(restored.params)
    assert leaf[("params", "layers", "mlp", "down_proj", "group_offset")].dtype == np.float32
    assert leaf[("params", "layers", "self_attn", "q_proj", "kernel")].dtype == np.int8


def test_gguf_file_converts(tmp_path):
    hf_dir = make_tiny_model(tmp_path / "hf", "llama", seed=2)
    gguf_path = make_tiny_gguf(tmp_path / "tiny.gguf", hf_dir)
    assert convert_checkpoint(gguf_path, tmp_path / "orbax", "--dtype", "bfloat16") == 0
    from_gguf = load_model(str(gguf_path), "bfloat16")
    restored = load_model(str(tmp_path / "orbax"), "bfloat16")
    assert restored.config == from_gguf.config
    assert_same_params(restored.params, from_gguf.params)
    assert_same_params(from_gguf.params, load_model(str(hf_dir), "bfloat16").params)  # the GGUF is faithful
    ids = restored.tokenizer("the hero").input_ids
    assert ids == from_gguf.tokenizer("the hero").input_ids and 319 in ids  # the GGUF's one merge, "he"


def test_compressed_gpt2_round_trip_logits(tmp_path):
    hf_dir = make_tiny_model(tmp_path / "hf", "gpt2")
    assert convert_checkpoint(hf_dir, tmp_path / "orbax", "--compress") == 0
    assert json.loads((tmp_path / "orbax" / MARKER_FILE).read_text())["compressed"] is True
    restored = load_model(str(tmp_path / "orbax"))
    assert_same_params(restored.params, load_model(str(hf_dir)).params)
    got = PagedForward(restored.config, restored.params).run(TOKENS, [3, 1, 2, 0], [14])
    np.testing.assert_allclose(got, hf_logits(hf_dir, TOKENS), atol=2e-5, rtol=0)


def test_mixed_dense_and_moe_layers_round_trip_logits(tmp_path):
    """A Qwen3-MoE whose layers 0 and 2 are dense (mlp_only_layers): the per-layer tree round-trips, and its
    config's MLP pattern with it."""
    hf_dir = make_tiny_model(tmp_path / "hf", "qwen3_moe", num_hidden_layers=3, mlp_only_layers=[0, 2])
    assert convert_checkpoint(hf_dir, tmp_path / "orbax") == 0
    restored = load_model(str(tmp_path / "orbax"))
    assert restored.config.sparse_layers == (False, True, False)
    assert_same_params(restored.params, load_model(str(hf_dir)).params)
    got = PagedForward(restored.config, restored.params).run(TOKENS, [3, 1, 2, 0], [9, 5])
    np.testing.assert_allclose(got, hf_logits(hf_dir, TOKENS), atol=2e-5, rtol=0)


def test_existing_output_is_refused(llama_dirs):
    hf_dir, orbax_dir = llama_dirs
    with pytest.raises(FileExistsError, match=f"output {orbax_dir} already exists"):
        convert_checkpoint(hf_dir, orbax_dir)


def test_unknown_format_version_is_a_clear_error(llama_dirs, tmp_path):
    import shutil

    _, orbax_dir = llama_dirs
    copy = Path(shutil.copytree(orbax_dir, tmp_path / "copy"))
    marker = json.loads((copy / MARKER_FILE).read_text())
    (copy / MARKER_FILE).write_text(json.dumps({**marker, "format_version": 99}))
    with pytest.raises(ValueError, match="checkpoint format version 99 is not supported"):
        load_model(str(copy))
