"""Weight loading: model resolution, GGUF conversion details, and clear loading errors."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from jaxserve.testing.hf_reference import hf_logits
from jaxserve.testing.tiny_gguf import make_tiny_gguf
from jaxserve.testing.tiny_models import longrope_overrides, make_tiny_model
from jaxserve.weights import EMBEDDED_INSTALL, embedded_model_path, load_model, resolve_model_path
from jaxserve.weights.gguf_file import dequantize_tensor, hf_name, unpermute_qk
from tests.forward import PagedForward


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="model not found: .*nowhere.gguf"):
        resolve_model_path(str(tmp_path / "nowhere.gguf"))


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json in model directory"):
        load_model(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(ValueError, match=r"unsupported model architecture \['GPTNeoXForCausalLM'\]; supported: "
                       r"LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        load_model(str(tmp_path))


def test_unsupported_dtype(tmp_path):
    with pytest.raises(ValueError, match="unsupported dtype 'float16'; supported: float32, bfloat16"):
        load_model(str(tmp_path), "float16")


def test_missing_tensor_is_named(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks tensors: model.layers.1.mlp.up_proj.weight"):
        load_model(str(path))


def test_sharded_safetensors_with_index(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, path / file, metadata={"format": "pt"})
    (path / "model.safetensors").unlink()
    weight_map = {n: file for file, part in halves.items() for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_model(str(path))
    np.testing.assert_array_equal(
        loaded.params["params"]["layers"]["mlp"]["up_proj"]["kernel"][1],
        tensors["model.layers.1.mlp.up_proj.weight"].T,
    )


def test_gguf_names_map_to_hf():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None


def test_gemma3_gguf_loads_as_the_hugging_face_model(tmp_path):
    """llama.cpp's Gemma 3 layout: four norms per layer under its own names, norm weights stored as 1 + w,
    the window and head size in the metadata, the sliding layers' rope base fixed at 10000."""
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    hf_dir = make_tiny_model(tmp_path / "hf", "gemma3", query_pre_attn_scalar=24, rope_parameters=rope,
                             num_hidden_layers=7, layer_types=None)  # GGUF: the fixed five-to-one pattern
    gguf_path = make_tiny_gguf(tmp_path / "gemma3.gguf", hf_dir)
    assert hf_name("blk.2.ffn_norm.weight", "gemma3") == "model.layers.2.pre_feedforward_layernorm.weight"
    assert hf_name("blk.2.post_ffw_norm.weight", "gemma3") == "model.layers.2.post_feedforward_layernorm.weight"
    from_gguf, from_hf = load_model(str(gguf_path), "float32"), load_model(str(hf_dir), "float32")
    stored_eps = float(np.float32(from_hf.config.rms_norm_eps))  # GGUF keeps the epsilon in float32
    assert from_gguf.config == dataclasses.replace(from_hf.config, rms_norm_eps=stored_eps)
    assert from_gguf.config.sliding_layers == (True,) * 5 + (False, True)
    tokens = [1, 17, 200, 3, 99, 45, 45, 8, 120, 250, 11, 64]
    got = PagedForward(from_gguf.config, from_gguf.params).run(tokens, [0, 1, 2], [len(tokens)])
    np.testing.assert_allclose(got, hf_logits(hf_dir, tokens), atol=2e-5, rtol=0)


def test_gemma2_gguf_loads_as_the_hugging_face_model(tmp_path):
    """llama.cpp's Gemma 2: the soft-caps in the metadata, every other layer sliding."""
    hf_dir = make_tiny_model(tmp_path / "hf", "gemma2", query_pre_attn_scalar=16, num_hidden_layers=3,
                             layer_types=None)
    from_gguf = load_model(str(make_tiny_gguf(tmp_path / "gemma2.gguf", hf_dir)), "float32")
    cfg = from_gguf.config
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.sliding_layers) == (5.0, 3.0, (True, False, True))
    tokens = [1, 17, 200, 3, 99, 45, 45, 8, 120, 250, 11, 64]
    got = PagedForward(cfg, from_gguf.params).run(tokens, [0, 1, 2], [len(tokens)])
    np.testing.assert_allclose(got, hf_logits(hf_dir, tokens), atol=2e-5, rtol=0)


