// The last step of the fused greedy LM heads (amx.cc, transposed.cc): each thread kept, per row of x and per
// lane, the best value its run of the table gave (a NaN counted as +inf) and the first table row that gave it.
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace paged {

#if defined(__AVX512F__)
// A block's 16 values `v` of one row into that row's lane records (lanes in `mask`): a NaN counts as +inf, and
// a lane takes v where it is greater, with the index first_row + lane. Blocks come in table order, so each
// lane keeps the first row of its best value.
inline void keep_lane_best(float* best, int32_t* index, __m512 v, __mmask16 mask, int32_t first_row) {
  v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v, _mm512_set1_ps(INFINITY));
  const __m512 old = _mm512_loadu_ps(best);
  const __mmask16 better = _mm512_mask_cmp_ps_mask(mask, v, old, _CMP_GT_OQ);
  const __m512i rows = _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                        _mm512_set1_epi32(first_row));
  _mm512_storeu_ps(best, _mm512_mask_blend_ps(better, old, v));
  _mm512_storeu_si512(index, _mm512_mask_blend_epi32(better, _mm512_loadu_si512(index), rows));
}
#endif

// tokens[m] = the least index among the lanes that hold row m's greatest value, over `parts` threads' records
// of `lanes` lanes a row: best(part, m, l) and index(part, m, l).
template <typename Best, typename Index>
void first_maximum_of_lanes(int64_t parts, int64_t M, int64_t lanes, const Best& best, const Index& index,
                            int32_t* tokens) {
  for (int64_t m = 0; m < M; ++m) {
    float top = -INFINITY;
    for (int64_t part = 0; part < parts; ++part)
      for (int64_t l = 0; l < lanes; ++l) top = std::max(top, best(part, m, l));
    int32_t first = INT32_MAX;
    for (int64_t part = 0; part < parts; ++part)
      for (int64_t l = 0; l < lanes; ++l)
        if (best(part, m, l) == top) first = std::min(first, index(part, m, l));
    tokens[m] = first;
  }
}

// tokens[m] = first[p][m] of the first part p whose best[p][m] is the greatest: each part one thread's run of
// candidate rows, the parts in table order, so a later part's row wins only where its value is greater.
inline void first_of_parts(const std::vector<std::vector<float>>& best, const std::vector<std::vector<int32_t>>& first,
                           int64_t M, int32_t* tokens) {
  for (int64_t m = 0; m < M; ++m) {
    size_t winner = 0;
    for (size_t part = 1; part < best.size(); ++part)
      if (best[part][m] > best[winner][m]) winner = part;
    tokens[m] = first[winner][m];
  }
}

}  // namespace paged
