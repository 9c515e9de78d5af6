// The step's new K/V rows written into one layer of the stacked KV pool, in place, as an XLA FFI custom call.
//
// A pool is [layers, kv_heads, slots..., row] in any element type: what follows the kv heads is a run of
// slots (a block's tokens, block after block) of `row` elements each. Row n of the new values [N, kv_heads,
// row] goes to slot slots[n] of layer `layer`, for every kv head; a slot outside the pool (padding tokens
// map past its end) is skipped. The results alias the pools (input_output_aliases), so XLA hands the same
// buffers in and out and the write touches only the written rows.
//
// Why not XLA's scatter: XLA:CPU compiles each scatter (and the index fusion feeding it) into a kernel of its
// own, and an unrolled model has two per layer that differ only in the layer number: 60 of the embedded
// model's step's 145 compiled kernels, most of its compile time. A custom call compiles nothing.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct PoolShape {
  int64_t num_layers, num_heads, num_slots, row_bytes;
};

// The pool's [layers, heads, slots, row] view for rows of `row_elements` elements, or an error.
ffi::Error ViewPool(const ffi::AnyBuffer& pool, int64_t row_elements, PoolShape* shape) {
  const auto dims = pool.dimensions();
  if (dims.size() < 3 || dims[0] * dims[1] == 0 || row_elements <= 0) {
    return ffi::Error::InvalidArgument("expected a pool [L, Hkv, ...] and rows of at least one element");
  }
  const int64_t per_head = static_cast<int64_t>(pool.element_count()) / (dims[0] * dims[1]);
  if (per_head % row_elements != 0) {
    return ffi::Error::InvalidArgument("the pool's slots are not whole rows of the new values");
  }
  const int64_t element_bytes = static_cast<int64_t>(ffi::ByteWidth(pool.element_type()));
  *shape = {dims[0], dims[1], per_head / row_elements, row_elements * element_bytes};
  return ffi::Error::Success();
}

void WriteRows(const PoolShape& shape, int64_t layer, const int32_t* slots, int64_t num_rows, const char* rows,
               char* pool) {
  const int64_t head_bytes = shape.num_slots * shape.row_bytes;
  char* layer_start = pool + layer * shape.num_heads * head_bytes;
  for (int64_t n = 0; n < num_rows; ++n) {
    const int64_t slot = slots[n];
    if (slot < 0 || slot >= shape.num_slots) continue;  // padding
    for (int64_t h = 0; h < shape.num_heads; ++h) {
      std::memcpy(layer_start + h * head_bytes + slot * shape.row_bytes,
                  rows + (n * shape.num_heads + h) * shape.row_bytes, shape.row_bytes);
    }
  }
}

ffi::Error KvWriteImpl(ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool, ffi::AnyBuffer k_rows, ffi::AnyBuffer v_rows,
                       ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> k_out,
                       ffi::Result<ffi::AnyBuffer> v_out) {
  const auto row_dims = k_rows.dimensions();
  if (row_dims.size() != 3 || slots.element_count() != row_dims[0] || layer.element_count() != 1) {
    return ffi::Error::InvalidArgument("expected rows [N, Hkv, row], slots [N] and one layer");
  }
  if (k_pool.element_type() != k_rows.element_type() || v_pool.element_type() != v_rows.element_type() ||
      k_pool.element_count() != v_pool.element_count() || k_rows.element_count() != v_rows.element_count()) {
    return ffi::Error::InvalidArgument("K and V must match: pools alike, rows alike, each rows of its pool's type");
  }
  PoolShape k_shape, v_shape;
  if (ffi::Error error = ViewPool(k_pool, row_dims[2], &k_shape); error.failure()) return error;
  if (ffi::Error error = ViewPool(v_pool, row_dims[2], &v_shape); error.failure()) return error;
  const int64_t target = layer.typed_data()[0];
  if (k_shape.num_heads != row_dims[1] || target < 0 || target >= k_shape.num_layers) {
    return ffi::Error::InvalidArgument("the rows' kv heads or the layer do not fit the pool");
  }
  if (k_out->untyped_data() != k_pool.untyped_data() || v_out->untyped_data() != v_pool.untyped_data()) {
    return ffi::Error::Internal("the written pools must alias the input pools");
  }
  WriteRows(k_shape, target, slots.typed_data(), row_dims[0], static_cast<const char*>(k_rows.untyped_data()),
            static_cast<char*>(k_out->untyped_data()));
  WriteRows(v_shape, target, slots.typed_data(), row_dims[0], static_cast<const char*>(v_rows.untyped_data()),
            static_cast<char*>(v_out->untyped_data()));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvWrite, KvWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // k_pool [L, Hkv, ...]
                                  .Arg<ffi::AnyBuffer>()         // v_pool: as k_pool
                                  .Arg<ffi::AnyBuffer>()         // k_rows [N, Hkv, row], k_pool's type
                                  .Arg<ffi::AnyBuffer>()         // v_rows: as k_rows
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [N]: past the pool is skipped
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Ret<ffi::AnyBuffer>()         // k_pool, aliased
                                  .Ret<ffi::AnyBuffer>());       // v_pool, aliased
