// bfloat16 <-> float32 for the native CPU kernels (bf16 travels as uint16_t: its bits are a float's high half).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace paged {

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as XLA's convert does
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN stays NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

#if defined(__AVX512F__)
// 16 bfloat16 values as floats.
inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// The same for the `lanes` of them that are set; the others are zeros and are not read (a row's tail).
inline __m512 load_bf16x16(const uint16_t* p, __mmask16 lanes) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, p)), 16));
}
#endif

// float_to_bf16 on 16 lanes (round to nearest even, a NaN kept a NaN), each in the high half of a 32-bit lane.
inline __m512i round_bf16x16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
  return _mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}

// v rounded to bfloat16 and back: float_to_bf16 then bf16_to_float, on 16 lanes in registers.
inline __m512 round_bf16x16(__m512 v) { return _mm512_castsi512_ps(round_bf16x16_bits(v)); }

// float_to_bf16 on 16 lanes, stored.
inline void store_bf16x16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16x16_bits(v), 16)));
}

// A matmul's float32 results stored as bfloat16: where the CPU has AVX-512 BF16, its one conversion
// (VCVTNEPS2BF16: round to nearest even, a NaN a quiet NaN, and float32 subnormals, below 1.2e-38, flushed to
// zero) in place of store_bf16x16's six vector operations (W8A8 gate/up epilogue over 2,048 x 4,864, one
// thread, silu512's reciprocal: 10.4 -> 8.2 ns per 16 outputs).
inline void store_product_bf16x16(uint16_t* p, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#else
  store_bf16x16(p, v);
#endif
}
#endif

}  // namespace paged
