"""Model families by architecture name. Every supported architecture maps to a Flax module class whose
constructor is `(config, dtype, attention_backend, mesh, *, scan_layers=True, untie_lm_head=False)` (the
layouts of `common.layer_stack` and `common.untie_lm_head`)."""

from jaxserve.config.qwen3_next_config import QWEN3_NEXT_ARCHITECTURES
from jaxserve.models.deepseek import DeepseekForCausalLM
from jaxserve.models.gemma import GemmaForCausalLM
from jaxserve.models.gemma4 import Gemma4ForCausalLM
from jaxserve.models.gpt2 import GPT2LMHeadModel
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.opt import OPTForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,  # qkv_proj and gate_up_proj are split by the weight loader
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "GptOssForCausalLM": LlamaForCausalLM,  # attention sinks and biases, biased experts: ModelConfig switches
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForCausalLM,  # the text decoder only
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    # full-attention layers only (gated attention, (1 + weight) norms): ModelConfig switches; the
    # ForConditionalGeneration checkpoints' text decoder only
    **{arch: LlamaForCausalLM for arch in QWEN3_NEXT_ARCHITECTURES},
}


def get_model_class(architecture: str):
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}"
        ) from None
