"""Request groups: the host state of one request, whose sequences share the prompt's KV blocks.

The engine keeps one group per request. When it dispatches a step, every row that will sample is
announced to its group (`on_launch`: a sampling sequence gets a placeholder token, so the next step can
be planned before this one's tokens are read); when it reads the step back, each sampled token goes to
its group (`on_sample`). After both it applies what the group asks for (`take_update`: sequences to fork
from a parent, sequences to free) and reports `make_output()`. Two kinds exist:

* `SamplingGroup` (this file): n / best_of samples. The prompt is prefilled once, by the first
  sequence; when it samples its first token, best_of - 1 children are forked from it. A child shares
  every prompt block (reference counts) and re-decodes the last prompt token itself (copy-on-write of
  the block holding it), so each sample draws its first token from its own key: child i uses seed + i,
  as vLLM's parallel sampling does. Stop conditions follow vLLM: EOS (unless ignore_eos) and
  stop_token_ids end a sequence once min_tokens exist, stop strings once more than min_tokens exist,
  then max_tokens / max_model_len (known at dispatch: such a sequence is freed at once). A sequence
  that stops on a token read back late drops the placeholders dispatched after it. With best_of > n
  the n highest cumulative logprobs are returned, once every sequence finished.
* `BeamSearchGroup` (`beam_search.py`).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import time

import numpy as np

from jaxserve.config.structured_outputs_config import StructuredOutputsConfig
from jaxserve.core.sequence import PLACEHOLDER_TOKEN, Sequence, SequenceStatus
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.logprobs import TokenTexts, logprob_dict
from jaxserve.engine.structured_outputs import (
    BadWordsFilter,
    BothConstraints,
    GrammarCompiler,
    GrammarMatcher,
    bad_words_token_ids,
)
from jaxserve.logger import init_logger
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.runner.sampler import FLAG_GRAMMAR, FLAG_LOGIT_BIAS, FLAG_LOGPROBS, FLAG_PROMPT_LOGPROBS, SamplingRow
from jaxserve.runner.step_runner import SampledToken
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger("jaxserve.engine.request_group")


def device_repetition_penalty(penalty: float) -> float:
    """A valid repetition_penalty (finite, positive) within float32's normal range, as the device holds it: beyond
    it a Python float would become inf (0 x inf is NaN for a zero logit) or 0 (a division by zero) on the device."""
    limits = np.finfo(np.float32)
    return min(max(penalty, float(limits.tiny)), float(limits.max))


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


@dataclasses.dataclass
class GroupUpdate:
    """What the engine must do after a step: fork children (before anything is freed), free sequences."""

    forks: list[tuple[Sequence, Sequence]] = dataclasses.field(default_factory=list)
    finished: list[Sequence] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class EngineContext:
    """What groups need from the engine."""

    tokenizer: object
    texts: TokenTexts
    eos_token_ids: frozenset[int]
    max_model_len: int
    vocab_size: int
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Matchers for structured outputs, over the tokenizer (built on the first constrained request)."""
        return GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids,
                               config=self.structured_outputs_config)