def test_qwen3_gguf_loads_as_the_hugging_face_model(tmp_path):
    """llama.cpp's Qwen3: q/k norms per head, head_dim from the metadata, q/k rows not permuted; YaRN scaling
    (Qwen3's long-context setting) from its rope.scaling keys."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 6}
    hf_dir = make_tiny_model(tmp_path / "hf", "qwen3", bos_token_id=1, eos_token_id=2, rope_scaling=yarn)
    from_gguf = load_model(str(make_tiny_gguf(tmp_path / "qwen3.gguf", hf_dir)), "float32")
    assert (from_gguf.config.family, from_gguf.config.head_dim, from_gguf.config.qk_norm) == ("qwen3", 24, True)
    assert from_gguf.config.rope == load_model(str(hf_dir), "float32").config.rope
    tokens = [1, 17, 200, 3, 99, 45, 45, 8, 120, 250, 11, 64]
    got = PagedForward(from_gguf.config, from_gguf.params).run(tokens, [0, 1, 2], [len(tokens)])
    np.testing.assert_allclose(got, hf_logits(hf_dir, tokens), atol=2e-5, rtol=0)


# family, its tiny config's overrides (shapes the GGUF must carry), what its config must read back
GGUF_FAMILIES = {
    # a dense first layer: no router in that layer's tensors; head_dim from the metadata
    "qwen3_moe": ({"num_hidden_layers": 3, "mlp_only_layers": [0]}, ("qwen3_moe", (False, True, True), 7, 3, True)),
    "qwen2_moe": ({}, ("qwen2_moe", (True, True), 5, 2, False)),  # the shared expert and its gate; q/k/v bias
    "mixtral": ({}, ("mixtral", (True, True), 5, 2, True)),  # a Llama GGUF with experts: q/k rows permuted
}


@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_moe_gguf_loads_as_the_hugging_face_model(tmp_path, family):
    """llama.cpp's mixture-of-experts layout: each layer's experts stacked per projection ([E, I, H]), the router
    as ffn_gate_inp, counts and sizes in the metadata."""
    overrides, (name, sparse_layers, experts, top_k, normalised) = GGUF_FAMILIES[family]
    hf_dir = make_tiny_model(tmp_path / "hf", family, **overrides)
    from_gguf = load_model(str(make_tiny_gguf(tmp_path / f"{family}.gguf", hf_dir)), "float32")
    cfg = from_gguf.config
    assert (cfg.family, cfg.sparse_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (
        name, sparse_layers, experts, top_k, normalised)
    assert_same_tree(from_gguf.params, load_model(str(hf_dir), "float32").params)
    tokens = [1, 17, 200, 3, 99, 45, 45, 8, 120, 250, 11, 64]
    got = PagedForward(cfg, from_gguf.params).run(tokens, [0, 1, 2], [len(tokens)])
    np.testing.assert_allclose(got, hf_logits(hf_dir, tokens), atol=2e-5, rtol=0)


def test_phi3_gguf_with_longrope_loads_as_the_hugging_face_model(tmp_path):
    """llama.cpp's Phi-3: fused attn_qkv and ffn_up (gate | up) split at load, the rotary dimension (partial
    rotary), the window, and LongRoPE's factors as two tensors with its pretraining length and attention factor."""
    hf_dir = make_tiny_model(tmp_path / "hf", "phi3", sliding_window=6, max_position_embeddings=32,
                             **longrope_overrides(4, 8))
    from_gguf = load_model(str(make_tiny_gguf(tmp_path / "phi3.gguf", hf_dir)), "float32")
    from_hf = load_model(str(hf_dir), "float32")
    stored = dataclasses.replace(from_gguf.config.rope, attention_factor=from_hf.config.rope.attention_factor)
    assert from_gguf.config.rope.attention_factor == pytest.approx(from_hf.config.rope.attention_factor)
    assert dataclasses.replace(from_gguf.config, rope=stored) == dataclasses.replace(
        from_hf.config, rms_norm_eps=float(np.float32(from_hf.config.rms_norm_eps)))
    assert (from_gguf.config.rotary_dim, from_gguf.config.sliding_window) == (8, 6)
    assert_same_tree(from_gguf.params, from_hf.params)
    tokens = [1, 17, 200, 3, 99, 45, 45, 8, 120, 250, 11, 64]  # 12 > the 8 pretrained positions: long factors
    config = from_gguf.config.for_max_model_len(32)
    got = PagedForward(config, from_gguf.params).run(tokens, [0, 1, 2], [len(tokens)])
    np.testing.assert_allclose(got, hf_logits(hf_dir, tokens), atol=2e-5, rtol=0)


