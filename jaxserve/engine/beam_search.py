"""Beam search inside the engine: the beams of a request are sequences that share KV blocks.

vLLM's algorithm (`LLM.beam_search`), run on forks instead of re-submitted prompts. The prompt is
prefilled once; then every step each live beam decodes one token and returns its top 2 * beam_width
raw logprobs (plus, with temperature > 0, a sampled token, drawn with the request's seed and the beam's
rank). Candidates ending in EOS (unless ignore_eos), in one of `stop_token_ids` or completing one of the
`stop` strings (jaxserve's: vLLM's beams have no stop) join the completed list; the beam_width best others
become the next beams: a beam picked k times continues as itself and k - 1 forks (shared blocks,
copy-on-write of the last one), a beam not picked is freed. After max_tokens steps the live beams join the
completed ones, which are sorted by cum_logprob / len(tokens) ** length_penalty (prompt included, a final
EOS not) and the best beam_width returned.

All live beams must have their next logprobs before a step can expand them; if a beam missed a step
(it was preempted), the others roll back their last token and recompute it with it.
"""

from __future__ import annotations

import dataclasses
import math

from jaxserve.core.sequence import Sequence, SequenceStatus
from jaxserve.engine.logprobs import logprob_dict
from jaxserve.engine.request_group import EngineContext, RequestGroup
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.runner.sampler import FLAG_LOGPROBS, SamplingRow
from jaxserve.runner.step_runner import SampledToken
from jaxserve.sampling_params import BeamSearchParams


@dataclasses.dataclass(frozen=True)
class BeamStep:
    """One generated token of a beam and the candidates it was chosen from (a linked list to the root)."""

    previous: BeamStep | None
    token_id: int
    candidates: SampledToken  # the parent's result: top ids / logprobs, sampled token


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """A finished or live beam: its generated tokens are the chain of `last`."""

    last: BeamStep | None
    cum_logprob: float
    num_generated: int
    stop_reason: int | str | None = None  # the stop token or string that completed it


def generated_tokens(last: BeamStep | None) -> list[int]:
    """The tokens of the chain ending at ``last``, first to last."""
    tokens = []
    while last is not None:
        tokens.append(last.token_id)
        last = last.previous
    return tokens[::-1]


def beam_score(num_tokens: int, cum_logprob: float, ends_with_eos: bool, length_penalty: float) -> float:
    """vLLM's `get_beam_search_score`: the length counts the prompt and not a final EOS. A length_penalty so large
    that length ** length_penalty leaves float's range gives the score's limit (0, or cum_logprob's sign times
    infinity) instead of failing the step (vLLM's ZeroDivisionError or OverflowError)."""
    length = max(num_tokens - 1 if ends_with_eos else num_tokens, 1)
    try:
        denominator = length**length_penalty
    except OverflowError:
        return 0.0
    if denominator == 0.0:
        return math.copysign(math.inf, cum_logprob) if cum_logprob else 0.0
    return cum_logprob / denominator


