"""Model families by architecture name. Every supported architecture maps to a Flax module class."""

from jaxserve.config import SUPPORTED_ARCHITECTURES
from jaxserve.models.llama import LlamaForCausalLM

MODEL_REGISTRY = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}


def get_model_class(architecture: str):
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}"
        ) from None
