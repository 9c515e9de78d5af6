"""The converted-weights cache: a GGUF file's second load maps the stored tree, bit for bit the converted one, without
parsing the file; a changed file, another dtype or quantization misses; an entry that does not read back whole is
converted and written again; a cache that cannot be written only costs the conversion."""

from __future__ import annotations

import json
import os

import gguf
import ml_dtypes
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from jaxserve.config.quantization_config import parse_quantization
from jaxserve.testing.tiny_gguf import QUANTIZED_LAYER_TYPES, make_tiny_gguf
from jaxserve.testing.tiny_models import make_tiny_model
from jaxserve.weights import converted_cache, load_config, load_model
from jaxserve.weights.converted_cache import (
    ENTRY_FILE,
    WEIGHTS_CACHE_ENV,
    cached_conversion,
    converted_weights_dir,
    weights_cache_dir,
)
from jaxserve.weights.gguf_file import gguf_model_config, load_gguf


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    directory = tmp_path_factory.mktemp("converted_cache")
    return make_tiny_gguf(directory / "tiny.gguf", make_tiny_model(directory / "hf", "llama", seed=3))


@pytest.fixture(scope="module")
def quantized_gguf_path(tmp_path_factory):
    directory = tmp_path_factory.mktemp("converted_cache_blocks")
    hf_dir = make_tiny_model(directory / "hf", "llama", seed=5)
    return make_tiny_gguf(directory / "tiny.gguf", hf_dir, QUANTIZED_LAYER_TYPES)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    directory = tmp_path / "weights"
    monkeypatch.setenv(WEIGHTS_CACHE_ENV, str(directory))
    return directory