class BeamSearchGroup(RequestGroup):
    needs_host_sync = True  # the next beams depend on this step's logprobs

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: BeamSearchParams,
                 seed: int, ctx: EngineContext, priority: int = 0):
        super().__init__(request_id, prompt, prompt_token_ids, ctx, priority)
        self.params = params
        self.num_candidates = 2 * params.beam_width
        self._seed = seed
        self.seqs.append(self._new_sequence(num_pending_forks=params.beam_width - 1))
        self.beams: dict[int, Hypothesis] = {self.seqs[0].seq_id: Hypothesis(None, 0.0, 0)}
        self.results: dict[int, SampledToken] = {}
        self.completed: list[Hypothesis] = []
        self.final: list[Hypothesis] | None = None
        self.aborted = False

    def sampling_row(self, seq: Sequence, start: int, num_tokens: int) -> SamplingRow:
        floats = (self.params.temperature, 1.0, 0.0, 0.0, 0.0, 1.0)
        rank = next(i for i, beam in enumerate(self.seqs) if beam is seq)  # seq ids differ from run to run
        return SamplingRow(floats, seed=self._seed + rank, step=seq.num_output_tokens,
                           prompt_len=self.num_prompt_tokens, flags=FLAG_LOGPROBS)

    def on_launch(self, seq: Sequence) -> int:
        return -1  # no placeholder: the beam's next token is chosen on the host (expansion)

    def on_sample(self, seq: Sequence, index: int, sample: SampledToken) -> bool:
        self.results[seq.seq_id] = sample
        return True

    def after_step(self) -> None:
        if not self.results:
            return
        if len(self.results) < len(self.seqs):
            self._roll_back()
            return
        self._expand()

    def _roll_back(self) -> None:
        """Some beam missed this step: the others recompute their last token next step, together with it."""
        for seq in self.seqs:
            if self.results.pop(seq.seq_id, None) is not None:
                seq.num_computed_tokens -= 1

    # ----- expansion ----------------------------------------------------------------------------
    def _candidates(self, seq: Sequence) -> list[tuple[float, Sequence, int]]:
        """(cum_logprob, beam, token) for the beam's top 2 * beam_width tokens and its sampled token."""
        result = self.results[seq.seq_id]
        cum = self.beams[seq.seq_id].cum_logprob
        tokens = {}
        if self.params.temperature > 0:
            tokens[result.token_id] = float(result.logprob)
        top = zip(result.top_ids[: self.num_candidates].tolist(), result.top_logprobs[: self.num_candidates].tolist(),
                  strict=True)
        tokens.update(top)
        return [(cum + logprob, seq, token) for token, logprob in tokens.items()]

    def _expand(self) -> None:
        num_tokens = self.num_prompt_tokens + self.beams[self.seq.seq_id].num_generated + 1
        live = []
        for seq in self.seqs:
            stops = self._stop_finder(seq)
            for cum, parent, token in self._candidates(seq):
                if token in self.ctx.eos_token_ids and not self.params.ignore_eos:
                    self.completed.append(self._extend(parent, token, cum))
                elif (stop_reason := stops(token)) is not None:
                    self.completed.append(self._extend(parent, token, cum, stop_reason))
                else:
                    live.append((cum, parent, token))
        eos = self.ctx.eos_token_ids
        score = lambda c: beam_score(num_tokens, c[0], c[2] in eos, self.params.length_penalty)  # ignore_eos
        chosen = sorted(live, key=score, reverse=True)[: self.params.beam_width]  # stable, as vLLM's
        done = num_tokens - self.num_prompt_tokens >= self.params.max_tokens or num_tokens >= self.ctx.max_model_len
        if done or not chosen:
            self._finish([self._extend(parent, token, cum) for cum, parent, token in chosen])
        else:
            self._continue_with(chosen)
        self.results.clear()

    def _stop_finder(self, seq: Sequence):
        """token -> the stop token id or stop string that the token would complete on ``seq``'s beam, or None."""
        stop_ids, stop = set(self.params.stop_token_ids), self.params.stop
        if not stop:
            return lambda token: token if token in stop_ids else None
        generated = generated_tokens(self.beams[seq.seq_id].last)
        before = len(self._decode(generated))

        def finds(token: int) -> int | str | None:
            if token in stop_ids:
                return token
            text = self._decode([*generated, token])
            return next((s for s in stop if text.find(s, max(before - len(s) + 1, 0)) >= 0), None)

        return finds

    def _decode(self, token_ids: list[int]) -> str:
        return self.ctx.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _extend(self, parent: Sequence, token: int, cum_logprob: float,
                stop_reason: int | str | None = None) -> Hypothesis:
        beam = self.beams[parent.seq_id]
        step = BeamStep(beam.last, token, self.results[parent.seq_id])
        return Hypothesis(step, cum_logprob, beam.num_generated + 1, stop_reason)

    def _continue_with(self, chosen: list[tuple[float, Sequence, int]]) -> None:
        """The chosen beams, in rank order: a parent's first pick continues the parent itself, its other
        picks fork it (forked before any token is appended); parents not picked end."""
        seqs_of: dict[int, list[Sequence]] = {}
        for _, parent, _ in chosen:
            if parent.seq_id in seqs_of:
                child = parent.fork()
                self._update.forks.append((parent, child))
                seqs_of[parent.seq_id].append(child)
            else:
                seqs_of[parent.seq_id] = [parent]
        next_seqs, next_beams = [], {}
        for cum, parent, token in chosen:
            seq = seqs_of[parent.seq_id].pop(0)
            next_beams[seq.seq_id] = self._extend(parent, token, cum)
            next_seqs.append(seq)
        for seq in next_seqs:
            seq.append_token(next_beams[seq.seq_id].last.token_id)
        for parent in self.seqs:
            parent.num_pending_forks = 0  # the root's forks were counted at admission
            if parent.seq_id not in seqs_of:
                parent.status = SequenceStatus.FINISHED_STOPPED
                self._update.finished.append(parent)
        self.seqs, self.beams = next_seqs, next_beams

    def _finish(self, live: list[Hypothesis]) -> None:
        ranked = sorted(self.completed + live, key=self._final_score, reverse=True)
        self.final = ranked[: self.params.beam_width]
        for seq in self.seqs:
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.num_pending_forks = 0
            self._update.finished.append(seq)

    def _final_score(self, hypothesis: Hypothesis) -> float:
        ends_with_eos = hypothesis.last is not None and hypothesis.last.token_id in self.ctx.eos_token_ids
        return beam_score(self.num_prompt_tokens + hypothesis.num_generated, hypothesis.cum_logprob,
                          ends_with_eos, self.params.length_penalty)

    # ----- lifecycle ----------------------------------------------------------------------------
    def on_ignored(self, seq: Sequence) -> None:
        self.seqs = [s for s in self.seqs if s is not seq]
        self.beams.pop(seq.seq_id, None)
        if not self.seqs:  # the prompt cannot run at all
            self.final = []

    def abort(self) -> None:
        """The live and completed beams so far are reported, best first, with finish_reason "abort"."""
        if self.final is None:
            live = [h for h in self.beams.values() if h.last is not None]
            self.final = sorted(self.completed + live, key=self._final_score, reverse=True)[: self.params.beam_width]
        self.aborted = True
        for seq in self.seqs:
            seq.num_pending_forks = 0
            if not seq.is_finished:
                seq.status = SequenceStatus.FINISHED_ABORTED

    @property
    def is_finished(self) -> bool:
        return self.final is not None

    def make_output(self) -> RequestOutput | None:
        """Only the final output: beam_width completions, best first."""
        if not self.is_finished:
            return None
        completions = [self._completion(i, h) for i, h in enumerate(self.final or [])]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, True,
                             num_cached_tokens=self.num_cached_tokens)

    def _completion(self, index: int, hypothesis: Hypothesis) -> CompletionOutput:
        steps = []
        step = hypothesis.last
        while step is not None:
            steps.append(step)
            step = step.previous
        steps.reverse()
        token_ids = [s.token_id for s in steps]
        logprobs = [self._candidate_logprobs(s) for s in steps]
        ends_with_eos = bool(token_ids) and token_ids[-1] in self.ctx.eos_token_ids
        stopped = ends_with_eos or hypothesis.stop_reason is not None
        finish_reason = "abort" if self.aborted else "stop" if stopped else "length"
        return CompletionOutput(
            index=index, text=self._text(token_ids, ends_with_eos, hypothesis.stop_reason), token_ids=token_ids,
            cumulative_logprob=hypothesis.cum_logprob, logprobs=logprobs, finish_reason=finish_reason,
            stop_reason=hypothesis.stop_reason,
        )

    def _text(self, token_ids: list[int], ends_with_eos: bool, stop_reason: int | str | None) -> str:
        """The beam's text: a final EOS or stop token left out and a stop string cut off, unless
        include_stop_str_in_output (as in sampling)."""
        include = self.params.include_stop_str_in_output
        if isinstance(stop_reason, str):
            text = self._decode(token_ids)
            return text[: text.find(stop_reason) + (len(stop_reason) if include else 0)]
        stops_with_token = ends_with_eos or stop_reason is not None
        return self._decode(token_ids[:-1] if stops_with_token and not include else token_ids)

    def _candidate_logprobs(self, step: BeamStep) -> dict:
        c = step.candidates
        k = max(self.num_candidates, self.params.logprobs or 0)
        return logprob_dict(c.token_id, c.logprob, c.rank, c.top_ids, c.top_logprobs, k, self.ctx.texts)
