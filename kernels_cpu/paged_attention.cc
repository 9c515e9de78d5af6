// Paged attention for XLA:CPU, as an XLA FFI custom call: decode rows and prefill chunks alike.
//
// Each row of the batch is a run of query tokens of one sequence (one token for a decode row, a chunk
// for a prefill row) at consecutive positions; each token attends causally over that sequence's cached
// keys and values, read page by page straight from one layer of the stacked KV pool
// [layers, kv_heads, blocks, block_size, head_dim] through the block table: nothing is gathered into a
// copy first, which is what makes the plain-XLA path slow on CPU. Softmax is computed online in float32.
// The pool is float32 or bfloat16 (both pools the same; bfloat16 also as its raw bits, uint16, which is
// how the engine stores it on CPU), float8 e4m3 as its bits (uint8: the float8 KV cache), or int8 with a
// float32 scale per cached token and kv head (int8_per_token_head: value = int8 * scale, the scales in
// [layers, kv_heads, blocks, block_size] arrays beside the pools, read in place like the pages); bfloat16,
// float8 and int8 elements are widened to float32 as they are loaded (int8 rows times their scale), so the
// math is float32 either way.
// With a logit soft-cap c > 0 (Gemma 2's attn_logit_softcapping) each scaled score s = (q . k) * sm_scale
// becomes c * tanh(s / c) before masking and the softmax; c = 0 (none) compiles a variant without it.
// Work items are (row, kv head, block of up to 16 query tokens): each loads a tile of 16 cached tokens
// once and uses it for every query token of the block and every query head of the group. Items are
// shared between the calling thread and XLA's intra-op thread pool through an atomic counter: the
// caller never waits on a task that has not started.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxGroup = 16;     // query heads per kv head
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kQueryBlock = 16;   // query tokens per work item

struct Problem {
  const float* q;             // [T, Hq, D]: the rows' query tokens, back to back
  const void* k_pool;         // [L, Hkv, NB, BS, D]: float32, bfloat16 (as uint16_t), float8 (uint8_t) or int8
  const void* v_pool;
  const float* k_scales;      // [L, Hkv, NB, BS]: an int8 pool's row scales (null for the other pools)
  const float* v_scales;
  const int32_t* block_tables;  // [S, P]
  const int32_t* query_starts;  // [S]: row s's first token in q
  const int32_t* query_lens;    // [S]: row s's tokens in q
  const int32_t* positions;     // [S]: the position of row s's first token in its sequence
  const int32_t* lengths;       // [S]: tokens of the sequence visible to row s (its cached context)
  const float* sinks;           // [Hq]: each query head's sink logit (gpt-oss), or null for none
  float* out;                   // [T, Hq, D]
  int64_t layer, num_tokens, num_q_heads, num_kv_heads, num_blocks, block_size, head_dim, pages_per_seq;
  int64_t sliding_window;  // 0: none (an operand: a step's layers may differ)
  float sm_scale;
  float logit_softcap;  // 0: none
};