class CountingConverter:
    """`load_gguf`, counting its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, path, dtype, quantization):
        self.calls += 1
        return load_gguf(path, dtype, quantization)


def forbid_gguf_parse(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)


def assert_bit_identical(got: dict, expected: dict) -> None:
    got, expected = flatten_dict(got), flatten_dict(expected)
    assert sorted(got) == sorted(expected)
    for name, array in expected.items():
        assert (got[name].dtype, got[name].shape) == (array.dtype, array.shape), name
        assert got[name].tobytes() == array.tobytes(), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_second_load_maps_the_converted_tree_without_parsing_the_file(gguf_path, cache_dir, tmp_path,
                                                                          monkeypatch, dtype):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the tokenizer's cache
    hf_config, reference = load_gguf(gguf_path, dtype)
    first = load_model(str(gguf_path), dtype)
    entry = converted_weights_dir(cache_dir, gguf_path, dtype, None)
    assert [p.name for p in cache_dir.iterdir()] == [entry.name] and entry.name.startswith("tiny-")
    forbid_gguf_parse(monkeypatch)
    second = load_model(str(gguf_path), dtype)
    assert second.config == first.config == gguf_model_config(hf_config)
    assert_bit_identical(first.params, reference)
    assert_bit_identical(second.params, reference)
    leaves = flatten_dict(second.params)
    assert {leaf.dtype for leaf in leaves.values()} == {np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)}
    assert all(type(leaf) is np.ndarray and not leaf.flags.writeable for leaf in leaves.values())
    assert second.tokenizer("Hello").input_ids == first.tokenizer("Hello").input_ids


def test_a_gguf_config_is_read_once_then_from_the_cache_and_a_changed_file_is_read_again(gguf_path, cache_dir,
                                                                                         tmp_path, monkeypatch):
    path = tmp_path / "copy.gguf"
    path.write_bytes(gguf_path.read_bytes())
    expected = gguf_model_config(load_gguf(path, "float32")[0])
    assert load_config(path) == expected
    key = converted_cache.file_cache_name(path, converted_cache.conversion_code_hash())
    assert [p.name for p in cache_dir.iterdir()] == [f"{key}.config.json"]
    forbid_gguf_parse(monkeypatch)
    assert load_config(path) == expected
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with pytest.raises(AssertionError, match="the GGUF file was parsed"):
        load_config(path)


def test_bfloat16_leaves_are_stored_as_their_bytes(gguf_path, cache_dir):
    cached_conversion(gguf_path, "bfloat16", None, load_gguf)
    entry = converted_weights_dir(cache_dir, gguf_path, "bfloat16", None)
    leaf = json.loads((entry / ENTRY_FILE).read_text())["leaves"][0]
    assert (leaf["path"], leaf["dtype"]) == (["params", "embed_tokens", "embedding"], "bfloat16")
    assert np.load(entry / leaf["file"]).dtype == np.uint16


def test_gguf_blocks_are_cached_with_their_scales(quantized_gguf_path, cache_dir, monkeypatch):
    convert = CountingConverter()
    first_config, first = cached_conversion(quantized_gguf_path, "float32", "gguf", convert)
    forbid_gguf_parse(monkeypatch)
    second_config, second = cached_conversion(quantized_gguf_path, "float32", "gguf", convert)
    assert convert.calls == 1 and second_config == first_config
    assert gguf_model_config(second_config, "gguf").quantization == parse_quantization("gguf")
    assert_bit_identical(second, first)
    q_proj = second["params"]["layers"]["self_attn"]["q_proj"]
    assert (q_proj["kernel"].dtype, q_proj["group_scale"].dtype) == (np.int8, np.float32)


def test_dtype_quantization_and_conversion_code_are_in_the_key(gguf_path, cache_dir, monkeypatch):
    base = converted_weights_dir(cache_dir, gguf_path, "float32", None)
    assert base != converted_weights_dir(cache_dir, gguf_path, "bfloat16", None)
    assert base != converted_weights_dir(cache_dir, gguf_path, "float32", "gguf")
    monkeypatch.setattr(converted_cache, "conversion_code_hash", lambda: "another version")
    assert base != converted_weights_dir(cache_dir, gguf_path, "float32", None)


def test_a_changed_file_misses_and_replaces_its_old_entry(gguf_path, cache_dir, tmp_path):
    path = tmp_path / "copy.gguf"
    path.write_bytes(gguf_path.read_bytes())
    convert = CountingConverter()
    cached_conversion(path, "float32", None, convert)
    cached_conversion(path, "bfloat16", None, convert)
    old, other_dtype = (converted_weights_dir(cache_dir, path, dtype, None) for dtype in ("float32", "bfloat16"))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    cached_conversion(path, "float32", None, convert)
    assert convert.calls == 3
    new = converted_weights_dir(cache_dir, path, "float32", None)
    assert new != old and not old.exists()
    # the bfloat16 entry of the old file stays until a bfloat16 load replaces it
    assert sorted(p.name for p in cache_dir.iterdir()) == sorted([new.name, other_dtype.name])


def test_entries_of_removed_files_are_removed_when_an_entry_is_written(gguf_path, cache_dir, tmp_path):
    gone = tmp_path / "gone.gguf"
    gone.write_bytes(gguf_path.read_bytes())
    cached_conversion(gone, "float32", None, load_gguf)
    gone.unlink()
    cached_conversion(gguf_path, "float32", None, load_gguf)
    assert [p.name for p in cache_dir.iterdir()] == [converted_weights_dir(cache_dir, gguf_path, "float32", None).name]


def _truncate_first_leaf(entry):
    leaf = entry / json.loads((entry / ENTRY_FILE).read_text())["leaves"][0]["file"]
    leaf.write_bytes(leaf.read_bytes()[:-8])


def _reshape_first_leaf(entry):
    leaf = entry / json.loads((entry / ENTRY_FILE).read_text())["leaves"][0]["file"]
    np.save(leaf, np.zeros((1, 2), np.float32))


def _remove_last_leaf(entry):
    leaf = entry / json.loads((entry / ENTRY_FILE).read_text())["leaves"][-1]["file"]
    leaf.unlink()


def _garble_entry_file(entry):
    (entry / ENTRY_FILE).write_text('{"leaves": [')


@pytest.mark.parametrize("damage", [_truncate_first_leaf, _reshape_first_leaf, _remove_last_leaf, _garble_entry_file])
def test_an_entry_that_does_not_read_back_whole_is_converted_and_written_again(gguf_path, cache_dir, damage):
    convert = CountingConverter()
    _, reference = cached_conversion(gguf_path, "float32", None, convert)
    entry = converted_weights_dir(cache_dir, gguf_path, "float32", None)
    damage(entry)
    _, again = cached_conversion(gguf_path, "float32", None, convert)
    _, hit = cached_conversion(gguf_path, "float32", None, convert)
    assert convert.calls == 2
    assert_bit_identical(again, reference)
    assert_bit_identical(hit, reference)
    assert [p.name for p in cache_dir.iterdir()] == [entry.name]


def test_a_cache_that_cannot_be_written_costs_only_the_conversion(gguf_path, tmp_path, monkeypatch):
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv(WEIGHTS_CACHE_ENV, str(blocked / "weights"))
    convert = CountingConverter()
    _, params = cached_conversion(gguf_path, "float32", None, convert)
    _, again = cached_conversion(gguf_path, "float32", None, convert)
    assert convert.calls == 2
    assert_bit_identical(again, params)


def test_an_empty_directory_variable_turns_the_cache_off(gguf_path, tmp_path, monkeypatch):
    monkeypatch.setenv(WEIGHTS_CACHE_ENV, "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert weights_cache_dir() is None
    convert = CountingConverter()
    cached_conversion(gguf_path, "float32", None, convert)
    cached_conversion(gguf_path, "float32", None, convert)
    assert convert.calls == 2 and not (tmp_path / "jaxserve").exists()
    monkeypatch.delenv(WEIGHTS_CACHE_ENV)
    assert weights_cache_dir() == tmp_path / "jaxserve" / "weights"


def test_cached_arrays_place_on_the_mesh_as_converted_ones(gguf_path, cache_dir):
    import jax

    from jaxserve.distributed.sharding import make_mesh, shard_params

    _, converted = cached_conversion(gguf_path, "bfloat16", None, load_gguf)
    _, mapped = cached_conversion(gguf_path, "bfloat16", None, load_gguf)
    mesh = make_mesh(1)
    placed, reference = shard_params(mapped, mesh), shard_params(converted, mesh)
    for got, expected in zip(jax.tree_util.tree_leaves(placed), jax.tree_util.tree_leaves(reference), strict=True):
        assert got.sharding == expected.sharding and got.dtype == expected.dtype
        assert np.asarray(got).tobytes() == np.asarray(expected).tobytes()
