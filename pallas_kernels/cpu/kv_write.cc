// Writes a step's new keys and values into their slots of the paged pool, in place, as an XLA FFI call.
//
// Why: XLA's CPU backend has no bfloat16 or float16 scatter. It converts the whole operand to float32,
// scatters and converts back, so writing 16 tokens into a bf16 pool cost two passes over the pool per layer
// (95 ms a step for the 30M benchmark model's 8 layers against 10 us in float32), and moving the bits as
// uint16 instead still copied the pool (the bitcast is materialised). This call copies each (token, KV head)
// row of D elements straight to its slot, whatever the dtype, in a pool XLA hands over aliased.
//
// Contract (same as write_kv_to_cache in reference.py):
//   k_cache, v_cache  [L, Hkv, NB, bs, D]  any 1-, 2- or 4-byte dtype; aliased to the two results
//   layer             int32 []             the layer to write
//   k, v              [T, Hkv, D]          the pool's dtype
//   slot_mapping      int32 [T]            block * bs + offset; slots outside [0, NB * bs) are skipped
//   results           the updated k_cache, v_cache (the same buffers)
//
// Whole blocks move the same way (BlockMover in paged/runner.py: copy-on-write and swap-in), which XLA would
// also run through float32 copies of the pool (an OOM for a pool that fills host memory):
//   CopyBlocksCpu:    k_cache, v_cache, src int32 [n], dst int32 [n]: block src[i] -> dst[i] in every layer
//                     and head; no destination may be another pair's source (copy-on-write never does that).
//   ScatterBlocksCpu: k_cache, v_cache, k_data, v_data [L, Hkv, n, bs, D], dst int32 [n]: data block i ->
//                     dst[i].
// Block ids outside [0, NB) are skipped.

#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The result buffer for `pool`: the pool itself when aliased (always, from jax), else a filled copy.
char* result_pool(const ffi::AnyBuffer& pool, ffi::Result<ffi::AnyBuffer>& out) {
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != pool.untyped_data()) std::memcpy(dst, pool.untyped_data(), pool.size_bytes());
  return dst;
}

bool same_dims(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  const auto ad = a.dimensions(), bd = b.dimensions();
  if (ad.size() != bd.size()) return false;
  for (size_t i = 0; i < ad.size(); ++i)
    if (ad[i] != bd[i]) return false;
  return true;
}

ffi::Error WriteKvImpl(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> layer,
                       ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slot_mapping,
                       ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  const auto pd = k_cache.dimensions();
  const auto nd = k.dimensions();
  if (pd.size() != 5 || nd.size() != 3 || !same_dims(k_cache, v_cache) || !same_dims(k, v))
    return ffi::Error::InvalidArgument("write_kv_cpu: expected two equal pools [L, Hkv, NB, bs, D] and new k, v [T, Hkv, D]");
  const int64_t L = pd[0], H = pd[1], NB = pd[2], bs = pd[3], D = pd[4], T = nd[0];
  if (nd[1] != H || nd[2] != D || slot_mapping.element_count() != T)
    return ffi::Error::InvalidArgument("write_kv_cpu: k, v [T, Hkv, D] and slot_mapping [T] must fit the pool");
  if (k.element_type() != k_cache.element_type() || v.element_type() != v_cache.element_type())
    return ffi::Error::InvalidArgument("write_kv_cpu: new keys and values must have the pool's dtype");
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("write_kv_cpu: layer index out of range");
  const int32_t* slots = slot_mapping.typed_data();
  struct Pair {
    const ffi::AnyBuffer& pool;
    const ffi::AnyBuffer& rows;
    ffi::Result<ffi::AnyBuffer>& out;
  };
  for (const Pair& p : {Pair{k_cache, k, k_out}, Pair{v_cache, v, v_out}}) {
    char* dst = result_pool(p.pool, p.out);
    const int64_t row_bytes = D * static_cast<int64_t>(p.pool.size_bytes() / p.pool.element_count());
    const char* src = static_cast<const char*>(p.rows.untyped_data());
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0 || slot >= NB * bs) continue;
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(dst + (((l * H + h) * NB) * bs + slot) * row_bytes, src + (t * H + h) * row_bytes, row_bytes);
    }
  }
  return ffi::Error::Success();
}

// Copies n blocks into `pool`'s blocks dst[i] (all layers and heads) from block src_ids[i] of `source`,
// whose third dimension has source_blocks blocks (the pool itself, or swapped-in data).
void move_blocks(const ffi::AnyBuffer& pool, char* out, const char* source, int64_t source_blocks,
                 const int32_t* src_ids, const int32_t* dst_ids, int64_t n) {
  const auto pd = pool.dimensions();
  const int64_t LH = pd[0] * pd[1], NB = pd[2];
  const int64_t block_bytes = static_cast<int64_t>(pool.size_bytes()) / (LH * NB);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t src = src_ids ? src_ids[i] : i, dst = dst_ids[i];
    if (src < 0 || src >= source_blocks || dst < 0 || dst >= NB) continue;
    if (source == out && src == dst) continue;
    for (int64_t lh = 0; lh < LH; ++lh)
      std::memcpy(out + (lh * NB + dst) * block_bytes, source + (lh * source_blocks + src) * block_bytes,
                  block_bytes);
  }
}

ffi::Error CopyBlocksImpl(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> src,
                          ffi::Buffer<ffi::S32> dst, ffi::Result<ffi::AnyBuffer> k_out,
                          ffi::Result<ffi::AnyBuffer> v_out) {
  if (k_cache.dimensions().size() != 5 || !same_dims(k_cache, v_cache) || src.element_count() != dst.element_count())
    return ffi::Error::InvalidArgument("copy_blocks_cpu: expected two equal pools [L, Hkv, NB, bs, D] and src, dst [n]");
  const int64_t NB = k_cache.dimensions()[2];
  for (auto [pool, out] : {std::pair{&k_cache, &k_out}, std::pair{&v_cache, &v_out}}) {
    char* o = result_pool(*pool, *out);
    move_blocks(*pool, o, o, NB, src.typed_data(), dst.typed_data(), dst.element_count());
  }
  return ffi::Error::Success();
}

ffi::Error ScatterBlocksImpl(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer k_data,
                             ffi::AnyBuffer v_data, ffi::Buffer<ffi::S32> dst, ffi::Result<ffi::AnyBuffer> k_out,
                             ffi::Result<ffi::AnyBuffer> v_out) {
  const auto pd = k_cache.dimensions(), dd = k_data.dimensions();
  if (pd.size() != 5 || !same_dims(k_cache, v_cache) || !same_dims(k_data, v_data) || dd.size() != 5 ||
      dd[0] != pd[0] || dd[1] != pd[1] || dd[2] != dst.element_count() || dd[3] != pd[3] || dd[4] != pd[4] ||
      k_data.element_type() != k_cache.element_type() || v_data.element_type() != v_cache.element_type())
    return ffi::Error::InvalidArgument(
        "scatter_blocks_cpu: expected pools [L, Hkv, NB, bs, D], data [L, Hkv, n, bs, D] of their dtype, dst [n]");
  for (auto [pool, data, out] : {std::tuple{&k_cache, &k_data, &k_out}, std::tuple{&v_cache, &v_data, &v_out}}) {
    char* o = result_pool(*pool, *out);
    move_blocks(*pool, o, static_cast<const char*>(data->untyped_data()), dd[2], nullptr, dst.typed_data(),
                dst.element_count());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CopyBlocksCpu, CopyBlocksImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScatterBlocksCpu, ScatterBlocksImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(WriteKvCpu, WriteKvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
