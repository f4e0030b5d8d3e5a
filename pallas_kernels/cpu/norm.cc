// The residual add and RMSNorm between a decoder layer's blocks as an XLA FFI call, bfloat16 in and out.
//
// Why: XLA's CPU code ran them as three fusions with float32 round trips through memory (the sum, its mean
// square, the scaled product): about 38 us a norm in a 32-row decode step of the 0.5B shape and 300 us in a
// 500-token prompt step, 3% and 6% of those steps. Here each row is one pass in registers: 24 chained norms
// with the converts around them, 21.8 -> 14.5 us a norm at 32 rows, 214 -> 137 us at 500 (memory-bound).
//
// Contract (models.layers.RMSNorm with a residual):
//   h       [T, D] bfloat16   the residual stream
//   delta   [T, D] bfloat16   what the block before adds to it
//   scale   [D]    bfloat16   the norm's weight
//   attrs: eps (f32)
//   sum     [T, D] bfloat16   bf16(s), s = h + delta in float32: the residual stream after the add
//   normed  [T, D] bfloat16   bf16(scale * bf16(s * rsqrt(mean(s^2) + eps))), float32 inside
// The norm reads the float32 sum before its rounding, as vLLM's fused_add_rms_norm and XLA's fusion of the
// jnp code (which drops the bfloat16 round trip) do; transformers rounds it first. The mean square sums 16
// lanes at a time, then across them: XLA's order differs, so a product within a float32 ulp of a bfloat16
// rounding boundary may round the other way (one bfloat16 ulp).

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One row: s = h + delta in float32, sum = bf16(s), normed = bf16(scale * bf16(s * rsqrt(mean(s^2) + eps))).
void add_rms_norm_row(const uint16_t* h, const uint16_t* delta, const uint16_t* scale, float eps, int64_t D,
                      uint16_t* sum, uint16_t* normed) {
  int64_t i = 0;
  float squares = 0.0f;
#if defined(__AVX512F__)
  __m512 lanes = _mm512_setzero_ps();
  for (; i + 16 <= D; i += 16) {
    const __m512 s = _mm512_add_ps(paged::load_bf16x16(h + i), paged::load_bf16x16(delta + i));
    paged::store_bf16x16(sum + i, s);
    lanes = _mm512_fmadd_ps(s, s, lanes);
  }
  squares = _mm512_reduce_add_ps(lanes);
#endif
  for (int64_t j = i; j < D; ++j) {
    const float s = paged::bf16_to_float(h[j]) + paged::bf16_to_float(delta[j]);
    sum[j] = paged::float_to_bf16(s);
    squares += s * s;
  }
  const float inv = 1.0f / std::sqrt(squares / static_cast<float>(D) + eps);
  i = 0;
#if defined(__AVX512F__)
  const __m512 inv16 = _mm512_set1_ps(inv);
  for (; i + 16 <= D; i += 16) {
    const __m512 n = paged::round_bf16x16(
        _mm512_mul_ps(_mm512_add_ps(paged::load_bf16x16(h + i), paged::load_bf16x16(delta + i)), inv16));
    paged::store_bf16x16(normed + i, _mm512_mul_ps(paged::load_bf16x16(scale + i), n));
  }
#endif
  for (; i < D; ++i) {
    const float s = paged::bf16_to_float(h[i]) + paged::bf16_to_float(delta[i]);
    const float n = paged::bf16_to_float(paged::float_to_bf16(s * inv));
    normed[i] = paged::float_to_bf16(paged::bf16_to_float(scale[i]) * n);
  }
}

// Rows per work item: a decode step's 32 rows take less time on one thread than waking a helper from XLA's
// pool (50-80 us, docs/performance.md), so only larger steps are split.
constexpr int64_t kRowsPerItem = 64;

ffi::Error AddRmsNormImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> delta,
                          ffi::Buffer<ffi::BF16> scale, float eps, ffi::ResultBuffer<ffi::BF16> sum,
                          ffi::ResultBuffer<ffi::BF16> normed) {
  const auto hd = h.dimensions();
  const auto dd = delta.dimensions();
  if (hd.size() != 2 || dd.size() != 2 || hd[0] != dd[0] || hd[1] != dd[1] || scale.element_count() != hd[1])
    return ffi::Error::InvalidArgument("add_rms_norm_cpu: expected h and delta [T, D] and scale [D]");
  if (!(eps >= 0.0f))
    return ffi::Error::InvalidArgument("add_rms_norm_cpu: eps must be a number >= 0");
  const int64_t T = hd[0], D = hd[1];
  const auto* hp = reinterpret_cast<const uint16_t*>(h.untyped_data());
  const auto* dp = reinterpret_cast<const uint16_t*>(delta.untyped_data());
  const auto* sp = reinterpret_cast<const uint16_t*>(scale.untyped_data());
  auto* sum_p = reinterpret_cast<uint16_t*>(sum->untyped_data());
  auto* norm_p = reinterpret_cast<uint16_t*>(normed->untyped_data());
  const int64_t items = (T + kRowsPerItem - 1) / kRowsPerItem;
  paged::run_parallel(&pool, items, 1, items - 1, [&](int64_t item) {
    for (int64_t t = item * kRowsPerItem; t < std::min(T, (item + 1) * kRowsPerItem); ++t)
      add_rms_norm_row(hp + t * D, dp + t * D, sp, eps, D, sum_p + t * D, norm_p + t * D);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AddRmsNormCpu, AddRmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
