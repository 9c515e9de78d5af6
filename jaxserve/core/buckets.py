"""Bucket specs (``buckets/*.toml``), the pruned grid of executables, and nearest-bucket choice.

XLA compiles one program per input shape, so every model step runs on a precompiled bucket:

- decode  ``DecodeBucket(batch_size, context_len)``: ``batch_size`` rows of one query token each;
- prefill ``PrefillBucket(batch_size, chunk_len, context_len)``: ``batch_size`` rows of
  ``chunk_len`` query tokens each;
- mixed   ``MixedBucket(num_tokens, batch_size, context_len)``: decode rows (one query token each)
  and prefill chunks in one step, as a flat ragged batch of ``num_tokens`` query tokens over at most
  ``batch_size`` rows (optional: only specs with a ``[mixed]`` table have them).

``context_len`` bounds the tokens a row attends to (the cache after the step), hence the block-table
width (``context_len // block_size`` pages) and the attention work. A real batch is padded up to the
smallest bucket that holds it (3 sequences run on the batch-4 decoder with one padding row). The
``BucketGrid`` keeps only the buckets some admissible batch can select, so it is both the list of
executables to compile and the lookup table the ``Scheduler`` uses every step. While the engine compiles its
grid in the background (`compilation/background.py`), steps select only among the buckets whose executables
have landed, at first the covering set (`covering_buckets`: the few buckets that hold every admissible step).

No JAX here.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxserve.config.kv_cache_groups import KVCacheLayout
from jaxserve.math_utils import cdiv

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu"}

# TOML layout: table -> {key: BucketSpec field}
_SPEC_KEYS = {
    "decode": {"batch_sizes": "decode_batch_sizes"},
    "prefill": {"batch_sizes": "prefill_batch_sizes", "lengths": "prefill_lengths"},
    "context": {"lengths": "context_lengths"},
    "mixed": {"batch_sizes": "mixed_batch_sizes", "token_counts": "mixed_token_counts"},
}
# Tables a spec may leave out: then all their fields are () and the grid has none of those buckets.
_OPTIONAL_TABLES = ("mixed",)
# Keys a table may leave out: table -> {key: BucketSpec field}, each a positive integer (None when absent).
_OPTIONAL_KEYS = {"mixed": {"token_budget": "mixed_token_budget"}}
_FIELD_NAMES = {f: f"[{table}] {key}" for table, keys in _SPEC_KEYS.items() for key, f in keys.items()}


@dataclass(frozen=True, order=True)
class DecodeBucket:
    batch_size: int
    context_len: int

    @property
    def num_tokens(self) -> int:
        """Query tokens in the padded batch."""
        return self.batch_size

    def num_pages(self, block_size: int) -> int:
        return self.context_len // block_size


@dataclass(frozen=True, order=True)
class PrefillBucket:
    batch_size: int
    chunk_len: int
    context_len: int

    @property
    def num_tokens(self) -> int:
        """Query tokens in the padded batch."""
        return self.batch_size * self.chunk_len

    def num_pages(self, block_size: int) -> int:
        return self.context_len // block_size


@dataclass(frozen=True, order=True)
class MixedBucket:
    """A flat ragged batch: ``num_tokens`` query tokens over at most ``batch_size`` rows, where a decode
    row has one token (and its drafts, in a speculative engine) and a prefill chunk several.

    A speculative engine's mixed step samples ``num_sample_positions`` positions: a row's last token and each
    of its (at most ``num_speculative_tokens``) drafts (`runner/spec_verify.py`); 0: one per row."""

    num_tokens: int
    batch_size: int
    context_len: int
    num_sample_positions: int = 0
    num_speculative_tokens: int = 0

    def num_pages(self, block_size: int) -> int:
        return self.context_len // block_size


Bucket = DecodeBucket | PrefillBucket | MixedBucket


# -- spec -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BucketSpec:
    """The bucket sizes of one target, as written in a ``buckets/*.toml`` file (its ``[mixed]`` table is
    optional: without one, the grid has no mixed buckets)."""

    decode_batch_sizes: tuple[int, ...]
    prefill_batch_sizes: tuple[int, ...]
    prefill_lengths: tuple[int, ...]
    context_lengths: tuple[int, ...]
    # the optional [mixed] table; keyword-only, so positional construction is as before
    mixed_batch_sizes: tuple[int, ...] = field(default=(), kw_only=True)
    mixed_token_counts: tuple[int, ...] = field(default=(), kw_only=True)
    # tokens of a mixed step without a latency target (core/step_budget.py); None: the largest mixed bucket
    mixed_token_budget: int | None = field(default=None, kw_only=True)
    block_size: int | None = None
    source: str = field(default="<spec>", compare=False)

    def __post_init__(self) -> None:
        absent = _absent_fields(self)
        for name in _FIELD_NAMES:
            if name not in absent:
                object.__setattr__(self, name, _check_sizes(self.source, name, getattr(self, name)))
        if self.block_size is not None:
            if not _is_int(self.block_size) or self.block_size < 1:
                raise ValueError(
                    f"{self.source}: block_size must be a positive integer, got {self.block_size!r}"
                )
            _check_context_multiple(self.source, self.context_lengths, self.block_size)
        budget = self.mixed_token_budget
        if budget is not None and (not _is_int(budget) or not 1 <= budget <= max(self.mixed_token_counts, default=0)):
            raise ValueError(f"{self.source}: [mixed] token_budget must be a positive integer within the largest "
                             f"[mixed] token_counts ({max(self.mixed_token_counts, default=0)}), got {budget!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<spec>") -> BucketSpec:
        kwargs: dict[str, Any] = {"block_size": data.get("block_size"), "source": source}
        for table in data:
            if table != "block_size" and table not in _SPEC_KEYS:
                raise ValueError(f"{source}: unknown table [{table}] (known: {', '.join(_SPEC_KEYS)})")
        for table in _SPEC_KEYS:
            if table in _OPTIONAL_TABLES and data.get(table) is None:
                continue
            kwargs.update(_read_table(source, table, data.get(table)))
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | Path) -> BucketSpec:
        path = Path(path)
        return cls.from_toml_text(path.read_text(), source=str(path))

    @classmethod
    def from_toml_text(cls, text: str, source: str = "<spec>") -> BucketSpec:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{source}: invalid TOML: {e}") from None
        return cls.from_dict(data, source)

    def replace(self, **changes: Any) -> BucketSpec:
        return dataclasses.replace(self, **changes)


def _read_table(source: str, table: str, values: Any) -> dict[str, Any]:
    """The ``BucketSpec`` fields of one TOML table, its keys checked (an optional table's values too,
    since written with empty lists it would read as absent)."""
    keys = _SPEC_KEYS[table]
    if not isinstance(values, dict):
        if table in _OPTIONAL_TABLES:
            raise ValueError(f"{source}: [{table}] must be a table, got {values!r}")
        raise ValueError(f"{source}: missing table [{table}]")
    optional = _OPTIONAL_KEYS.get(table, {})
    for key in values:
        if key not in keys and key not in optional:
            raise ValueError(f"{source}: unknown key [{table}] {key} (known: {', '.join([*keys, *optional])})")
    fields = {name: values[key] for key, name in optional.items() if key in values}
    for key, name in keys.items():
        if key not in values:
            raise ValueError(f"{source}: missing [{table}] {key}")
        fields[name] = _check_sizes(source, name, values[key]) if table in _OPTIONAL_TABLES else values[key]
    return fields


def _absent_fields(spec: BucketSpec) -> set[str]:
    """The fields of the optional tables ``spec`` leaves out (every field of the table empty)."""
    absent = set()
    for table in _OPTIONAL_TABLES:
        names = _SPEC_KEYS[table].values()
        if all(getattr(spec, name) in ((), []) for name in names):
            absent.update(names)
    return absent


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_sizes(source: str, name: str, values: Any) -> tuple[int, ...]:
    label = f"{source}: {_FIELD_NAMES[name]}"
    if not isinstance(values, list | tuple) or not values:
        raise ValueError(f"{label} must be a non-empty list of positive integers, got {values!r}")
    for v in values:
        if not _is_int(v) or v < 1:
            raise ValueError(f"{label} must contain positive integers, got {v!r}")
    if any(a >= b for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"{label} must be sorted ascending without repeats, got {list(values)}")
    return tuple(values)


def _check_context_multiple(source: str, context_lengths: tuple[int, ...], block_size: int) -> None:
    for c in context_lengths:
        if c % block_size:
            raise ValueError(
                f"{source}: [context] lengths must be multiples of block_size {block_size}, got {c}"
            )


# -- finding spec files -----------------------------------------------------------------------------


def _shipped_dir() -> Traversable:
    """The shipped spec files: package data (``jaxserve/_buckets``, also reachable as ``<repo>/buckets``)."""
    return importlib.resources.files("jaxserve") / "_buckets"


def available_bucket_specs() -> list[str]:
    return sorted(p.name[: -len(".toml")] for p in _shipped_dir().iterdir() if p.name.endswith(".toml"))


def load_bucket_spec(path_or_name: str | Path | None, platform: str = "cpu") -> BucketSpec:
    """None -> the platform's shipped spec; ``"cpu"`` -> the shipped ``cpu.toml``; a path -> that file.

    Shipped specs are package data in ``jaxserve/_buckets`` (``<repo>/buckets`` links there), so an
    installed wheel finds them as a checkout does.
    """
    name = str(path_or_name) if path_or_name is not None else PLATFORM_ALIASES.get(platform, platform)
    if name.endswith(".toml") or "/" in name or "\\" in name:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"bucket spec file {name} does not exist")
        return BucketSpec.from_toml(path)
    shipped = _shipped_dir() / f"{name}.toml"
    if shipped.is_file():
        return BucketSpec.from_toml_text(shipped.read_text(), source=str(shipped))
    raise ValueError(
        f"unknown bucket spec {name!r}: pass a .toml path or one of {', '.join(available_bucket_specs())}"
    )


# -- the pruned grid --------------------------------------------------------------------------------


def with_verification_sizes(spec: BucketSpec, num_speculative_tokens: int) -> BucketSpec:
    """``spec`` with up to two mixed token counts added below its smallest: the power of two that holds a lone decode
    row and its K drafts, and twice it (two or three rows). At low concurrency a step verifies a few rows, and on a
    small bucket it costs about a decode step (on a 2-core CPU a 32-token step costs 1.7 decode steps of one row,
    docs/benchmarks/speculative.md)."""
    counts = spec.mixed_token_counts
    if not counts:
        return spec
    smallest = 1 << num_speculative_tokens.bit_length()  # the power of two at or above K + 1
    added = []
    while smallest < counts[0] and len(added) < 2:
        added.append(smallest)
        smallest *= 2
    return spec.replace(mixed_token_counts=(*added, *counts)) if added else spec


def _prev(values: tuple[int, ...], v: int) -> int:
    """The value before ``v`` in the sorted ``values``; 0 for the first."""
    i = values.index(v)
    return values[i - 1] if i else 0


class BucketGrid:
    """The feasible buckets of ``spec`` under the engine limits.

    A bucket is kept iff some admissible batch selects it (the smallest bucket that fits is always
    chosen); every other bucket could never run, so it is pruned and never compiled. With ``x⁻`` the
    value before ``x`` in its spec list (0 for the first), the rules are:

    Context lengths
      C0. ``max_model_len <= max(context lengths)`` and ``ceil(max_model_len / block_size) <=
          num_blocks``, else ValueError (``check_max_model_len``).

    Decode ``(b, c)``
      D1. ``b⁻ < max_num_seqs``: at least ``b⁻ + 1`` sequences must be running to select ``b``; so the
          largest kept batch is ``max_num_seqs`` rounded up to a bucket (ValueError if the spec has
          no batch size that large).
      D2. ``c⁻ < max_model_len``: some sequence must reach context ``c⁻ + 1``.
      D3. ``b⁻ + ceil((c⁻ + 1) / block_size) <= num_blocks``: the smallest such batch (``b⁻``
          one-block sequences plus one of ``c⁻ + 1`` tokens) must fit the KV pool.

    Prefill ``(b, L, c)`` (a chunk is never longer than its context: context >= chunk)
      P1. ``b⁻ < max_num_seqs``.
      P2. ``b * L <= max_num_batched_tokens``; except for the smallest batch size, which only needs
          ``L⁻ < max_num_batched_tokens``: one sequence alone may be padded beyond the token budget
          (its real chunk is within the budget), but the scheduler only batches several sequences
          when the padded bucket stays within it.
      P3. ``max(c⁻, L⁻) < max_model_len``: a chunk longer than ``L⁻`` whose context exceeds ``c⁻``.
      P4. ``b⁻ + ceil((max(c⁻, L⁻) + 1) / block_size) <= num_blocks``.
      P5. ``L⁻ < c``: the chunk (longer than ``L⁻``) must fit in the context.

    Mixed ``(T, R, C)``: ``T`` query tokens over ``R`` rows (none unless the spec has ``[mixed]``)
      M1. ``R⁻ < max_num_seqs`` (rows are running sequences) and ``R >= 2``: a mixed step has at least
          one decode row and one chunk, so a spec batch size of 1 is never kept.
      M2. ``T⁻ < max_num_batched_tokens`` (the step's real tokens are within the token budget; the
          padding may go beyond it) and ``R⁻ + 1 <= T`` (every row has at least one token); with a
          ``mixed_token_limit`` (an engine without a latency target: the spec's ``[mixed] token_budget``,
          `core/step_budget.py`) also ``T⁻ < mixed_token_limit``.
      M3. ``C⁻ < max_model_len``.
      M4. ``R⁻ + ceil((C⁻ + 1) / block_size) <= num_blocks``.
      M5. ``T⁻ < R * C``: a row's query tokens fit its context, so ``R`` rows at context ``C`` hold
          at most ``R * C`` tokens.

    The kept sets are closed under "smallest fitting bucket" for every batch the ``Scheduler`` forms,
    so ``select_decode`` / ``select_prefill`` / ``select_mixed`` never fail for a batch within the
    limits (a mixed batch also within the spec's largest mixed sizes).
    """

    def __init__(
        self,
        spec: BucketSpec,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_blocks: int,
        mixed_token_limit: int | None = None,
        speculative: tuple[int, int] | None = None,
    ) -> None:
        """``speculative``: (K drafts at most per row, R rows at most with drafts) of a speculative engine; its
        mixed buckets sample a position per row and per draft, ``min(T, rows + K * min(rows, R))``, and the spec's
        mixed token counts go down to a lone row's verification (`with_verification_sizes`)."""
        if speculative is not None:
            spec = with_verification_sizes(spec, speculative[0])
        for name, value in [
            ("block_size", block_size),
            ("max_model_len", max_model_len),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("num_blocks", num_blocks),
        ]:
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.spec = spec
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_blocks = num_blocks
        self.mixed_token_limit = min(max_num_batched_tokens, mixed_token_limit or max_num_batched_tokens)
        _check_context_multiple(spec.source, spec.context_lengths, block_size)
        self.check_max_model_len(max_model_len)
        if max_num_seqs > spec.decode_batch_sizes[-1]:
            raise ValueError(
                f"max_num_seqs={max_num_seqs} exceeds the largest decode batch size "
                f"{spec.decode_batch_sizes[-1]} in {spec.source}; lower max_num_seqs or add a larger "
                "[decode] batch_sizes entry"
            )
        self.decode_buckets = [
            DecodeBucket(b, c)
            for b in spec.decode_batch_sizes
            for c in spec.context_lengths
            if self._decode_feasible(b, c)
        ]
        self.prefill_buckets = [
            PrefillBucket(b, n, c)
            for b in spec.prefill_batch_sizes
            for n in spec.prefill_lengths
            for c in spec.context_lengths
            if self._prefill_feasible(b, n, c)
        ]
        self.speculative = speculative
        self.mixed_buckets = [
            MixedBucket(t, r, c, *self._sample_positions(t, r))
            for r in spec.mixed_batch_sizes
            for t in spec.mixed_token_counts
            for c in spec.context_lengths
            if self._mixed_feasible(t, r, c)
        ]

        self._ready: set[Bucket] | None = None  # None: every bucket may be selected (`serve_only`)
        self.on_miss = None  # called with the bucket a step would have taken while it is not ready yet

    def _sample_positions(self, num_tokens: int, batch_size: int) -> tuple[int, int]:
        if self.speculative is None:
            return 0, 0
        k, max_rows = self.speculative
        return min(num_tokens, batch_size + k * min(batch_size, max_rows)), k

    # -- pruning ------------------------------------------------------------------------------------

    def _decode_feasible(self, b: int, c: int) -> bool:
        b0, c0 = _prev(self.spec.decode_batch_sizes, b), _prev(self.spec.context_lengths, c)
        return (
            b0 < self.max_num_seqs  # D1
            and c0 < self.max_model_len  # D2
            and b0 + cdiv(c0 + 1, self.block_size) <= self.num_blocks  # D3
        )

    def _prefill_feasible(self, b: int, n: int, c: int) -> bool:
        sizes = self.spec.prefill_batch_sizes
        b0, n0 = _prev(sizes, b), _prev(self.spec.prefill_lengths, n)
        min_context = max(_prev(self.spec.context_lengths, c), n0) + 1
        budget = self.max_num_batched_tokens
        budget_ok = n0 < budget if b == sizes[0] else b * n <= budget
        return (
            b0 < self.max_num_seqs  # P1
            and budget_ok  # P2
            and min_context <= self.max_model_len  # P3
            and b0 + cdiv(min_context, self.block_size) <= self.num_blocks  # P4
            and n0 < c  # P5
        )

    def _mixed_feasible(self, t: int, r: int, c: int) -> bool:
        t0, r0 = _prev(self.spec.mixed_token_counts, t), _prev(self.spec.mixed_batch_sizes, r)
        c0 = _prev(self.spec.context_lengths, c)
        return (
            r0 < self.max_num_seqs and r >= 2  # M1
            and t0 < self.mixed_token_limit and r0 + 1 <= t  # M2
            and c0 < self.max_model_len  # M3
            and r0 + cdiv(c0 + 1, self.block_size) <= self.num_blocks  # M4
            and t0 < r * c  # M5
        )

    # -- what may be selected: the covering set first, the rest as it compiles ------------------------

    def covering_buckets(self) -> list[Bucket]:
        """The fewest buckets that hold every admissible step, padded if need be: of each kind the buckets no
        other bucket of that kind holds (at least as many rows, tokens and context). Every batch selects some
        kept bucket, and every kept bucket is held by one of these, so selecting among them never fails."""
        def maximal(buckets, dims):
            return [b for b in buckets if not any(o != b and all(d(o) >= d(b) for d in dims) for o in buckets)]

        rows, context = (lambda b: b.batch_size), (lambda b: b.context_len)
        tokens = lambda b: b.num_tokens
        return [*maximal(self.prefill_buckets, (rows, lambda b: b.chunk_len, context)),
                *maximal(self.decode_buckets, (rows, context)), *maximal(self.mixed_buckets, (rows, tokens, context))]

    def serve_only(self, buckets) -> None:
        """From now on steps select only among ``buckets`` (at least the covering set) and those later made
        ready (`mark_ready`), as the engine's executables land; a step that would have taken a bucket not ready
        yet takes the smallest ready one that holds it, and ``on_miss`` hears of the bucket it wanted."""
        missing = set(self.covering_buckets()) - set(buckets)
        if missing:
            raise ValueError(f"the buckets served must hold every admissible step: missing {sorted(missing, key=str)}")
        self._ready = set(buckets)

    def mark_ready(self, buckets) -> None:
        if self._ready is not None:
            self._ready.update(buckets)
            if self._ready.issuperset(self.buckets):
                self._ready = None

    def is_ready(self, bucket: Bucket) -> bool:
        """Whether steps may select ``bucket`` now."""
        return self._ready is None or bucket in self._ready

    @property
    def num_ready(self) -> int:
        """Buckets steps may select now."""
        return self.num_executables if self._ready is None else len(self._ready)

    @property
    def is_complete(self) -> bool:
        """Whether every bucket of the grid may be selected."""
        return self._ready is None

    def _smallest(self, fits: list[Bucket], key) -> Bucket | None:
        """The smallest of ``fits`` by ``key`` among the ready buckets; ``on_miss`` hears of the smallest of all
        when it is not ready."""
        best = min(fits, key=key, default=None)
        if self._ready is None or best is None or best in self._ready:
            return best
        if self.on_miss is not None:
            self.on_miss(best)
        return min((b for b in fits if b in self._ready), key=key, default=None)

    # -- limits -------------------------------------------------------------------------------------

    @property
    def context_lengths(self) -> list[int]:
        """Context buckets in use (some decode bucket has them)."""
        return sorted({b.context_len for b in self.decode_buckets})

    @property
    def max_context_len(self) -> int:
        return max(b.context_len for b in self.decode_buckets)

    @property
    def max_decode_batch_size(self) -> int:
        return max(b.batch_size for b in self.decode_buckets)

    @property
    def max_prefill_batch_size(self) -> int:
        return max(b.batch_size for b in self.prefill_buckets)

    @property
    def max_mixed_batch_size(self) -> int:
        """The most rows of a mixed bucket; 0 without mixed buckets."""
        return max((b.batch_size for b in self.mixed_buckets), default=0)

    @property
    def max_mixed_tokens(self) -> int:
        """The most query tokens of a mixed bucket; 0 without mixed buckets."""
        return max((b.num_tokens for b in self.mixed_buckets), default=0)

    @property
    def has_mixed(self) -> bool:
        return bool(self.mixed_buckets)

    @property
    def max_batch_size(self) -> int:
        """The most rows any executable of the grid has."""
        return max(self.max_decode_batch_size, self.max_prefill_batch_size, self.max_mixed_batch_size)

    @property
    def max_chunk_len(self) -> int:
        return max(b.chunk_len for b in self.prefill_buckets)

    @property
    def buckets(self) -> list[Bucket]:
        """Every executable of the grid, in compile order: prefill, decode, mixed."""
        return [*self.prefill_buckets, *self.decode_buckets, *self.mixed_buckets]

    @property
    def num_executables(self) -> int:
        return len(self.buckets)

    def blocks_of_kinds(self, layout: KVCacheLayout, num_blocks: int | None = None) -> tuple[int, ...]:
        """The pool's blocks (or ``num_blocks``) shared out among ``layout``'s kinds of page for this grid's
        max_model_len and steps (`KVCacheLayout.blocks_of_kinds`): the block manager's and the pool's split."""
        return layout.blocks_of_kinds(self.num_blocks if num_blocks is None else num_blocks, self.max_model_len,
                                      self.block_size, self.max_num_batched_tokens)

    def check_max_model_len(self, max_model_len: int) -> None:
        largest = self.spec.context_lengths[-1]
        if max_model_len > largest:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the largest context bucket {largest} in "
                f"{self.spec.source}; lower max_model_len or add a larger [context] lengths entry"
            )
        pool_tokens = self.num_blocks * self.block_size
        if max_model_len > pool_tokens:
            raise ValueError(
                f"The model's max seq len ({max_model_len}) is larger than the maximum number of tokens "
                f"that can be stored in the KV cache ({pool_tokens} = {self.num_blocks} blocks of "
                f"{self.block_size}). Increase the KV cache (gpu_memory_utilization or num_kv_blocks) "
                "or decrease max_model_len."
            )

    def check_request(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Reject a request that can never fit ``max_model_len`` (vLLM's wording)."""
        limit = self.max_model_len
        if num_prompt_tokens < 1:
            raise ValueError("The prompt is empty: it must contain at least one token.")
        if max_tokens is None:
            if num_prompt_tokens >= limit:
                raise ValueError(
                    f"This model's maximum context length is {limit} tokens. However, your messages "
                    f"resulted in {num_prompt_tokens} tokens, which leaves no room for the completion. "
                    "Please reduce the length of the messages."
                )
            return
        total = num_prompt_tokens + max_tokens
        if total > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{total} tokens ({num_prompt_tokens} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion."
            )

    # -- selection ----------------------------------------------------------------------------------

    def find_decode(self, num_seqs: int, max_context_len: int) -> DecodeBucket | None:
        fits = [
            b for b in self.decode_buckets if b.batch_size >= num_seqs and b.context_len >= max_context_len
        ]
        return self._smallest(fits, key=lambda b: (b.batch_size * b.context_len, b.batch_size))

    def select_decode(self, num_seqs: int, max_context_len: int) -> DecodeBucket:
        """The smallest decode bucket holding ``num_seqs`` rows at ``max_context_len``; ValueError if none."""
        if num_seqs < 1 or max_context_len < 1:
            raise ValueError(
                f"select_decode needs num_seqs >= 1 and max_context_len >= 1, got "
                f"{num_seqs} and {max_context_len}"
            )
        bucket = self.find_decode(num_seqs, max_context_len)
        if bucket is None:
            raise ValueError(
                f"no decode bucket fits {num_seqs} sequences at context {max_context_len} "
                f"(largest: batch {self.max_decode_batch_size}, context {self.max_context_len})"
            )
        return bucket

    def find_prefill(self, num_seqs: int, max_chunk_len: int, max_context_len: int) -> PrefillBucket | None:
        fits = [
            b
            for b in self.prefill_buckets
            if b.batch_size >= num_seqs and b.chunk_len >= max_chunk_len and b.context_len >= max_context_len
        ]
        return self._smallest(fits, key=lambda b: (b.num_tokens, b.context_len, b.batch_size))

    def select_prefill(self, num_seqs: int, max_chunk_len: int, max_context_len: int) -> PrefillBucket:
        """The prefill bucket with the fewest padded tokens, then the smallest context; ValueError if none."""
        if num_seqs < 1 or max_chunk_len < 1 or max_context_len < max_chunk_len:
            raise ValueError(
                "select_prefill needs num_seqs >= 1 and 1 <= max_chunk_len <= max_context_len, got "
                f"{num_seqs}, {max_chunk_len}, {max_context_len}"
            )
        bucket = self.find_prefill(num_seqs, max_chunk_len, max_context_len)
        if bucket is None:
            raise ValueError(
                f"no prefill bucket fits {num_seqs} sequences with chunks of {max_chunk_len} tokens at "
                f"context {max_context_len} (largest: batch {self.max_prefill_batch_size}, chunk "
                f"{self.max_chunk_len}, context {self.max_context_len})"
            )
        return bucket

    def find_mixed(self, num_rows: int, num_tokens: int, max_context_len: int) -> MixedBucket | None:
        fits = [
            b
            for b in self.mixed_buckets
            if b.batch_size >= num_rows and b.num_tokens >= num_tokens and b.context_len >= max_context_len
        ]
        return self._smallest(fits, key=lambda b: (b.num_tokens, b.context_len, b.batch_size))

    def select_mixed(self, num_rows: int, num_tokens: int, max_context_len: int) -> MixedBucket:
        """The mixed bucket with the fewest padded tokens, then the smallest context, then the fewest rows,
        for ``num_rows`` rows (decode rows and chunks) of ``num_tokens`` query tokens in all; ValueError
        if none."""
        if num_rows < 1 or num_tokens < num_rows or max_context_len < 1:
            raise ValueError(
                "select_mixed needs num_rows >= 1, num_tokens >= num_rows and max_context_len >= 1, got "
                f"{num_rows}, {num_tokens}, {max_context_len}"
            )
        bucket = self.find_mixed(num_rows, num_tokens, max_context_len)
        if bucket is None:
            raise ValueError(
                f"no mixed bucket fits {num_rows} rows with {num_tokens} tokens at context {max_context_len} "
                f"({self._largest_mixed()})"
            )
        return bucket

    def _largest_mixed(self) -> str:
        """What the grid's mixed buckets hold at most, for ``select_mixed``'s error."""
        if not self.spec.mixed_batch_sizes:
            return f"{self.spec.source} has no [mixed] table"
        if not self.mixed_buckets:
            return f"every mixed bucket of {self.spec.source} is pruned at these limits"
        largest_context = max(b.context_len for b in self.mixed_buckets)
        return (
            f"largest: batch {self.max_mixed_batch_size}, tokens {self.max_mixed_tokens}, "
            f"context {largest_context}"
        )

    # -- start-up print -----------------------------------------------------------------------------

    def format_table(self) -> str:
        contexts = self.spec.context_lengths
        width = max(len(str(c)) for c in contexts) + 2
        lines = [
            f"bucket grid from {self.spec.source} (block_size={self.block_size}, max_model_len="
            f"{self.max_model_len}, max_num_seqs={self.max_num_seqs}, max_num_batched_tokens="
            f"{self.max_num_batched_tokens}, num_blocks={self.num_blocks})",
            f"decode: {len(self.decode_buckets)} executables",
        ]
        decode = set(self.decode_buckets)
        lines.append(f"  {'batch':>12}" + "".join(f"{c:>{width}}" for c in contexts))
        for b in self.spec.decode_batch_sizes:
            cells = "".join(f"{'x' if DecodeBucket(b, c) in decode else '-':>{width}}" for c in contexts)
            lines.append(f"  {b:>12}" + cells)
        lines.append(f"prefill: {len(self.prefill_buckets)} executables")
        prefill = set(self.prefill_buckets)
        lines.append(f"  {'batch x chunk':>12}" + "".join(f"{c:>{width}}" for c in contexts))
        for b in self.spec.prefill_batch_sizes:
            for n in self.spec.prefill_lengths:
                cells = "".join(
                    f"{'x' if PrefillBucket(b, n, c) in prefill else '-':>{width}}" for c in contexts
                )
                lines.append(f"  {f'{b} x {n}':>12}" + cells)
        if self.spec.mixed_batch_sizes:
            lines += self._format_mixed(width)
        lines.append(
            f"total: {self.num_executables} executables (columns: context length; x = compiled, "
            "- = pruned, no admissible batch selects it)"
        )
        return "\n".join(lines)

    def _format_mixed(self, width: int) -> list[str]:
        """The mixed section of ``format_table``: a row per ``batch x tokens``, a column per context."""
        contexts, header = self.spec.context_lengths, "batch x tokens"
        mixed = {(b.num_tokens, b.batch_size, b.context_len) for b in self.mixed_buckets}
        speculative = "" if self.speculative is None else (
            f" (speculative: each samples a position per row and per draft, at most {self.speculative[0]} drafts "
            f"per row on {self.speculative[1]} rows)")
        lines = [
            f"mixed: {len(self.mixed_buckets)} executables{speculative}",
            f"  {header}" + "".join(f"{c:>{width}}" for c in contexts),
        ]
        for r in self.spec.mixed_batch_sizes:
            for t in self.spec.mixed_token_counts:
                cells = "".join(f"{'x' if (t, r, c) in mixed else '-':>{width}}" for c in contexts)
                lines.append(f"  {f'{r} x {t}':>{len(header)}}" + cells)
        return lines


# -- padding accounting -----------------------------------------------------------------------------


def padding_waste(num_real_tokens: int, bucket: Bucket) -> float:
    """Fraction of the bucket's query tokens that are padding."""
    return (bucket.num_tokens - num_real_tokens) / bucket.num_tokens


@dataclass
class PaddingStats:
    """Running totals of real vs padded query tokens and attended context, per step kind."""

    prefill_real_tokens: int = 0
    prefill_padded_tokens: int = 0
    decode_real_tokens: int = 0
    decode_padded_tokens: int = 0
    mixed_real_tokens: int = 0
    mixed_padded_tokens: int = 0
    real_context_tokens: int = 0  # sum over rows of the real context length
    padded_context_tokens: int = 0  # batch_size * context_len of the buckets

    def record(self, bucket: Bucket, num_real_tokens: int, real_context_tokens: int) -> None:
        if isinstance(bucket, PrefillBucket):
            self.prefill_real_tokens += num_real_tokens
            self.prefill_padded_tokens += bucket.num_tokens
        elif isinstance(bucket, MixedBucket):
            self.mixed_real_tokens += num_real_tokens
            self.mixed_padded_tokens += bucket.num_tokens
        else:
            self.decode_real_tokens += num_real_tokens
            self.decode_padded_tokens += bucket.num_tokens
        self.real_context_tokens += real_context_tokens
        self.padded_context_tokens += bucket.batch_size * bucket.context_len

    @property
    def prefill_waste(self) -> float:
        return _waste(self.prefill_real_tokens, self.prefill_padded_tokens)

    @property
    def decode_waste(self) -> float:
        return _waste(self.decode_real_tokens, self.decode_padded_tokens)

    @property
    def mixed_waste(self) -> float:
        return _waste(self.mixed_real_tokens, self.mixed_padded_tokens)

    @property
    def context_waste(self) -> float:
        return _waste(self.real_context_tokens, self.padded_context_tokens)


def _waste(real: int, padded: int) -> float:
    return (padded - real) / padded if padded else 0.0
