// Per-row int8 quantization of activations for the W8A8 kernels (amx_int8.cc on AMX tiles, int8_matmul.cc with
// AVX-512 VNNI): codes exactly models/quantization.py's activation_codes(x, "int8"), scale = max|x| / 127.5
// (float32 machine epsilon where the row is all zeros), code = clip(round_half_even(x / scale), -128, 127), with
// true float32 divisions. Quantizing in the call instead of in XLA matters: XLA's version (whose true divisions
// it must not fold) makes several passes over a float32 copy of x, which at prompt sizes cost a sizeable part of
// what the product itself does.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"

namespace paged {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The lanes of 16 values from k that are in a row of K.
inline __mmask16 lanes16(int64_t K, int64_t k) {
  return K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (K - k)) - 1);
}

// max|x| over a row of K values. bfloat16 takes the bits as they are: with the sign cleared, a larger
// magnitude is a larger 16-bit integer, so 32 values go in one unsigned max (a NaN's bits top them all, as
// they would make the float maximum NaN), and only the widest is widened.
inline float row_peak(const float* x, int64_t K) {
  __m512 peak = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16)
    peak = _mm512_max_ps(peak, _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes16(K, k), x + k)));
  return _mm512_reduce_max_ps(peak);
}

inline float row_peak(const uint16_t* x, int64_t K) {
  const __m512i magnitude = _mm512_set1_epi16(0x7fff);
  __m512i peak = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 lanes = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    peak = _mm512_max_epu16(peak, _mm512_and_si512(_mm512_maskz_loadu_epi16(lanes, x + k), magnitude));
  }
  // The widest of 32 lanes: as 16 lanes of two halves each, then the larger half.
  const __m512i halves =
      _mm512_max_epu32(_mm512_and_si512(peak, _mm512_set1_epi32(0xffff)), _mm512_srli_epi32(peak, 16));
  const uint32_t bits = static_cast<uint32_t>(_mm512_reduce_max_epu32(halves)) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// Row m of x (K values, float32 or bfloat16) into `codes` (padded to steps * 64 with zeros); returns
// the row's scale and sets `code_sum` to the sum of its codes.
//
// The codes must be activation_codes' own, which divides: x * (1 / scale) alone can differ from x / scale in
// the last place and so move a code at a half-way point (random normal bfloat16 rows of 896: 3 codes in
// 10,000). A division is ~10 cycles a vector, most of the quantization's time, so bfloat16 rows divide as
// Markstein does: q = x * r (r = 1 / scale, rounded once), then q + (x - q * scale) * r with both steps fused
// multiply-adds, which is the correctly rounded x / scale where the remainder is exact. It was checked against
// the division for every bfloat16 x at every scale in [2^-90, 2^100] that a bfloat16 row can have (peak /
// 127.5 for each bfloat16 peak), and at random scales there: 2.4e9 quotients, no code differs. Outside that
// range (remainders that could leave float32's normal range) and for float32 rows, which were not checked
// that way, x / scale.
template <typename T>
float quantize_row(const T* x, int64_t K, int64_t padded, int8_t* codes, int32_t& code_sum) {
  auto load = [&](int64_t k, __mmask16 lanes) -> __m512 {
    if constexpr (sizeof(T) == 4) {
      return _mm512_maskz_loadu_ps(lanes, x + k);
    } else {
      return load_bf16x16(x + k, lanes);
    }
  };
  float scale = row_peak(x, K) / 127.5f;
  if (scale == 0.0f) scale = FLT_EPSILON;
  const bool by_reciprocal = sizeof(T) == 2 && scale >= 0x1p-90f && scale <= 0x1p100f;
  const __m512 divisor = _mm512_set1_ps(scale), reciprocal = _mm512_set1_ps(1.0f / scale);
  // |x / scale| <= 127.5 (and a little over where scale rounded down): rounding half to even gives -128 to 128,
  // so only 128 needs the clip to 127; the saturating narrowing would clip it too, but the sum must not see it.
  const __m512i high = _mm512_set1_epi32(127);
  __m512i sums = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 lanes = lanes16(K, k);
    const __m512 v = load(k, lanes);
    __m512 q;
    if (by_reciprocal) {
      q = _mm512_mul_ps(v, reciprocal);
      q = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, divisor, v), reciprocal, q);
    } else {
      q = _mm512_div_ps(v, divisor);
    }
    const __m512i q32 =
        _mm512_min_epi32(high, _mm512_cvt_roundps_epi32(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    sums = _mm512_add_epi32(sums, q32);
    _mm_mask_storeu_epi8(codes + k, lanes, _mm512_cvtsepi32_epi8(q32));
  }
  std::memset(codes + K, 0, padded - K);
  code_sum = _mm512_reduce_add_epi32(sums);
  return scale;
}

#else

// The same codes without AVX-512: a plain loop (the portable build).
template <typename T>
float quantize_row(const T* x, int64_t K, int64_t padded, int8_t* codes, int32_t& code_sum) {
  auto value = [&](int64_t k) -> float {
    if constexpr (sizeof(T) == 4) {
      return x[k];
    } else {
      return bf16_to_float(x[k]);
    }
  };
  float peak = 0.0f;
  for (int64_t k = 0; k < K; ++k) peak = std::isnan(value(k)) ? value(k) : std::max(peak, std::fabs(value(k)));
  float scale = peak / 127.5f;
  if (scale == 0.0f) scale = FLT_EPSILON;
  code_sum = 0;
  for (int64_t k = 0; k < K; ++k) {
    const float q = std::nearbyint(value(k) / scale);  // the default rounding mode: half to even
    const int32_t code = std::isnan(q) ? 0 : static_cast<int32_t>(std::clamp(q, -128.0f, 127.0f));
    codes[k] = static_cast<int8_t>(code);
    code_sum += code;
  }
  std::memset(codes + K, 0, padded - K);
  return scale;
}

#endif

}  // namespace paged
