// Int8 codes on Intel AMX tiles: W8A8 (below), and weight-only int8 at decode sizes with x as int8 digits
// (amx_digits.h). Prompt-sized weight-only steps widen the codes to bfloat16 (amx_widened.cc); the walk both
// files use is amx_int8_walk.h.
//
// W8A8 on Intel AMX tiles: y[M, N] = (xq @ wq) * x_scale[m] * w_scale[n] (- zero points) (+ bias), with x
// quantized per row inside the call, int8 codes on both sides and exact int32 sums (amx.h: W8A8MatmulPacked;
// int8_matmul.cc binds it as XLA FFI calls); gated, silu of that times the up projection's, so that neither
// product reaches memory in float32 and no separate pass applies the activation (XLA's bfloat16 silu * up
// over [2048, 4864] took 27 ms, about what the two products take on the tiles).
//
// Why: TDPBSSD multiplies a 16 x 64 int8 tile by a 64 x 16 one into 16 x 16 int32 sums in the time TDPBF16PS
// takes for half the depth: twice the multiply-adds of the bfloat16 tiles (amx.cc) for the same bytes moved,
// and the weights are half bfloat16's bytes, which is what a decode step waits for. Quantizing x here
// instead of in XLA matters as much: XLA's per-row quantization (models/quantization.py: activation_codes,
// whose true divisions it must not fold) makes several passes over a float32 copy of x, which at prompt sizes
// cost about what the product itself does.
//
// x's codes are exactly activation_codes': scale = max|x| / 127.5 (float32 machine epsilon where x is all
// zeros), code = clip(round_half_even(x / scale), -128, 127), with true float32 divisions. They go straight
// into the A tiles' order, [M / 32][32 rows][K / 64 steps][64], zero-padded; the weights come packed at load
// (pallas_kernels/cpu: pack_for_amx of int8 codes), [N / 64][K / 64][4 tiles][16 quads][16 n][4]: byte (p, s, t, r, c, e)
// is w[64 s + 4 r + e, 64 p + 16 t + c], so each step of a panel is 4 KB contiguous and the C tiles' columns
// come out in order.
//
// Walk: each thread takes a contiguous run of 64-column panels. Up to 16 rows, one A tile meets each panel's
// four B tiles as they stream from memory. Larger steps take a pass of panels whose whole K fits kPassBytes
// (L2), then every 32-row block against each panel of it: the panels stream from memory for the first block
// and come from L2 after, and a 32 x 64 block of y is summed in the tiles from the first step to the last (no
// partial sums in memory; the tile stores, which stall the tile loads after them, come once per block).

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "amx_tiles.h"
#include "parallel.h"
#include "row_codes.h"

#if defined(PAGED_AMX) && defined(__AMX_INT8__)
#include "amx_digits.h"
#include "amx_int8_walk.h"
#endif

namespace paged::amx {

#if defined(PAGED_AMX) && defined(__AMX_INT8__)
namespace {

// y's rows [m0, m0 + rows) x the 64 columns from n0, from a block's int32 sums (and, gated, up's: silu(w's
// values) * up's). The scales of the last 64 columns are kept: int8_panels calls this a row at a time.
class FinishBlock {
 public:
  FinishBlock(const W8A8Call& call, const float* x_scale, const int32_t* code_sums)
      : call_(call), x_scale_(x_scale), code_sums_(code_sums) {}

  void operator()(const int32_t* sums, const int32_t* up_sums, int64_t m0, int64_t rows, int64_t n0) const {
    if (n0 != n0_) {
      w_ = BlockScales(call_.w, n0);
      if (call_.up) up_ = BlockScales(*call_.up, n0);
      n0_ = n0;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t m = m0 + r;
      const __m512 row_scale = _mm512_set1_ps(x_scale_[m]);
      const __m512 row_sum = _mm512_set1_ps(static_cast<float>(code_sums_[m]) * x_scale_[m]);
      for (int v = 0; v < 4; ++v) {
        __m512 out = w_.value(sums, r, v, row_scale, row_sum);
        if (call_.up) out = _mm512_mul_ps(silu512(out), up_.value(up_sums, r, v, row_scale, row_sum));
        if (call_.y_bf16) {
          store_product_bf16x16(static_cast<uint16_t*>(call_.y) + m * call_.N + n0 + 16 * v, out);
        } else {
          _mm512_storeu_ps(static_cast<float*>(call_.y) + m * call_.N + n0 + 16 * v, out);
        }
      }
    }
  }

