// What the AMX int8-tile kernels share (amx_int8.cc, amx_int4.cc, amx_widened.cc): bfloat16 x written as int8
// digits for weight-only products, int4 nibbles split into bytes, silu, and the prefetches. Included only where
// AMX-INT8 and AVX-512 BF16 are built (PAGED_AMX and __AMX_INT8__).
//
// Weight-only int8 and int4 codes are small integers; x is not. Rather than widen every code to bfloat16 (which
// costs about what the codes' smaller bytes save), each row of x is written as kDigits rows of int8 digits,
// x ~ sum_d digit_d * scale_d with scale_1 = max|x| / 127 and scale_{d+1} = scale_d / 254 (what digit d leaves
// is about half of scale_d at most, so the next digit stays within +-127). The digits multiply the codes as
// stored on the int8 tiles, and the epilogue sums the digits' int32 sums times their scales in float32. Four
// digits put x on a grid of max|x| / (127 * 254^3), about 2^-31 of the row's largest value: finer than
// float32's rounding of the sums, so the result is the float product's to float32 accuracy. The price is tile
// work: kDigits A rows per row of x.
#pragma once

#include <cfloat>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#include "bf16.h"
#include "row_codes.h"
#include "vector_math.h"

namespace paged::amx {

constexpr int64_t kDigits = 4;
// The most rows of x a weight-only int8 call writes as digits: beyond, four digit rows per row of x cost more
// tile work than the bf16 tiles against widened codes. (int4 writes digits up to 4 rows: amx_int4.cc.)
constexpr int64_t kDigitRows = 16;

// Row x (K bfloat16) as kDigits rows of codes at `codes` (lda bytes apart, zeros from K to lda) and their
// scales; x_sum: its float32 sum. Digits whose scale would leave float32's normal range stay zero.
inline void digit_row(const uint16_t* x, int64_t K, int64_t lda, int8_t* codes, float* scales, float& x_sum) {
  __m512 peak = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 v = load_bf16x16(x + k, lanes16(K, k));
    peak = _mm512_max_ps(peak, _mm512_abs_ps(v));
    sum = _mm512_add_ps(sum, v);
  }
  x_sum = _mm512_reduce_add_ps(sum);
  std::memset(codes, 0, kDigits * lda);
  int digits = 0;
  for (float scale = _mm512_reduce_max_ps(peak) / 127.0f; digits < kDigits && scale >= FLT_MIN; scale /= 254.0f)
    scales[digits++] = scale;
  for (int d = digits; d < kDigits; ++d) scales[d] = 0.0f;
  // Each digit multiplies by its scale's reciprocal instead of dividing (a division is ~10 cycles a vector, and
  // the digits are written before any product starts): where that rounds a half-way point the other way, what
  // the digit leaves is a few last places over half its scale, which the next digit (a little over 127 of its
  // own scale, so 127) still takes, and the last digit's share is below the grid anyway.
  __m512 scale[kDigits], inverse[kDigits];
  for (int d = 0; d < digits; ++d) scale[d] = _mm512_set1_ps(scales[d]), inverse[d] = _mm512_set1_ps(1.0f / scales[d]);
  const __m512 low = _mm512_set1_ps(-127.0f), high = _mm512_set1_ps(127.0f);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 lanes = lanes16(K, k);
    __m512 rest = load_bf16x16(x + k, lanes);
    for (int d = 0; d < digits; ++d) {
      const __m512 q = _mm512_min_ps(
          high, _mm512_max_ps(low, _mm512_roundscale_ps(_mm512_mul_ps(rest, inverse[d]),
                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      _mm_mask_storeu_epi8(codes + d * lda + k, lanes, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(q)));
      rest = _mm512_fnmadd_ps(q, scale[d], rest);
    }
  }
}

// 16 columns of one row of x's product: the int32 sums of its kDigits digit rows (the first at `first`, the
// next `stride` int32 on) times their scales, smallest first.
inline __m512 combine_digits(const int32_t* first, int64_t stride, const float* scales) {
  __m512 value = _mm512_setzero_ps();
  for (int64_t d = kDigits - 1; d >= 0; --d)
    value = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(first + d * stride)), _mm512_set1_ps(scales[d]),
                            value);
  return value;
}

// An int4 step's nibbles (2 KB: byte j holds code j low and code j + 2048 high; pack_int4_for_amx) into its
// 4 KB of codes (0..15), the int8 tiles' step.
inline void split_nibbles(const uint8_t* nibbles, int8_t* codes) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t j = 0; j < 2048; j += 64) {
    const __m512i v = _mm512_loadu_si512(nibbles + j);
    _mm512_store_si512(codes + j, _mm512_and_si512(v, low));
    _mm512_store_si512(codes + 2048 + j, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
  }
}

// Streaming the weights, the L2 hardware prefetcher stops at each 4 KB page (amx.cc: start_page_stream):
// four lines of the page at or after p, into L2.
inline void start_page_stream(const void* p) {
  const char* page = reinterpret_cast<const char*>((reinterpret_cast<uintptr_t>(p) + 4095) & ~uintptr_t(4095));
  for (int line = 0; line < 4; ++line) _mm_prefetch(page + 64 * line, _MM_HINT_T1);
}

// Every line of [p, p + bytes) requested into L2: the next panel's step, while this panel's is worked on.
inline void prefetch_into_l2(const void* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(static_cast<const char*>(p) + line, _MM_HINT_T1);
}

// The same into L1: lines a step or two ahead of the loads that read them.
inline void prefetch_into_l1(const void* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(static_cast<const char*>(p) + line, _MM_HINT_T0);
}

}  // namespace paged::amx
