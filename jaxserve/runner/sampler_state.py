"""Per-sequence sampler state kept on the device between steps, and the host table of its slots.

Penalties need each sequence's token counts, logit_bias and min_tokens need a vocabulary-wide row per
request. Rebuilding those [batch, vocab] arrays on the host every step would copy megabytes per step,
so they live on the device in `SlotState`, one row ("slot") per running sequence that needs them:

* `output_counts` are maintained INSIDE the compiled step from the step's own input tokens
  (`update_token_counts`): a token at a position past the prompt is a generated one. Feeding a sampled
  token back as the next input is what counts it, so a recompute after preemption (which re-feeds prompt
  and outputs from position 0 into a fresh slot) rebuilds the counts exactly.
* A sequence that gets a slot (new, or recomputed) has it written once (`write_slot`, a small executable):
  its request's `logit_bias` / `min_tokens_mask` rows, its whole prompt's `prompt_mask` (the prompt is
  known then; no step before the prompt's last samples from the slot), and the counts of the generated
  tokens before its first step (none, unless a prefix cache hit skips some). Not scattering the prompt
  mask in the step matters on TPU: a scatter into a bool [N, V] array is lowered through two relayouting
  reshapes of the whole array, which took 20-40 s of every step's compile for a 128k vocabulary.
* A forked sequence (n > 1) copies its parent's slot (`copy_slots`, with the KV copy-on-write copies).

`SlotTable` (host, numpy-free) hands slots out and takes them back; a sequence without penalties,
logit_bias or min_tokens gets no slot and its rows point at `num_slots` (out of range: ignored).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxserve.attention.metadata import TokenLayout


@struct.dataclass
class SlotState:
    output_counts: jax.Array  # i32[N, V]: times each token was generated (frequency/presence/repetition)
    prompt_mask: jax.Array  # bool[N, V]: tokens of the prompt (repetition penalty), written with the slot
    logit_bias: jax.Array  # f32[N, V]: the request's logit_bias, dense
    min_tokens_mask: jax.Array  # bool[N, V]: EOS and stop_token_ids, suppressed until min_tokens

    @classmethod
    def zeros(cls, num_slots: int, vocab_size: int) -> SlotState:
        shape = (num_slots, vocab_size)
        return cls(jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool), jnp.zeros(shape, jnp.float32),
                   jnp.zeros(shape, bool))

    @classmethod
    def abstract(cls, num_slots: int, vocab_size: int) -> SlotState:
        shape = (num_slots, vocab_size)
        sds = lambda dtype: jax.ShapeDtypeStruct(shape, dtype)
        return cls(sds(jnp.int32), sds(jnp.bool_), sds(jnp.float32), sds(jnp.bool_))

    @property
    def num_slots(self) -> int:
        return self.output_counts.shape[0]

    def rows(self, slots: jax.Array) -> SlotState:
        """The rows of `slots` i32[S] (out-of-range slots read the last row; callers ignore them)."""
        clamped = jnp.clip(slots, 0, self.num_slots - 1)
        return jax.tree.map(lambda x: x[clamped], self)


def slot_state_bytes(num_slots: int, vocab_size: int) -> int:
    """Device bytes of a SlotState: i32 counts + f32 bias + two bool masks per slot and token."""
    return num_slots * vocab_size * (4 + 4 + 1 + 1)


def update_token_counts(
    state: SlotState,
    input_ids: jax.Array,  # i32[S, Q] (or [1, T], ragged)
    layout: TokenLayout,  # each input slot's row, position and validity (`attention.token_layout`)
    prompt_len: jax.Array,  # i32[S]
    slots: jax.Array,  # i32[S], num_slots = none
) -> SlotState:
    """Counts the step's generated input tokens (positions past the prompt) into their rows' slots: one
    scatter-add of an element per input token, no copy of the state (tokens of the prompt and rows without a
    slot scatter out of range and are dropped). `write_slot` sets a slot's prompt mask and first counts."""
    n = state.num_slots
    token_slots = slots[layout.rows]
    generated = (token_slots < n) & layout.valid & (layout.positions >= prompt_len[layout.rows])
    counts = state.output_counts.at[jnp.where(generated, token_slots, n), input_ids].add(1, mode="drop")
    return state.replace(output_counts=counts)


def write_slot(
    state: SlotState,
    slot: jax.Array,  # i32[]
    logit_bias: jax.Array,  # f32[V]
    min_tokens_mask: jax.Array,  # bool[V]
    output_counts: jax.Array,  # i32[V]
    prompt_mask: jax.Array,  # bool[V]
) -> SlotState:
    """A sequence takes `slot`: its request's bias and min_tokens rows, its whole prompt's mask, and the counts
    of the generated tokens before its first step (zero, unless a prefix cache hit skips some; host-counted)."""
    return SlotState(
        output_counts=state.output_counts.at[slot].set(output_counts),
        prompt_mask=state.prompt_mask.at[slot].set(prompt_mask),
        logit_bias=state.logit_bias.at[slot].set(logit_bias),
        min_tokens_mask=state.min_tokens_mask.at[slot].set(min_tokens_mask),
    )


def copy_slots(state: SlotState, src: jax.Array, dst: jax.Array) -> SlotState:
    """Row dst[i] := row src[i] for every i (src/dst i32[M]; dst = num_slots entries are no-ops)."""
    rows = state.rows(src)
    return jax.tree.map(lambda x, r: x.at[dst].set(r, mode="drop"), state, rows)


class SlotTable:
    """Which sequence holds which slot (host side)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._slots: dict[int, int] = {}

    @property
    def no_slot(self) -> int:
        return self.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def get(self, seq_id: int) -> int | None:
        return self._slots.get(seq_id)

    def assign(self, seq_id: int) -> int:
        if seq_id in self._slots:
            raise RuntimeError(f"seq {seq_id} already holds sampler slot {self._slots[seq_id]}")
        if not self._free:
            raise RuntimeError(f"no free sampler slot: all {self.num_slots} are held (more running "
                               "sequences than max_num_seqs?)")
        slot = self._free.pop()
        self._slots[seq_id] = slot
        return slot

    def release(self, seq_id: int) -> None:
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)