 private:
  const W8A8Call& call_;
  const float* x_scale_;
  const int32_t* code_sums_;
  mutable int64_t n0_ = -1;
  mutable BlockScales w_, up_;
};

// Panels [p_begin, p_end) of a W8A8 call, x's codes one row per row of x.
void w8a8_panels(const W8A8Call& call, const int8_t* codes, const float* x_scale, const int32_t* code_sums,
                 int64_t p_begin, int64_t p_end) {
  int8_panels(call.w.packed, call.up ? call.up->packed : nullptr, call.M, call.K, codes, p_begin, p_end,
              FinishBlock(call, x_scale, code_sums), /*rowwise=*/true);
}

#if defined(__AVX512BF16__)
// ---- weight-only int8 at decode sizes: x as int8 digits against the codes as they are ---------------------
//
// Up to kDigitRows rows, x goes in as int8 digits (amx_digits.h) and meets the codes on the int8 tiles, W8A8's
// walk with kDigits rows of codes per row of x. Four digit rows fill a 16-row A tile with four rows of x, and a
// 32-row block with eight: up to 4 rows of x the tile work is W8A8's one A tile; at 16, 64 digit rows, the int8
// tiles take about as long as bf16's (paged bench matmul, docs/kernels.md), still ahead of widening the codes.

// A block's rows [r0, r0 + rows) of digit sums (kDigits per row of x) into y's rows from r0 / kDigits.
void finish_digit_block(const Int8WeightsCall& call, const int32_t* sums, const int32_t* up_sums, int64_t r0,
                        int64_t rows, int64_t n0, const float* scales, const float* x_sums) {
  alignas(64) float values[kRows / kDigits * kPanel], up_values[kRows / kDigits * kPanel];
  const int64_t m0 = r0 / kDigits, count = rows / kDigits;
  auto combine = [&](const int32_t* block, float* out) {
    for (int64_t i = 0; i < count; ++i)
      for (int v = 0; v < 4; ++v)
        _mm512_store_ps(out + i * 64 + 16 * v,
                        combine_digits(block + i * kDigits * 64 + 16 * v, 64, scales + (m0 + i) * kDigits));
  };
  combine(sums, values);
  if (call.up) combine(up_sums, up_values);
  finish_weights_block(call, values, up_values, m0, count, n0, x_sums);
}

// Decode-sized calls (M <= kDigitRows): false if the digits could not be allocated.
bool int8_weights_by_digits(xla::ffi::ThreadPool& pool, const Int8WeightsCall& call) {
  const int64_t lda = (call.K + kDepth - 1) / kDepth * kDepth, rows = kDigits * call.M;
  const int64_t padded_rows = (rows + kRows - 1) / kRows * kRows;
  thread_local TileVector<int8_t> codes;
  thread_local TileVector<float> scales, x_sums;
  try {
    if (codes.size() < static_cast<size_t>(padded_rows * lda)) codes.resize(padded_rows * lda);
    if (x_sums.size() < static_cast<size_t>(call.M)) x_sums.resize(call.M), scales.resize(kDigits * call.M);
  } catch (const std::bad_alloc&) {
    return false;
  }
  int8_t* cp = codes.data();
  float *scale_p = scales.data(), *sum_p = x_sums.data();
  std::memset(cp + rows * lda, 0, (padded_rows - rows) * lda);
  // Rows of digits on both threads, 8 at a time (amx_int4.cc's split): at 16 rows of K = 4,864 they took
  // 45-55 us on the calling thread alone, before any product.
  run_parallel(&pool, call.M, 8, call.M / 8, [&](int64_t m) {
    digit_row(call.x + m * call.K, call.K, lda, cp + kDigits * m * lda, scale_p + kDigits * m, sum_p[m]);
  });
  const int64_t num_panels = call.N / kPanel, parts = std::min(num_panels, std::max<int64_t>(1, pool.num_threads()));
  run_parallel(&pool, parts, 1, parts - 1, [&](int64_t part) {
    int8_panels(call.w.packed, call.up ? call.up->packed : nullptr, rows, call.K, cp, part * num_panels / parts,
                (part + 1) * num_panels / parts,
                [&](const int32_t* sums, const int32_t* up_sums, int64_t r0, int64_t block_rows, int64_t n0) {
                  finish_digit_block(call, sums, up_sums, r0, block_rows, n0, scale_p, sum_p);
                });
  });
  return true;
}
#endif

}  // namespace

bool Int8WeightsMatmulPacked(xla::ffi::ThreadPool& pool, const Int8WeightsCall& call) {
#if defined(__AVX512BF16__)
  if (!Available()) return false;
  return call.M <= kDigitRows ? int8_weights_by_digits(pool, call) : Int8WeightsWidenedMatmulPacked(pool, call);
#else
  (void)pool, (void)call;
  return false;
#endif
}

bool W8A8MatmulPacked(xla::ffi::ThreadPool& pool, const W8A8Call& call) {
  if (!Available()) return false;
  const int64_t steps = (call.K + kDepth - 1) / kDepth, lda = steps * kDepth;
  const int64_t padded_rows = (call.M + kRows - 1) / kRows * kRows;
  // x's codes and scales, kept from call to call (amx.cc's x tiles: fresh pages for every prompt step cost
  // more than filling them).
  thread_local TileVector<int8_t> codes;
  thread_local TileVector<float> x_scale;
  thread_local TileVector<int32_t> code_sums;
  try {
    if (codes.size() < static_cast<size_t>(padded_rows * lda)) codes.resize(padded_rows * lda);
    if (x_scale.size() < static_cast<size_t>(call.M)) x_scale.resize(call.M), code_sums.resize(call.M);
  } catch (const std::bad_alloc&) {
    return false;
  }
  int8_t* cp = codes.data();
  float* sp = x_scale.data();
  int32_t* sum_p = code_sums.data();
  std::memset(cp + call.M * lda, 0, (padded_rows - call.M) * lda);
  run_parallel(&pool, call.M, 8, call.M / 8, [&](int64_t m) {
    sp[m] = call.x_bf16
                ? quantize_row(static_cast<const uint16_t*>(call.x) + m * call.K, call.K, lda, cp + m * lda, sum_p[m])
                : quantize_row(static_cast<const float*>(call.x) + m * call.K, call.K, lda, cp + m * lda, sum_p[m]);
  });
  const int64_t num_panels = call.N / kPanel, parts = std::min(num_panels, std::max<int64_t>(1, pool.num_threads()));
  run_parallel(&pool, parts, 1, parts - 1, [&](int64_t part) {
    w8a8_panels(call, cp, sp, sum_p, part * num_panels / parts, (part + 1) * num_panels / parts);
  });
  return true;
}

#else

bool W8A8MatmulPacked(xla::ffi::ThreadPool&, const W8A8Call&) { return false; }

bool Int8WeightsMatmulPacked(xla::ffi::ThreadPool&, const Int8WeightsCall&) { return false; }

#endif

}  // namespace paged::amx
