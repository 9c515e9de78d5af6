"""POST /tokenize and /detokenize (vLLM's): a prompt or a chat conversation to token ids, and back."""

from __future__ import annotations

from jaxserve.entrypoints.openai_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from jaxserve.entrypoints.serving_engine import OpenAIServing, ServingError


class OpenAIServingTokenization(OpenAIServing):
    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_request(request)
        if request.messages is not None:  # special tokens default off: the chat template has its own BOS
            token_ids = self.chat_prompt(request).token_ids
        else:
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
            token_ids = self.encode(request.prompt, add_special)
        return TokenizeResponse(count=len(token_ids), max_model_len=self.max_model_len, tokens=token_ids)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_request(request)
        bad = [t for t in request.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ServingError(f"Token id {bad[0]} is out of vocabulary (size {self.vocab_size}).", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))

