"""LLM: the offline Python API (vLLM's names and defaults) on top of LLMEngine.

`LLM(...)` loads the model and warms up every bucket (through the persistent compile cache, on by default:
see EngineConfig's `compile_cache_dir`); `generate` adds all prompts, steps the engine until they finish
(a tqdm bar counts finished requests) and returns RequestOutputs in input order. `chat` renders
conversations through the chat template and generates; `beam_search` runs beam search requests (beams
share KV blocks inside the engine) and returns BeamSearchOutputs.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.chat_template import is_batch_of_conversations, render_chat
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from jaxserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

PromptType = str | dict


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        block_size: int | None = None,
        num_kv_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        buckets: str | None = None,
        seed: int = 0,
        attention_backend: str = "auto",
        tensor_parallel_size: int = 1,
        compile_cache_dir: str | None = None,
        strict_no_compile: bool = False,
        enable_prefix_caching: bool = True,
        disable_log_stats: bool = True,  # offline: no periodic stats line (vLLM's LLM default)
        **engine_kwargs,
    ):
        config = EngineConfig(
            model=model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            num_kv_blocks=num_kv_blocks, gpu_memory_utilization=gpu_memory_utilization,
            buckets=buckets, seed=seed, attention_backend=attention_backend,
            tensor_parallel_size=tensor_parallel_size, compile_cache_dir=compile_cache_dir,
            strict_no_compile=strict_no_compile, enable_prefix_caching=enable_prefix_caching,
            disable_log_stats=disable_log_stats, **engine_kwargs,
        )
        if config.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 serves replicas behind one server (`jaxserve serve "
                             "--data-parallel-size N`); an offline LLM runs one engine")
        self.llm_engine = LLMEngine(config)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """``priority``: one per prompt, for an engine with scheduling_policy="priority" (lower first; vLLM's)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = self._params_per_prompt(prompts, sampling_params)
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"The lengths of prompts ({len(prompts)}) and priority ({len(priority)}) must be the "
                             "same.")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        request_ids = []
        for prompt, params, request_priority in zip(prompts, params_list, priorities, strict=True):
            request_id = str(next(self._counter))
            self.llm_engine.add_request(request_id, prompt, _final_only(params), request_priority)
            request_ids.append(request_id)
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: Seq[dict] | Seq[Seq[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generates a reply to one conversation (a list of {"role", "content"} dicts) or to each of a list
        of conversations, rendered with the tokenizer's chat template or `chat_template`."""
        conversations = messages if is_batch_of_conversations(messages) else [messages]
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            text = render_chat(
                tokenizer, conversation, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            )
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt; every output's `sequences` are its beam_width best, best first."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"beam_search takes BeamSearchParams, got {type(params).__name__}")
        request_ids = []
        for prompt in prompts:
            request_id = str(next(self._counter))
            self.llm_engine.add_request(request_id, prompt, params)
            request_ids.append(request_id)
        tokenizer = self.get_tokenizer()
        return [_beam_output(out, tokenizer) for out in self._run_engine(request_ids, use_tqdm)]

    @staticmethod
    def _params_per_prompt(prompts, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * len(prompts)
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling params for {len(prompts)} prompts; the lengths must match"
            )
        return list(sampling_params)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]


def _final_only(params: SamplingParams) -> SamplingParams:
    """Offline generation only needs each request's final output."""
    return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


def _beam_output(output: RequestOutput, tokenizer) -> BeamSearchOutput:
    """vLLM's shape: each sequence's tokens are prompt + generated, its text decodes all of them."""
    sequences = []
    for completion in output.outputs:
        tokens = output.prompt_token_ids + completion.token_ids
        sequences.append(BeamSearchSequence(
            tokens=tokens, logprobs=completion.logprobs, cum_logprob=completion.cumulative_logprob,
            text=tokenizer.decode(tokens), finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
        ))
    return BeamSearchOutput(sequences)