class RequestGroup(abc.ABC):
    needs_host_sync = False  # True: each step's results must be read before the next step is planned

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], ctx: EngineContext,
                 priority: int = 0):
        self.request_id = request_id
        self.priority = priority  # the scheduler's priority policy: lower first (every sequence of the request)
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.ctx = ctx
        self.seqs: list[Sequence] = []
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self._update = GroupUpdate()
        self._root: Sequence | None = None  # the sequence that prefills the prompt

    @property
    def num_cached_tokens(self) -> int | None:
        """Prompt tokens served by the prefix cache at the request's first admission (None before it)."""
        return self._root.num_cached_tokens if self._root is not None else None

    @property
    def seq(self) -> Sequence:
        """The first sequence (the one that prefills the prompt)."""
        return self.seqs[0]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def take_update(self) -> GroupUpdate:
        update, self._update = self._update, GroupUpdate()
        return update

    def _new_sequence(self, num_pending_forks: int = 0) -> Sequence:
        seq = Sequence(self.request_id, self.prompt_token_ids, arrival_time=self.arrival_time)
        seq.priority = self.priority
        seq.num_pending_forks = num_pending_forks
        self._root = self._root or seq
        return seq

    # ----- per-row inputs -----------------------------------------------------------------------
    @abc.abstractmethod
    def sampling_row(self, seq: Sequence, start: int, num_tokens: int) -> SamplingRow: ...

    def needs_slot(self) -> bool:
        """Whether its sequences need a sampler slot (penalties, logit_bias, min_tokens)."""
        return False

    def mask_waits(self, seq: Sequence) -> bool:
        """Whether ``seq``'s row waits for its allowed-token mask: its step is sampled once the mask is known."""
        return False

    def grammar_mask(self, seq: Sequence, index: int) -> np.ndarray | None:
        """The allowed-token bitmask of ``seq``'s output token ``index``, when a grammar constrains it."""
        return None

    def slot_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Dense (logit_bias f32[V], min_tokens mask bool[V]) rows for a new slot of this request."""
        raise NotImplementedError

    def wants_prompt_logprobs(self, start: int, num_tokens: int) -> bool:
        return False

    def add_prompt_logprobs(self, start: int, num_tokens: int, row) -> None:
        raise NotImplementedError

    # ----- results ------------------------------------------------------------------------------
    @abc.abstractmethod
    def on_launch(self, seq: Sequence) -> int:
        """A dispatched row of `seq` samples; returns the output index its token will take (-1: none)."""

    @abc.abstractmethod
    def on_sample(self, seq: Sequence, index: int, sample: SampledToken) -> bool:
        """The token of a row announced by `on_launch`; False if it was dropped."""

    def on_sample_tokens(self, seq: Sequence, index: int, samples: list[SampledToken]) -> int:
        """Several tokens of one row (a verifying step's accepted drafts and its last token), from output index
        ``index`` on: each after the one before, until one is dropped or stops the sequence. Returns how many
        were taken."""
        taken = 0
        for i, sample in enumerate(samples):
            if i:
                if seq.is_finished:
                    break
                seq.append_token(PLACEHOLDER_TOKEN)
            if not self.on_sample(seq, index + i, sample):
                break
            taken += 1
        return taken

    def max_drafts(self, seq: Sequence) -> int:
        """The most draft tokens ``seq`` may verify in its next step (speculative decoding): none by default."""
        return 0

    def after_step(self) -> None:  # noqa: B027 - optional hook, a no-op for sampling groups
        """Called once per step for every group that received a token, after all its rows."""

    @abc.abstractmethod
    def on_ignored(self, seq: Sequence) -> None:
        """The scheduler finished `seq` with "length" (it could never run)."""

    @abc.abstractmethod
    def abort(self) -> None: ...

    @property
    @abc.abstractmethod
    def is_finished(self) -> bool: ...

    @abc.abstractmethod
    def make_output(self) -> RequestOutput | None: ...


@dataclasses.dataclass
class SampleState:
    """Host state of one sequence of a SamplingGroup."""

    index: int
    seed: int
    detokenizer: IncrementalDetokenizer
    logprobs: list | None
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    num_accepted_tokens: int = 0  # output tokens read back from the device (the rest are placeholders)
    num_reported_tokens: int = 0
    num_reported_chars: int = 0
    # structured outputs (where the sequence is in its grammar) and multi-token bad words: its next tokens' mask
    grammar: GrammarMatcher | BadWordsFilter | BothConstraints | None = None


class SamplingGroup(RequestGroup):
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 seed: int, ctx: EngineContext, priority: int = 0):
        super().__init__(request_id, prompt, prompt_token_ids, ctx, priority)
        self.params = params
        self.base_seed = seed
        self._bad_words = bad_words_token_ids(ctx.tokenizer, params.bad_words) if params.bad_words else []
        self.states: dict[int, SampleState] = {}
        first = self._new_sequence(num_pending_forks=params.best_of - 1)
        first.use_prefix_cache = params.prompt_logprobs is None  # prompt logprobs need every prompt position
        self._add_sequence(first, 0)
        self.prompt_logprobs: list | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * self.num_prompt_tokens
        self._num_prompt_logprobs = 1  # position 0 has none
        self._prompt_logprobs_reported = False
        self._floats = (
            0.0 if params.is_greedy else params.temperature, params.top_p, params.min_p,
            params.presence_penalty, params.frequency_penalty, device_repetition_penalty(params.repetition_penalty),
        )
        self._static_flags = (FLAG_LOGIT_BIAS if self._uses_bias_row else 0) | (
            FLAG_LOGPROBS if self._tracks_logprobs else 0)

    @property
    def _uses_bias_row(self) -> bool:
        """logit_bias, allowed_token_ids and one-token bad words are the slot's bias row."""
        p = self.params
        return bool(p.logit_bias) or p.allowed_token_ids is not None or any(len(w) == 1 for w in self._bad_words)

    @property
    def _tracks_logprobs(self) -> bool:
        return self.params.logprobs is not None or self.params.best_of > self.params.n

    def _add_sequence(self, seq: Sequence, index: int) -> None:
        detok = IncrementalDetokenizer(self.ctx.tokenizer, self.prompt_token_ids, self.params)
        logprobs = [] if self.params.logprobs is not None else None
        seed = (self.base_seed + index) & 0xFFFFFFFF
        grammar = None
        if self.params.structured_outputs is not None:
            grammar = self.ctx.grammars.matcher(self.params.structured_outputs)
        if any(len(w) > 1 for w in self._bad_words):
            bad_words = BadWordsFilter(self._bad_words, self.ctx.vocab_size)
            grammar = bad_words if grammar is None else BothConstraints(grammar, bad_words)
        self.states[seq.seq_id] = SampleState(index, seed, detok, logprobs, grammar=grammar)
        self.seqs.append(seq)

    # ----- per-row inputs -----------------------------------------------------------------------
    def sampling_row(self, seq: Sequence, start: int, num_tokens: int) -> SamplingRow:
        end = start + num_tokens
        state = self.states[seq.seq_id]
        flags = self._static_flags
        if self.wants_prompt_logprobs(start, num_tokens):
            flags |= FLAG_PROMPT_LOGPROBS
        allowed = None
        if end == seq.num_tokens and state.grammar is not None and not self.mask_waits(seq):
            allowed = state.grammar.allowed_tokens()  # the row samples: its grammar's next tokens (None: any)
        if allowed is not None:
            flags |= FLAG_GRAMMAR
        return SamplingRow(
            self._floats, top_k=max(self.params.top_k, 0), seed=state.seed,
            step=seq.num_output_tokens, min_tokens=self.params.min_tokens,
            prompt_len=self.num_prompt_tokens, flags=flags,
            prompt_next_token=seq.all_token_ids[end] if end < seq.num_tokens else 0, allowed=allowed,
        )

    def mask_waits(self, seq: Sequence) -> bool:
        """A constrained sequence whose last token is still on the device: its grammar has not seen that token,
        so its next mask is not known yet (the engine samples its step once it is: LLMEngine._resample)."""
        return self.states[seq.seq_id].grammar is not None and seq.last_token_id == PLACEHOLDER_TOKEN

    def grammar_mask(self, seq: Sequence, index: int) -> np.ndarray | None:
        """The packed allowed-token bitmask of ``seq``'s output token ``index``, once its grammar has seen every
        token before it; None without a grammar, while the grammar waits for its marker (any token), or when that
        token will be dropped (the sequence stopped)."""
        state = self.states[seq.seq_id]
        if state.grammar is None or index >= seq.num_output_tokens or state.num_accepted_tokens != index:
            return None
        return state.grammar.allowed_tokens()

    def max_drafts(self, seq: Sequence) -> int:
        """Drafts that keep the step's tokens (the drafts and one more) within max_tokens and max_model_len; none for
        a grammar-constrained sequence (its masks are known one token at a time)."""
        if self.states[seq.seq_id].grammar is not None:
            return 0
        max_tokens = self.params.max_tokens or self.ctx.max_model_len
        return min(max_tokens - seq.num_output_tokens, self.ctx.max_model_len - seq.num_tokens) - 1

    def needs_slot(self) -> bool:
        p = self.params
        return p.has_penalties or self._uses_bias_row or p.min_tokens > 0

    def slot_rows(self) -> tuple[np.ndarray, np.ndarray]:
        p = self.params
        bias = np.zeros(self.ctx.vocab_size, np.float32)
        if p.logit_bias:
            bias[list(p.logit_bias)] = list(p.logit_bias.values())
        if p.allowed_token_ids is not None:  # vLLM: every other token's logit is -inf
            allowed = np.zeros(self.ctx.vocab_size, bool)
            allowed[p.allowed_token_ids] = True
            bias[~allowed] = -np.inf
        bias[[w[0] for w in self._bad_words if len(w) == 1]] = -np.inf
        mask = np.zeros(self.ctx.vocab_size, bool)
        if p.min_tokens > 0:
            stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.ctx.eos_token_ids))
            mask[[t for t in stop_ids if 0 <= t < self.ctx.vocab_size]] = True
        return bias, mask

    def wants_prompt_logprobs(self, start: int, num_tokens: int) -> bool:
        """A prefill chunk whose positions predict prompt tokens still missing their logprobs."""
        if self.prompt_logprobs is None or self._num_prompt_logprobs == self.num_prompt_tokens:
            return False
        first, last = start + 1, min(start + num_tokens, self.num_prompt_tokens - 1)
        return any(self.prompt_logprobs[p] is None for p in range(first, last + 1))

    def add_prompt_logprobs(self, start: int, num_tokens: int, row) -> None:
        """row: (token logprob f32[Q], rank i32[Q], top ids i32[Q, K], top logprobs f32[Q, K])."""
        token_logprob, rank, top_ids, top_logprobs = row
        k = self.params.prompt_logprobs
        for j in range(num_tokens):
            position = start + j + 1
            if position >= self.num_prompt_tokens or self.prompt_logprobs[position] is not None:
                continue
            self.prompt_logprobs[position] = logprob_dict(
                self.prompt_token_ids[position], token_logprob[j], rank[j], top_ids[j], top_logprobs[j], k,
                self.ctx.texts,
            )
            self._num_prompt_logprobs += 1

    # ----- results ------------------------------------------------------------------------------
    def on_launch(self, seq: Sequence) -> int:
        if seq.num_pending_forks:
            self._fork_children(seq)
        seq.append_token(PLACEHOLDER_TOKEN)
        num_out = seq.num_output_tokens
        if num_out >= (self.params.max_tokens or self.ctx.max_model_len) or seq.num_tokens >= self.ctx.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH  # its last token: free it now, read the token later
            self._update.finished.append(seq)
        return num_out - 1

    def on_sample(self, seq: Sequence, index: int, sample: SampledToken) -> bool:
        state = self.states[seq.seq_id]
        if index >= seq.num_output_tokens or state.num_accepted_tokens != index:
            return False  # dispatched after the sequence stopped (or was aborted)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        seq.output_token_ids[index] = sample.token_id
        state.num_accepted_tokens = index + 1
        if self._tracks_logprobs:
            state.cumulative_logprob += float(sample.logprob)
        if state.logprobs is not None:
            state.logprobs.append(logprob_dict(
                sample.token_id, sample.logprob, sample.rank, sample.top_ids, sample.top_logprobs,
                self.params.logprobs, self.ctx.texts,
            ))
        was_finished = seq.is_finished
        if state.grammar is not None and not state.grammar.consume(sample.token_id):
            # only if every token was masked (nothing the grammar allows survived the other filters): end it
            logger.warning("request %s: its grammar rejected token %d (%s); the sequence ends here",
                           self.request_id, sample.token_id, state.grammar.error)
        self._check_stop(seq, state, sample.token_id)
        if seq.is_finished and not was_finished:
            del seq.output_token_ids[index + 1 :]  # placeholders dispatched after the stop
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
            self._update.finished.append(seq)
        return True

    def _fork_children(self, parent: Sequence) -> None:
        """best_of - 1 children that share the prompt and re-decode its last token with their own key."""
        for index in range(1, parent.num_pending_forks + 1):
            child = self._new_sequence()
            child.num_computed_tokens = self.num_prompt_tokens - 1
            child.status = SequenceStatus.RUNNING
            self._add_sequence(child, index)
            self._update.forks.append((parent, child))
        parent.num_pending_forks = 0

    def _check_stop(self, seq: Sequence, state: SampleState, token_id: int) -> None:
        """After accepting a token; a sequence already at its length limit keeps "length" unless it stops."""
        p = self.params
        num_out = state.num_accepted_tokens
        can_stop = num_out >= p.min_tokens
        if can_stop and not p.ignore_eos and token_id in self.ctx.eos_token_ids:
            self._finish(seq, state, token_id, SequenceStatus.FINISHED_STOPPED, None)
        elif can_stop and token_id in p.stop_token_ids:
            self._finish(seq, state, token_id, SequenceStatus.FINISHED_STOPPED, token_id)
        else:
            stop_string = state.detokenizer.append(token_id, check_stop=num_out > p.min_tokens)
            if stop_string is not None:
                seq.status, state.stop_reason = SequenceStatus.FINISHED_STOPPED, stop_string
            elif state.grammar is not None and state.grammar.is_finished:
                seq.status = SequenceStatus.FINISHED_STOPPED  # the grammar is complete: nothing may follow
            elif num_out >= (p.max_tokens or self.ctx.max_model_len) or seq.num_tokens >= self.ctx.max_model_len:
                seq.status = SequenceStatus.FINISHED_LENGTH

    def _finish(self, seq: Sequence, state: SampleState, token_id: int, status, stop_reason) -> None:
        """A stop token ends the text without itself, unless include_stop_str_in_output (vLLM)."""
        if self.params.include_stop_str_in_output:
            state.detokenizer.append(token_id, check_stop=False)
        seq.status, state.stop_reason = status, stop_reason

    def on_ignored(self, seq: Sequence) -> None:
        seq.num_pending_forks = 0  # a prompt that cannot run ends every sample of the request

    def abort(self) -> None:
        """Unfinished sequences end with "abort" and keep only the tokens read back so far."""
        for seq in self.seqs:
            seq.num_pending_forks = 0
            if not self._is_done(seq):
                del seq.output_token_ids[self.states[seq.seq_id].num_accepted_tokens :]
                seq.status = SequenceStatus.FINISHED_ABORTED

    def _is_done(self, seq: Sequence) -> bool:
        """Finished, with every token read back."""
        return seq.is_finished and self.states[seq.seq_id].num_accepted_tokens == seq.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return all(self._is_done(s) and not s.num_pending_forks for s in self.seqs)

    # ----- outputs ------------------------------------------------------------------------------
    def make_output(self) -> RequestOutput | None:
        finished = self.is_finished
        kind = self.params.output_kind
        selecting = self.params.best_of > self.params.n
        if not finished and (kind == RequestOutputKind.FINAL_ONLY or selecting):
            return None
        seqs = sorted(self.seqs, key=lambda s: self.states[s.seq_id].index)
        if selecting:
            seqs = sorted(seqs, key=lambda s: self.states[s.seq_id].cumulative_logprob, reverse=True)[: self.params.n]
        delta = kind == RequestOutputKind.DELTA
        completions = [self._completion(seq, i if selecting else None, delta) for i, seq in enumerate(seqs)]
        if delta and not finished:
            completions = [c for c in completions if c.token_ids or c.finish_reason is not None]
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, completions, finished,
            prompt_logprobs=self._report_prompt_logprobs(delta), num_cached_tokens=self.num_cached_tokens,
        )

    def _completion(self, seq: Sequence, index: int | None, delta: bool) -> CompletionOutput:
        state = self.states[seq.seq_id]
        done = self._is_done(seq)
        visible = state.detokenizer.visible_text(done)
        text, token_ids, logprobs = visible, seq.output_token_ids[: state.num_accepted_tokens], state.logprobs
        if delta:
            text = visible[state.num_reported_chars :]
            token_ids = token_ids[state.num_reported_tokens :]
            logprobs = None if logprobs is None else logprobs[state.num_reported_tokens :]
        state.num_reported_chars, state.num_reported_tokens = len(visible), state.num_accepted_tokens
        return CompletionOutput(
            index=state.index if index is None else index, text=text, token_ids=list(token_ids),
            cumulative_logprob=state.cumulative_logprob if self.params.logprobs is not None else None,
            logprobs=None if logprobs is None else list(logprobs),
            finish_reason=FINISH_REASONS.get(seq.status) if done else None,
            stop_reason=state.stop_reason if done else None,
        )

    def _report_prompt_logprobs(self, delta: bool) -> list | None:
        if self.prompt_logprobs is None or (delta and self._prompt_logprobs_reported):
            return None
        self._prompt_logprobs_reported = True
        return list(self.prompt_logprobs)
