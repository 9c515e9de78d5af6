// Decode-step paged attention for XLA:CPU, as an XLA FFI custom call.
//
// One query token per sequence attends over that sequence's cached keys and values, read page by page
// straight from one layer of the stacked KV pool [layers, kv_heads, blocks, block_size, head_dim]
// through the block table: nothing is gathered into a copy first, which is what makes the plain-XLA
// path memory-bound on CPU. Softmax is computed online, one page at a time, in float32.
// The pool is float32 or bfloat16 (both pools the same; bfloat16 also as its raw bits, uint16, which is
// how the engine stores it on CPU); bfloat16 elements are widened to float32 as they are loaded
// (AttendOne<uint16_t>), so the math is float32 either way.
// Work items are (sequence, kv head) pairs, shared between the calling thread and XLA's intra-op
// thread pool through an atomic counter: the caller never waits on a task that has not started.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxGroup = 16;     // query heads per kv head
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxBlockSize = 256;

struct Problem {
  const float* q;             // [S, Hq, D]
  const void* k_pool;         // [L, Hkv, NB, BS, D], float32 or bfloat16 (as uint16_t)
  const void* v_pool;
  const int32_t* block_tables;  // [S, P]
  const int32_t* lengths;       // [S]
  float* out;                   // [S, Hq, D]
  int64_t layer, num_seqs, num_q_heads, num_kv_heads, num_blocks, block_size, head_dim, pages_per_seq;
  int64_t sliding_window;  // 0: none
  float sm_scale;
};

// exp(x) for x <= 0 in float32 (relative error about 1e-7, as libm's), branch-free so that a loop of it
// vectorizes: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for an exact product), exp(r) by its
// degree-7 Taylor polynomial, times 2^n. x below -87 (and -inf) gives about 1e-38 instead of 0, which
// only ever multiplies zeros or is negligible next to the other weights.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.4426950408889634f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  float poly = 1.0f / 5040.0f;
  poly = poly * r + 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return poly * scale;
}