// A pool element as float32. A bfloat16 is the upper half of the float32 with the same value: widening is
// a 16-bit shift of its bits, which vectorizes (zero-extend, shift) in the loops below.
inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bfloat16_bits) {
  const uint32_t bits = static_cast<uint32_t>(bfloat16_bits) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// A float8 e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities, S.1111.111 is NaN) as
// float32, from a table of its 256 values: the engine's float8 KV cache, stored as its bits (uint8).
struct Float8E4M3Table {
  float value[256];
  Float8E4M3Table() {
    for (int bits = 0; bits < 256; ++bits) {
      const int exponent = (bits >> 3) & 0xF, mantissa = bits & 0x7;
      float magnitude = exponent == 0 ? std::ldexp(mantissa / 8.0f, -6)  // subnormal
                                      : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      if (exponent == 0xF && mantissa == 0x7) magnitude = std::numeric_limits<float>::quiet_NaN();
      value[bits] = (bits & 0x80) ? -magnitude : magnitude;
    }
  }
};
const Float8E4M3Table kFloat8E4M3;
inline float ToFloat(uint8_t float8_e4m3_bits) { return kFloat8E4M3.value[float8_e4m3_bits]; }

// An int8 element is a value only times its row's scale (int8_per_token_head), which LoadTile applies.
inline float ToFloat(int8_t x) { return x; }
template <typename T>
constexpr bool kScaled = std::is_same_v<T, int8_t>;

// 16 float32 lanes: one AVX-512 register, two AVX2 ones; GCC's and Clang's vector extension, so the code
// below states the vector algorithm once and the compiler picks the instructions for the native ISA.
constexpr int64_t kLanes = 16;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

#if defined(__clang__) || __GNUC__ >= 12
#define JAXSERVE_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t VecIndex __attribute__((vector_size(kLanes * sizeof(int32_t))));
#define JAXSERVE_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, VecIndex{__VA_ARGS__})
#endif

// Lane i of the result is the sum of v[i]'s lanes (v is overwritten). Pairwise: each round adds the even
// and odd lanes of two neighbours, halving the vectors, so 16 sums cost 15 adds and 30 shuffles instead
// of a horizontal reduction each.
inline Vec SumEach(Vec v[kLanes]) {
  for (int64_t count = kLanes; count > 1; count /= 2) {
    for (int64_t i = 0; i < count / 2; ++i) {
      const Vec a = v[2 * i], b = v[2 * i + 1];
      v[i] = JAXSERVE_SHUFFLE(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
             JAXSERVE_SHUFFLE(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    }
  }
  return v[0];
}

typedef int32_t VecInt __attribute__((vector_size(kLanes * sizeof(int32_t))));
constexpr VecInt kLaneIndex = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

inline Vec Broadcast(float x) { return Vec{} + x; }

// exp(x) on every lane for x <= 0, in float32 (relative error about 1e-7, as libm's), branch-free:
// x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for an exact product; for x in [-87, 0],
// trunc(x / ln2 - 0.5) rounds x / ln2 to nearest), exp(r) by its degree-7 Taylor polynomial, times 2^n
// built from its bits. x below -87 (and -inf) gives about 1e-38 instead of 0; callers that need an exact
// zero select it.
inline Vec ExpNonPositive(Vec x) {
  x = x < Broadcast(-87.0f) ? Broadcast(-87.0f) : x;
  const VecInt n_int = __builtin_convertvector(x * 1.4426950408889634f - 0.5f, VecInt);
  const Vec n = __builtin_convertvector(n_int, Vec);
  const Vec r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  Vec poly = Broadcast(1.0f / 5040.0f);
  poly = poly * r + 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  return poly * (Vec)((n_int + 127) << 23);  // the cast reinterprets the bits: 2^n
}

// tanh(x) on every lane, in float32 (a few ulp), branch-free: Eigen's rational approximation, an odd
// degree-13 polynomial over an even degree-6 one on x clamped to [-7.9053, 7.9053] (where tanh rounds to
// +-1 in float32); below |x| = 4e-4, tanh(x) rounds to x itself. A NaN lane stays NaN.
inline Vec Tanh(Vec x) {
  const Vec clamped = x > Broadcast(7.90531110763549805f) ? Broadcast(7.90531110763549805f)
                      : x < Broadcast(-7.90531110763549805f) ? Broadcast(-7.90531110763549805f) : x;
  const Vec x2 = clamped * clamped;
  Vec numerator = Broadcast(-2.76076847742355e-16f);
  numerator = numerator * x2 + 2.00018790482477e-13f;
  numerator = numerator * x2 - 8.60467152213735e-11f;
  numerator = numerator * x2 + 5.12229709037114e-08f;
  numerator = numerator * x2 + 1.48572235717979e-05f;
  numerator = numerator * x2 + 6.37261928875436e-04f;
  numerator = numerator * x2 + 4.89352455891786e-03f;
  Vec denominator = Broadcast(1.19825839466702e-06f);
  denominator = denominator * x2 + 1.18534705686654e-04f;
  denominator = denominator * x2 + 2.26843463243900e-03f;
  denominator = denominator * x2 + 4.89352518554385e-03f;
  const VecInt is_tiny = (x < Broadcast(4e-4f)) & (x > Broadcast(-4e-4f));
  return is_tiny ? x : clamped * numerator / denominator;
}

// Folds a vector's 16 lanes into one with `combine` (elementwise on vectors), by halving: 4 shuffles.
template <typename Combine>
inline float ReduceLanes(Vec x, Combine combine) {
  x = combine(x, JAXSERVE_SHUFFLE(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  x = combine(x, JAXSERVE_SHUFFLE(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3));
  x = combine(x, JAXSERVE_SHUFFLE(x, x, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1));
  x = combine(x, JAXSERVE_SHUFFLE(x, x, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0));
  return x[0];
}

inline float Max(Vec x) {
  return ReduceLanes(x, [](Vec a, Vec b) { return a > b ? a : b; });
}

inline float Sum(Vec x) {
  return ReduceLanes(x, [](Vec a, Vec b) { return a + b; });
}

// Up to 16 consecutive cached tokens of one page, widened to float32 into [kLanes, padded_dim] tiles (an
// int8 pool's rows times their `scales`, unused for the other pools); rows past `count` and columns past
// `dim` are zeros, so every lane computes on finite numbers and the unread slots of the pool (other
// sequences' data, or garbage, their scales included) never enter the arithmetic.
template <typename T>
void LoadTile(const T* rows, const float* scales, int64_t count, int64_t dim, int64_t padded_dim, float* tile) {
  for (int64_t t = 0; t < count; ++t) {
    float* row = tile + t * padded_dim;
    if constexpr (kScaled<T>) {
      const float scale = scales[t];
      for (int64_t d = 0; d < dim; ++d) row[d] = ToFloat(rows[t * dim + d]) * scale;
    } else {
      for (int64_t d = 0; d < dim; ++d) row[d] = ToFloat(rows[t * dim + d]);
    }
    std::fill(row + dim, row + padded_dim, 0.0f);
  }
  std::fill(tile + count * padded_dim, tile + kLanes * padded_dim, 0.0f);
}

// Asks for a page's rows ahead of use: pages are scattered through the pool, so the hardware prefetcher
// cannot guess the next one, and each page switch would otherwise wait on memory. Always inlined, as is
// PrefetchPage: GCC (12, -O2 and up) counts a prefetch as no side effect, so a call to a function that only
// prefetches, left to its caller's inliner, can be dropped as dead code (its mod/ref summary is empty).
__attribute__((always_inline)) inline void Prefetch(const void* page, int64_t bytes) {
  const char* first_byte = static_cast<const char*>(page);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(first_byte + offset);
}

// The K and V rows (and an int8 pool's scales) of the page whose first token slot is `slot`.
template <typename T>
__attribute__((always_inline)) inline void PrefetchPage(const Problem& p, int64_t slot) {
  const int64_t rows = p.block_size * p.head_dim;
  Prefetch(static_cast<const T*>(p.k_pool) + slot * p.head_dim, rows * static_cast<int64_t>(sizeof(T)));
  Prefetch(static_cast<const T*>(p.v_pool) + slot * p.head_dim, rows * static_cast<int64_t>(sizeof(T)));
  if constexpr (kScaled<T>) {
    Prefetch(p.k_scales + slot, p.block_size * static_cast<int64_t>(sizeof(float)));
    Prefetch(p.v_scales + slot, p.block_size * static_cast<int64_t>(sizeof(float)));
  }
}

// Online-softmax state of one query head of one token: its query (pre-scaled by sm_scale, and with a
// soft-cap c also by 1 / c), running maximum, denominator and weighted sum of values, each
// [padded_dim / kLanes] vectors.
struct HeadState {
  Vec q[kMaxHeadDim / kLanes];
  Vec acc[kMaxHeadDim / kLanes];
  float max_score, denom;
};

// Folds lanes [lo, hi) of a tile of cached tokens into a head's state: 16 scores at once (a dot product
// per lane, summed by SumEach), the running maximum and denominator rescaled, then the values weighted
// into acc. With kSoftCap the dot products are s / softcap (q is pre-scaled, see HeadState) and the scores
// softcap * tanh of them; the variant without it has no trace of the cap. Lanes outside [lo, hi) get exactly
// zero weight; their tile rows are finite (rows the item loaded, or the zeros past them), so they add nothing.
template <bool kSoftCap>
void AttendTile(HeadState& head, const Vec* keys, const Vec* values, int64_t lo, int64_t hi, int64_t chunks,
                float softcap) {
  Vec partial[kLanes];
  for (int64_t t = 0; t < kLanes; ++t) {
    Vec dot = head.q[0] * keys[t * chunks];
    for (int64_t c = 1; c < chunks; ++c) dot += head.q[c] * keys[t * chunks + c];
    partial[t] = dot;
  }
  const VecInt in_range = (kLaneIndex >= static_cast<int32_t>(lo)) & (kLaneIndex < static_cast<int32_t>(hi));
  Vec raw = SumEach(partial);
  if constexpr (kSoftCap) raw = softcap * Tanh(raw);
  const Vec scores = in_range ? raw : Broadcast(-std::numeric_limits<float>::infinity());
  const float tile_max = std::max(head.max_score, Max(scores));
  const Vec weights = in_range ? ExpNonPositive(scores - tile_max) : Vec{};  // exactly zero when masked
  const float correction = head.max_score == -std::numeric_limits<float>::infinity()
                               ? 0.0f : ExpNonPositive(Broadcast(head.max_score - tile_max))[0];
  head.denom = head.denom * correction + Sum(weights);
  head.max_score = tile_max;
  for (int64_t c = 0; c < chunks; ++c) {  // masked lanes add 0 x (a zero or finite row): nothing
    Vec acc = head.acc[c] * correction;
    for (int64_t t = 0; t < kLanes; ++t) acc += weights[t] * values[t * chunks + c];
    head.acc[c] = acc;
  }
}

// One work item: up to kQueryBlock query tokens of row s, starting at its token `first_query`, under kv
// head h (the `group` query heads that share it); T is the pool's element type. The item walks the pages
// from the first key any of its tokens sees to its last token's position, 16 cached tokens at a time
// (never crossing a page); each tile is read from the pool and widened once, then used by every token and
// query head of the item (an int8 pool's rows with their scales). Tokens at or past the row's length
// (padding) are left as the handler's zeros.
// kSoftCap: whether the scores are soft-capped (p.logit_softcap > 0).
template <typename T, bool kSoftCap>
void AttendBlock(const Problem& p, int64_t s, int64_t first_query, int64_t h) {
  const int64_t group = p.num_q_heads / p.num_kv_heads, dim = p.head_dim, bs = p.block_size;
  const int64_t chunks = (dim + kLanes - 1) / kLanes, padded_dim = chunks * kLanes;
  const int64_t length = std::min<int64_t>(p.lengths[s], p.pages_per_seq * bs);
  const int64_t block_queries = std::min<int64_t>(kQueryBlock, p.query_lens[s] - first_query);
  const int64_t first_position = p.positions[s] + first_query;
  // the tokens of the block that have a query: position in [0, length)
  const int64_t lo_query = std::clamp<int64_t>(-first_position, 0, block_queries);
  const int64_t hi_query = std::clamp<int64_t>(length - first_position, lo_query, block_queries);
  auto window_start = [&](int64_t position) {
    return p.sliding_window > 0 ? std::max<int64_t>(0, position - p.sliding_window + 1) : 0;
  };
  if (lo_query == hi_query) return;  // padding only: the handler zeroed its output

  // where token i's `group` query heads (of kv head h) start in q and out
  auto heads_offset = [&](int64_t i) {
    return ((p.query_starts[s] + first_query + i) * p.num_q_heads + h * group) * dim;
  };
  thread_local std::vector<HeadState> states;
  states.resize(kQueryBlock * kMaxGroup);
  // q . k times this is the score, or with the soft-cap s / c, the argument of its tanh
  const float q_scale = kSoftCap ? p.sm_scale / p.logit_softcap : p.sm_scale;
  for (int64_t i = lo_query; i < hi_query; ++i) {
    const float* q = p.q + heads_offset(i);
    for (int64_t g = 0; g < group; ++g) {
      HeadState& head = states[i * group + g];
      float* head_q = reinterpret_cast<float*>(head.q);
      for (int64_t d = 0; d < padded_dim; ++d) head_q[d] = d < dim ? q[g * dim + d] * q_scale : 0.0f;
      for (int64_t c = 0; c < chunks; ++c) head.acc[c] = Vec{};
      // a sink is one more score in the softmax's denominator, with no value: the state starts on it
      head.max_score = p.sinks ? p.sinks[h * group + g] : -std::numeric_limits<float>::infinity();
      head.denom = p.sinks ? 1.0f : 0.0f;
    }
  }

  Vec keys[kLanes * kMaxHeadDim / kLanes], values[kLanes * kMaxHeadDim / kLanes];
  const int64_t layer_head = (p.layer * p.num_kv_heads + h) * p.num_blocks;
  const int32_t* table = p.block_tables + s * p.pages_per_seq;
  // A page's first token slot in the pool ([L, Hkv, NB, BS] order: its rows start at slot * dim, its scales
  // at slot). Out-of-range entries are clamped, as XLA clamps gather indices: a bad table never reads
  // outside the pool.
  auto page_slot = [&](int64_t page_index) {
    return (layer_head + std::clamp<int64_t>(table[page_index], 0, p.num_blocks - 1)) * bs;
  };
  const T* k_pool = static_cast<const T*>(p.k_pool);
  const T* v_pool = static_cast<const T*>(p.v_pool);
  const int64_t first_key = window_start(first_position + lo_query);
  const int64_t last_key = first_position + hi_query - 1;  // the block's last query attends up to itself
  const int64_t last_page = last_key / bs;
  for (int64_t page_index = first_key / bs; page_index <= last_page; ++page_index) {
    if (page_index < last_page) PrefetchPage<T>(p, page_slot(page_index + 1));
    const int64_t page = page_slot(page_index), page_start = page_index * bs;
    const int64_t stop = std::min<int64_t>(bs, last_key + 1 - page_start);
    for (int64_t t = std::max<int64_t>(first_key - page_start, 0); t < stop; t += kLanes) {
      const int64_t count = std::min<int64_t>(kLanes, stop - t), slot = page + t;
      const float* k_scales = kScaled<T> ? p.k_scales + slot : nullptr;
      const float* v_scales = kScaled<T> ? p.v_scales + slot : nullptr;
      LoadTile(k_pool + slot * dim, k_scales, count, dim, padded_dim, reinterpret_cast<float*>(keys));
      LoadTile(v_pool + slot * dim, v_scales, count, dim, padded_dim, reinterpret_cast<float*>(values));
      const int64_t tile_position = page_start + t;
      for (int64_t i = lo_query; i < hi_query; ++i) {  // token i sees positions [window_start, its own]
        const int64_t position = first_position + i;
        const int64_t lo = std::max<int64_t>(window_start(position) - tile_position, 0);
        const int64_t hi = std::min<int64_t>(position + 1 - tile_position, count);
        if (lo >= hi) continue;
        for (int64_t g = 0; g < group; ++g) {
          AttendTile<kSoftCap>(states[i * group + g], keys, values, lo, hi, chunks, p.logit_softcap);
        }
      }
    }
  }
  for (int64_t i = lo_query; i < hi_query; ++i) {
    float* out = p.out + heads_offset(i);
    for (int64_t g = 0; g < group; ++g) {
      const HeadState& head = states[i * group + g];
      const float inv = 1.0f / head.denom;
      const float* acc = reinterpret_cast<const float*>(head.acc);
      for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = acc[d] * inv;
    }
  }
}

// A work item: a block of a row's query tokens under one kv head.
struct Item {
  int32_t row, first_query;
};

using AttendBlockFn = void (*)(const Problem&, int64_t, int64_t, int64_t);

// Work shared by the caller and pool tasks; kept alive by whichever finishes last.
struct SharedWork {
  Problem problem;
  AttendBlockFn attend_block;  // AttendBlock<the pool's element type, whether soft-capped>
  std::vector<Item> blocks;  // every (row, query block); each is an item per kv head
  int64_t num_items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mutex;
  std::condition_variable all_done;

  void Drain() {
    int64_t finished = 0;
    for (int64_t item = next.fetch_add(1); item < num_items; item = next.fetch_add(1)) {
      const Item& block = blocks[item / problem.num_kv_heads];
      attend_block(problem, block.row, block.first_query, item % problem.num_kv_heads);
      ++finished;
    }
    if (finished && done.fetch_add(finished) + finished == num_items) {
      std::lock_guard<std::mutex> lock(mutex);
      all_done.notify_all();
    }
  }
};

// The AttendBlock variant for the pool's element type (float32, bfloat16 bits, float8 e4m3 bits or int8) and
// the soft-cap: choosing it once per call keeps the branches out of the loops.
AttendBlockFn PickAttendBlock(ffi::DataType dtype, bool softcap) {
  if (dtype == ffi::F32) return softcap ? &AttendBlock<float, true> : &AttendBlock<float, false>;
  if (dtype == ffi::U8) return softcap ? &AttendBlock<uint8_t, true> : &AttendBlock<uint8_t, false>;
  if (dtype == ffi::S8) return softcap ? &AttendBlock<int8_t, true> : &AttendBlock<int8_t, false>;
  return softcap ? &AttendBlock<uint16_t, true> : &AttendBlock<uint16_t, false>;
}

// The rows' query ranges must lie inside q: a bad range is an error, not a write outside the output.
ffi::Error CheckRows(const Problem& p, int64_t num_rows) {
  for (int64_t s = 0; s < num_rows; ++s) {
    const int64_t start = p.query_starts[s], count = p.query_lens[s];
    if (count < 0 || start < 0 || start + count > p.num_tokens) {
      return ffi::Error::InvalidArgument("a row's query tokens lie outside q");
    }
  }
  return ffi::Error::Success();
}

using Scales = std::optional<ffi::Buffer<ffi::F32>>;

// An int8 pool comes with both scale arrays, each shaped like the pools without head_dim; the others with none.
ffi::Error CheckScales(ffi::DataType dtype, ffi::AnyBuffer::Dimensions pool_dims, const Scales& k_scales,
                       const Scales& v_scales) {
  if (dtype != ffi::S8) {
    if (k_scales || v_scales) return ffi::Error::InvalidArgument("k_scales and v_scales go with int8 KV pools only");
    return ffi::Error::Success();
  }
  for (const Scales* scales : {&k_scales, &v_scales}) {
    if (!*scales) return ffi::Error::InvalidArgument("an int8 KV pool needs both k_scales and v_scales");
    const ffi::AnyBuffer::Dimensions dims = (*scales)->dimensions();
    if (dims.size() != 4 || !std::equal(dims.begin(), dims.end(), pool_dims.begin())) {
      return ffi::Error::InvalidArgument("the KV scales must be float32 [L, Hkv, NB, BS] (the pools' shape)");
    }
  }
  return ffi::Error::Success();
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pool,
                              ffi::AnyBuffer v_pool, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> block_tables,
                              ffi::Buffer<ffi::S32> query_starts, ffi::Buffer<ffi::S32> query_lens,
                              ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> lengths,
                              ffi::Buffer<ffi::S32> sliding_window, ffi::Buffer<ffi::F32> sinks,
                              Scales k_scales, Scales v_scales,
                              ffi::ResultBuffer<ffi::F32> out, float sm_scale, float logit_softcap) {
  auto q_dims = q.dimensions(), pool_dims = k_pool.dimensions(), table_dims = block_tables.dimensions();
  if (q_dims.size() != 3 || pool_dims.size() != 5 || table_dims.size() != 2 ||
      v_pool.dimensions().size() != 5 || !std::equal(pool_dims.begin(), pool_dims.end(), v_pool.dimensions().begin())) {
    return ffi::Error::InvalidArgument(
        "expected q [T, Hq, D], pools [L, Hkv, NB, BS, D] (both the same), tables [S, P]");
  }
  const int64_t num_rows = table_dims[0];
  for (auto* row_array : {&query_starts, &query_lens, &positions, &lengths}) {
    if (row_array->element_count() != num_rows) return ffi::Error::InvalidArgument("expected one entry per row");
  }
  const ffi::DataType dtype = k_pool.element_type();
  if ((dtype != ffi::F32 && dtype != ffi::BF16 && dtype != ffi::U16 && dtype != ffi::U8 && dtype != ffi::S8) ||
      v_pool.element_type() != dtype) {
    return ffi::Error::InvalidArgument(
        "the KV pools must both be float32, bfloat16 (or its uint16 bits), float8 e4m3 bits (uint8) or int8");
  }
  if (ffi::Error error = CheckScales(dtype, pool_dims, k_scales, v_scales); error.failure()) return error;
  if (sliding_window.element_count() != 1 || sliding_window.typed_data()[0] < 0) {
    return ffi::Error::InvalidArgument("sliding_window must be one int32 >= 0 (0: no window)");
  }
  if (sinks.element_count() != 0 && sinks.element_count() != q_dims[1]) {
    return ffi::Error::InvalidArgument("sinks must be float32 [Hq] (one per query head), or [0] for none");
  }
  Problem p{q.typed_data(), k_pool.untyped_data(), v_pool.untyped_data(),
            k_scales ? k_scales->typed_data() : nullptr, v_scales ? v_scales->typed_data() : nullptr,
            block_tables.typed_data(), query_starts.typed_data(), query_lens.typed_data(), positions.typed_data(),
            lengths.typed_data(), sinks.element_count() ? sinks.typed_data() : nullptr, out->typed_data(),
            layer.typed_data()[0], q_dims[0], q_dims[1], pool_dims[1], pool_dims[2], pool_dims[3], pool_dims[4],
            table_dims[1], sliding_window.typed_data()[0], sm_scale, logit_softcap};
  if (p.num_kv_heads == 0 || p.num_q_heads % p.num_kv_heads != 0 || p.num_q_heads / p.num_kv_heads > kMaxGroup ||
      p.head_dim > kMaxHeadDim || q_dims[2] != p.head_dim) {
    return ffi::Error::InvalidArgument("unsupported head layout for the CPU paged attention");
  }
  if (p.layer < 0 || p.layer >= pool_dims[0]) return ffi::Error::InvalidArgument("layer out of range");
  if (!(logit_softcap >= 0.0f) || logit_softcap == std::numeric_limits<float>::infinity()) {
    return ffi::Error::InvalidArgument("logit_softcap must be finite and positive, or 0 for none");
  }
  if (ffi::Error error = CheckRows(p, num_rows); error.failure()) return error;
  // Tokens outside every row are zeros, like padding tokens inside a row.
  std::memset(p.out, 0, sizeof(float) * p.num_tokens * p.num_q_heads * p.head_dim);
  auto work = std::make_shared<SharedWork>();
  work->problem = p;
  work->attend_block = PickAttendBlock(dtype, p.logit_softcap > 0.0f);
  for (int32_t s = 0; s < num_rows; ++s) {
    for (int32_t first = 0; first < p.query_lens[s]; first += kQueryBlock) work->blocks.push_back({s, first});
  }
  work->num_items = static_cast<int64_t>(work->blocks.size()) * p.num_kv_heads;
  if (work->num_items == 0) return ffi::Error::Success();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->num_items - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  std::unique_lock<std::mutex> lock(work->mutex);
  work->all_done.wait(lock, [&] { return work->done.load() == work->num_items; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_pool: F32, BF16, U16 (bf16), U8 (e4m3), S8
                                  .Arg<ffi::AnyBuffer>()         // v_pool: the same
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_starts
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sliding_window [1]: 0 for none (traced per layer)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks [Hq], or [0] for none
                                  .OptionalArg<ffi::Buffer<ffi::F32>>()  // k_scales: with an S8 pool only
                                  .OptionalArg<ffi::Buffer<ffi::F32>>()  // v_scales
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("logit_softcap"));  // 0: none
