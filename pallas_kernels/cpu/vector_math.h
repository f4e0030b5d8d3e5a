// Vector math for the native CPU kernels: exp in every lane of an AVX-512 vector.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace paged {

// exp(x) in every lane: Cephes' single-precision polynomial after a Cody-Waite reduction by ln 2 (about 1
// ulp), scalef applying 2^n. Arguments below -104 give 0 (scalef flushes below the float range); above 88
// they are clamped to exp(88) = 1.65e38, finite, so 1 / (1 + exp(x)) stays a number.
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// silu(g) = g / (1 + exp(-g)) in every lane. The reciprocal is rcp14's estimate (relative error under 2^-14)
// refined by one Newton step, which squares that error to about 2^-28, within float32's rounding: a division
// on 16 lanes occupies its port ~16 cycles, and in a gated product's epilogue it took as long as the rest
// (W8A8 gate/up epilogue over 2,048 x 4,864, one thread: 19.5 -> 10.4 ns per 16 outputs). Where exp(-g) is
// clamped at exp(88), 1 + exp(-g) stays finite and the result a tiny number, as with the division.
inline __m512 silu512(__m512 g) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 d = _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, one), r);
  return _mm512_mul_ps(g, r);
}

}  // namespace paged

#endif