// A pool element as float32. A bfloat16 is the upper half of the float32 with the same value: widening is
// a 16-bit shift of its bits, which vectorizes (zero-extend, shift) in the loops below.
inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bfloat16_bits) {
  const uint32_t bits = static_cast<uint32_t>(bfloat16_bits) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// Attention of the `group` query heads of kv head `h` of sequence `s`; T is the pool's element type.
template <typename T>
void AttendOne(const Problem& p, int64_t s, int64_t h) {
  const int64_t group = p.num_q_heads / p.num_kv_heads, dim = p.head_dim, bs = p.block_size;
  const float* q = p.q + (s * p.num_q_heads + h * group) * dim;
  float* out = p.out + (s * p.num_q_heads + h * group) * dim;
  const int64_t length = std::min<int64_t>(p.lengths[s], p.pages_per_seq * bs);
  const int64_t first = p.sliding_window > 0 ? std::max<int64_t>(0, length - p.sliding_window) : 0;
  if (length <= first) {
    std::memset(out, 0, sizeof(float) * group * dim);
    return;
  }
  float max_score[kMaxGroup], denom[kMaxGroup], scores[kMaxGroup][kMaxBlockSize];
  float acc[kMaxGroup][kMaxHeadDim];
  for (int64_t g = 0; g < group; ++g) {
    max_score[g] = -std::numeric_limits<float>::infinity();
    denom[g] = 0.0f;
    std::fill(acc[g], acc[g] + dim, 0.0f);
  }
  const int64_t layer_head = (p.layer * p.num_kv_heads + h) * p.num_blocks;
  for (int64_t page_index = first / bs; page_index * bs < length; ++page_index) {
    // Out-of-range entries are clamped, as XLA clamps gather indices: a bad table never reads outside the pool.
    const int64_t block = std::clamp<int64_t>(p.block_tables[s * p.pages_per_seq + page_index], 0, p.num_blocks - 1);
    const T* keys = static_cast<const T*>(p.k_pool) + (layer_head + block) * bs * dim;
    const T* values = static_cast<const T*>(p.v_pool) + (layer_head + block) * bs * dim;
    const int64_t start = std::max<int64_t>(first - page_index * bs, 0);
    const int64_t stop = std::min<int64_t>(bs, length - page_index * bs);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * dim;
      float* score = scores[g];
      float page_max = max_score[g];
      for (int64_t t = start; t < stop; ++t) {
        const T* k = keys + t * dim;
        float dot = 0.0f;
        for (int64_t d = 0; d < dim; ++d) dot += qg[d] * ToFloat(k[d]);
        score[t] = dot * p.sm_scale;
        page_max = std::max(page_max, score[t]);
      }
      float page_sum = 0.0f;
      for (int64_t t = start; t < stop; ++t) {
        score[t] = ExpNonPositive(score[t] - page_max);  // now the softmax weight
        page_sum += score[t];
      }
      const float correction = max_score[g] == -std::numeric_limits<float>::infinity()
                                   ? 0.0f : ExpNonPositive(max_score[g] - page_max);
      denom[g] = denom[g] * correction + page_sum;
      float* a = acc[g];
      for (int64_t d = 0; d < dim; ++d) a[d] *= correction;
      for (int64_t t = start; t < stop; ++t) {
        const float weight = score[t];
        const T* v = values + t * dim;
        for (int64_t d = 0; d < dim; ++d) a[d] += weight * ToFloat(v[d]);
      }
      max_score[g] = page_max;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.0f / denom[g];
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = acc[g][d] * inv;
  }
}

// Work shared by the caller and pool tasks; kept alive by whichever finishes last.
struct SharedWork {
  Problem problem;
  void (*attend_one)(const Problem&, int64_t, int64_t);  // AttendOne<the pool's element type>
  int64_t num_items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mutex;
  std::condition_variable all_done;

  void Drain() {
    int64_t finished = 0;
    for (int64_t item = next.fetch_add(1); item < num_items; item = next.fetch_add(1)) {
      attend_one(problem, item / problem.num_kv_heads, item % problem.num_kv_heads);
      ++finished;
    }
    if (finished && done.fetch_add(finished) + finished == num_items) {
      std::lock_guard<std::mutex> lock(mutex);
      all_done.notify_all();
    }
  }
};

ffi::Error PagedDecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pool,
                                    ffi::AnyBuffer v_pool, ffi::Buffer<ffi::S32> layer,
                                    ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> lengths,
                                    ffi::ResultBuffer<ffi::F32> out, float sm_scale, int64_t sliding_window) {
  auto q_dims = q.dimensions(), pool_dims = k_pool.dimensions(), table_dims = block_tables.dimensions();
  if (q_dims.size() != 3 || pool_dims.size() != 5 || table_dims.size() != 2) {
    return ffi::Error::InvalidArgument("expected q [S, Hq, D], pools [L, Hkv, NB, BS, D], tables [S, P]");
  }
  const ffi::DataType dtype = k_pool.element_type();
  if ((dtype != ffi::F32 && dtype != ffi::BF16 && dtype != ffi::U16) || v_pool.element_type() != dtype) {
    return ffi::Error::InvalidArgument("the KV pools must both be float32 or both bfloat16 (or its uint16 bits)");
  }
  Problem p{q.typed_data(), k_pool.untyped_data(), v_pool.untyped_data(), block_tables.typed_data(),
            lengths.typed_data(), out->typed_data(), layer.typed_data()[0], q_dims[0], q_dims[1], pool_dims[1],
            pool_dims[2], pool_dims[3], pool_dims[4], table_dims[1], sliding_window, sm_scale};
  if (p.num_kv_heads == 0 || p.num_q_heads % p.num_kv_heads != 0 || p.num_q_heads / p.num_kv_heads > kMaxGroup ||
      p.head_dim > kMaxHeadDim || p.block_size > kMaxBlockSize || q_dims[2] != p.head_dim) {
    return ffi::Error::InvalidArgument("unsupported head layout for the CPU paged decode attention");
  }
  if (p.layer < 0 || p.layer >= pool_dims[0]) return ffi::Error::InvalidArgument("layer out of range");
  auto work = std::make_shared<SharedWork>();
  work->problem = p;
  work->attend_one = dtype == ffi::F32 ? &AttendOne<float> : &AttendOne<uint16_t>;
  work->num_items = p.num_seqs * p.num_kv_heads;
  if (work->num_items == 0) return ffi::Error::Success();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->num_items - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  std::unique_lock<std::mutex> lock(work->mutex);
  work->all_done.wait(lock, [&] { return work->done.load() == work->num_items; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedDecodeAttention, PagedDecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_pool: F32, BF16 or U16 (bf16 bits)
                                  .Arg<ffi::AnyBuffer>()         // v_pool: the same
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window"));