# what transformers' GGUF reader takes from its config defaults, not from the file: the experts' sizes, the
# rotary dimension
TRANSFORMERS_READER_DEFAULTS = {
    "qwen3_moe": {"moe_intermediate_size": 768},
    "qwen2_moe": {"moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632},
    "phi3": {"partial_rotary_factor": 1.0},
}


@pytest.mark.parametrize("family", sorted(TRANSFORMERS_READER_DEFAULTS))
def test_tiny_gguf_writer_agrees_with_transformers_gguf_reader(tmp_path, family):
    """The tiny GGUFs of these tests follow llama.cpp's layout as transformers' own GGUF reader understands it:
    transformers loads them back to the logits of the model they were written from."""
    import torch
    import transformers

    hf_dir = make_tiny_model(tmp_path / "hf", family, **TRANSFORMERS_READER_DEFAULTS[family])
    gguf_path = make_tiny_gguf(tmp_path / f"{family}.gguf", hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_path.name,
                                                              dtype=torch.float32).eval()
    tokens = [1, 17, 200, 3, 99, 45, 45, 8, 120, 250, 11, 64]
    with torch.no_grad():
        got = model(torch.tensor([tokens])).logits[0].numpy()
    np.testing.assert_allclose(got, hf_logits(hf_dir, tokens), atol=2e-5, rtol=0)


def assert_same_tree(got: dict, expected: dict) -> None:
    got, expected = flatten_dict(got), flatten_dict(expected)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value, atol=1e-6, rtol=0, err_msg=str(key))


def test_llama3_gguf_with_rope_freqs_loads_as_the_hugging_face_model(tmp_path):
    """Llama 3.1 and later GGUFs carry their llama3 rope scaling as one factor per frequency (`rope_freqs`)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    hf_dir = make_tiny_model(tmp_path / "hf", "llama", rope_scaling=scaling, rope_theta=500000.0)
    from_gguf = load_model(str(make_tiny_gguf(tmp_path / "llama3.gguf", hf_dir)), "float32")
    factors = from_gguf.config.rope.frequency_factors
    assert len(factors) == 8 and factors[0] == 1.0 and factors[-1] == 8.0  # fast ones kept, slow ones scaled
    tokens = [1, 17, 200, 3, 99, 45, 45, 8, 120, 250, 11, 64]
    got = PagedForward(from_gguf.config, from_gguf.params).run(tokens, [0, 1, 2], [len(tokens)])
    np.testing.assert_allclose(got, hf_logits(hf_dir, tokens), atol=2e-5, rtol=0)


def test_unpermute_inverts_llama_cpp_permutation():
    num_heads, head_dim, hidden = 3, 8, 5
    w = np.arange(num_heads * head_dim * hidden, dtype=np.float32).reshape(num_heads * head_dim, hidden)
    # llama.cpp's convert script: reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2)
    permuted = w.reshape(num_heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_qk(permuted, num_heads), w)


def _write_gguf(path, tensor_type):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    raw = np.zeros((4, 40), dtype=np.uint8)  # one Q8_1 block (32 weights) per row
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path)).tensors[0]


def test_unsupported_gguf_tensor_type(tmp_path):
    import gguf

    tensor = _write_gguf(tmp_path / "q81.gguf", gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(ValueError, match="unsupported GGUF tensor type Q8_1 for tensor 'blk.0.attn_q.weight'"):
        dequantize_tensor(tensor)


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gptneox")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    message = ("unsupported GGUF architecture 'gptneox'; supported: llama, qwen2, qwen3, gemma2, gemma3, phi3, "
               "qwen2moe, qwen3moe, deepseek2$")
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path / "x.gguf"))


def test_embedded_model_missing_names_the_install_command(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=EMBEDDED_INSTALL):
        embedded_model_path()


def test_embedded_model_config():
    from jaxserve.weights import load_config

    cfg = load_config(embedded_model_path())
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.head_dim == 64


def test_gguf_tokenizer_is_converted_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    from jaxserve.weights import embedded_model_path, load_tokenizer, tokenizer_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = embedded_model_path()
    cached = tokenizer_cache_dir(path)
    assert cached.parent == tmp_path / "jaxserve" / "tokenizers" and not cached.exists()
    converted = load_tokenizer(path)
    assert (cached / "tokenizer_config.json").is_file()
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("AutoTokenizer loaded the cached tokenizer")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)  # its generic class is loaded directly
    reloaded = load_tokenizer(path)
    assert type(reloaded) is type(converted)
    text = "Hello, world! Ünïcödé and  spaces\n<|im_start|>user"
    assert reloaded(text).input_ids == converted(text).input_ids
    messages = [{"role": "user", "content": "Hi"}]
    assert reloaded.apply_chat_template(messages, tokenize=False) == converted.apply_chat_template(
        messages, tokenize=False
    )
    assert (reloaded.eos_token_id, reloaded.bos_token_id) == (converted.eos_token_id, converted.bos_token_id)
