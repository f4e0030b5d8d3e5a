// Paged attention on the CPU as an XLA FFI custom call: reads K/V straight from the pool by page id.
//
// Why a native kernel: in XLA's CPU code every chunk of pages must first be gathered into a temporary
// (XLA has no fused gather-matmul), and the chunk loop pays a fixed cost per op per iteration. Here each
// (token, KV head) item walks its own pages in place, only over the keys it can see, with the online
// softmax kept in registers; items are spread over XLA's intra-op thread pool.
//
// Contract (same as paged_attention_reference in reference.py):
//   q            [T, Hq, D]            float32 or bfloat16
//   k_cache      [L, Hkv, NB, bs, D]   the dtype of q
//   v_cache      [L, Hkv, NB, bs, D]   the dtype of q
//   layer        int32 []              which layer of the pool
//   page_tables  int32 [S, P]          block ids per sequence (entries past the context are never read)
//   token_seq_ids int32 [T]            row of page_tables for each token (<0 or >=S: output zeros)
//   positions    int32 [T]             the token sees keys 0..position of its sequence (<0: zeros)
//   window       int32 []              sliding window (<=0: none): keys > position - window
//   attrs: scale (f32), soft_cap (f32, 0 = none)
//   out          [T, Hq, D]            the dtype of q

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "amx.h"
#include "bf16.h"
#include "parallel.h"
#include "vector_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using paged::bf16_to_float;
using paged::float_to_bf16;
#if defined(__AVX512F__)
using paged::exp512;
#endif

template <typename T>
inline float load(const T* p, int64_t i);
template <>
inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <>
inline float load<uint16_t>(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }

template <typename T>
inline void store(T* p, int64_t i, float v);
template <>
inline void store<float>(float* p, int64_t i, float v) { p[i] = v; }
template <>
inline void store<uint16_t>(uint16_t* p, int64_t i, float v) { p[i] = float_to_bf16(v); }

// exp(x) for x <= 0 (scores minus their running maximum). Cephes' single-precision polynomial after a
// Cody-Waite reduction by ln 2: about 1 ulp, and plain arithmetic so the compiler vectorises the loops
// that call it (libm's expf would run one element at a time). Arguments below -87 give 0.
inline float exp_nonpositive(float x) {
  const bool underflow = x < -87.0f;
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return underflow ? 0.0f : p * two_n;
}

#ifndef PREFETCH_PAGES
#define PREFETCH_PAGES 2
#endif

struct Problem {
  int64_t num_tokens, num_q_heads, head_dim, num_layers, num_kv_heads, num_blocks, block_size;
  int64_t num_seqs, pages_per_seq;
  int32_t layer, window;
  float scale, soft_cap;
  const int32_t* page_tables;
  const int32_t* token_seq_ids;
  const int32_t* positions;
};

// Pages ahead that the AVX-512 decode item requests, a few cache lines at a time over a page's work: a
// burst of a page's 2 x 64 line requests stalls on the core's miss buffers. On 48 decodes over pages in
// random order: 17 GB/s of K/V with bursts, 31 GB/s trickled (as fast as pages laid out in order).
constexpr int64_t kTrickleDistance = 2;

// The first pages of the decode item that the same thread runs next: the last pages of an item request them
// as they would request its own pages further on, so the next item does not start on pages still in memory
// (48 decodes, contexts 100-511, 8 layers, against not requesting them in one process: 3-7% faster).
struct NextPages {
  const int32_t* pages = nullptr;  // its page ids from its first visible page
  int64_t head_base = 0;           // (layer * Hkv + head) * NB
  int64_t count = 0;               // how many to request (0: none)
};

// The pages [page_begin, page_end) of its visible range that a decode item walks, and where its result goes.
// A long context is split into parts of kSplitKeys keys (split-KV, as flash-decoding does on GPUs): one
// sequence's decode then spreads over every thread instead of one per KV head, and each part leaves its
// unnormalised accumulators, running maxima and sums in `partial` ([G * D], [G], [G] floats) for
// combine_parts. The split depends only on the context, never on the thread count, so results do not either.
struct Span {
  int64_t page_begin = 0, page_end = INT64_MAX;
  float* partial = nullptr;  // nullptr: the item writes the normalised output itself
};

// Keys per part of a split decode (a multiple of every page size the engine uses). Contexts up to this
// many keys stay one item: a part's partial write and combine then cost nothing noticeable against its walk.
constexpr int64_t kSplitKeys = 2048;

// Requests one page's K and V into cache. Pages sit anywhere in the pool and the hardware prefetcher stops
// at their edges: without this, every page's first reads wait on memory (measured: 1.4x slower).
template <typename T>
inline void prefetch_page(const T* k_cache, const T* v_cache, int64_t page_offset, int64_t page_elems) {
  const char* k = reinterpret_cast<const char*>(k_cache + page_offset);
  const char* v = reinterpret_cast<const char*>(v_cache + page_offset);
  for (int64_t byte = 0; byte < page_elems * static_cast<int64_t>(sizeof(T)); byte += 64) {
    __builtin_prefetch(k + byte, 0, 1);
    __builtin_prefetch(v + byte, 0, 1);
  }
}

// A decode item's schedule over pages [first, ...) of keys up to `end`: at the first page it requests the
// next PREFETCH_PAGES, at each later one the page PREFETCH_PAGES ahead.
template <typename T>
inline void prefetch_ahead(const T* k_cache, const T* v_cache, const int32_t* pages, int64_t head_base,
                           int64_t page_index, int64_t first, int64_t end, int64_t bs, int64_t D) {
  const int64_t from = page_index == first ? page_index + 1 : page_index + PREFETCH_PAGES;
  for (int64_t pf = from; pf <= page_index + PREFETCH_PAGES && pf * bs < end; ++pf)
    prefetch_page(k_cache, v_cache, (head_base + pages[pf]) * bs * D, bs * D);
}

// Writes zeros for a token with no sequence (padding); true if it was one.
template <typename T>
inline bool zero_if_padding(const Problem& pb, T* out_row, int64_t t, int64_t count) {
  const int32_t seq = pb.token_seq_ids[t];
  if (seq >= 0 && seq < pb.num_seqs && pb.positions[t] >= 0) return false;
  for (int64_t i = 0; i < count; ++i) store(out_row, i, 0.0f);
  return true;
}

// One row's online-softmax update over a page's scores s[0, bs), of which keys [lo, hi) are visible
// (lo < hi): soft cap, running max m and sum l. Leaves the probabilities in s (0 outside [lo, hi), over
// the whole page: a fixed trip count that vectorises) and returns the factor that rescales the row's
// accumulator (0 at the first page, where m is -inf).
inline float softmax_page(float* s, int64_t lo, int64_t hi, int64_t bs, float soft_cap, float& m, float& l) {
  if (soft_cap > 0.0f) {
    for (int64_t j = lo; j < hi; ++j) s[j] = soft_cap * std::tanh(s[j] / soft_cap);
  }
  float block_max = -INFINITY;
  for (int64_t j = lo; j < hi; ++j) block_max = std::max(block_max, s[j]);
  const float m_new = std::max(m, block_max);
  const float correction = exp_nonpositive(m - m_new);
  for (int64_t j = 0; j < lo; ++j) s[j] = -INFINITY;
  for (int64_t j = hi; j < bs; ++j) s[j] = -INFINITY;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < bs; ++j) {
    s[j] = exp_nonpositive(s[j] - m_new);
    sum += s[j];
  }
  l = l * correction + sum;
  m = m_new;
  return correction;
}

// Attention of one token's query heads that share KV head `h`.
// Scratch: q_scaled [G*D], acc [G*D], scores [G*bs], m [G], l [G] (float).
// FIXED_G / FIXED_D > 0 fix the GQA group and head_dim at compile time: the loops over them then unroll
// into whole vectors kept in registers with independent dependency chains, which is most of the kernel's
// speed; 0 handles any size.
template <typename T, int FIXED_G, int FIXED_D>
void attend_item(const Problem& pb, const T* q, const T* k_cache, const T* v_cache, T* out, int64_t t,
                 int64_t h, float* scratch, const NextPages& /*next: requested by the AVX-512 item only*/,
                 const Span& span) {
  const int64_t G = FIXED_G > 0 ? FIXED_G : pb.num_q_heads / pb.num_kv_heads;
  const int64_t D = FIXED_D > 0 ? FIXED_D : pb.head_dim;
  const int64_t bs = pb.block_size;
  float* qs = scratch;
  float* acc = qs + G * D;
  float* s = acc + G * D;
  float* m = s + G * bs;
  float* l = m + G;
  T* out_row = out + (t * pb.num_q_heads + h * G) * D;
  if (zero_if_padding(pb, out_row, t, G * D)) return;
  const int32_t seq = pb.token_seq_ids[t];
  const int32_t pos = pb.positions[t];
  const T* q_row = q + (t * pb.num_q_heads + h * G) * D;
  for (int64_t i = 0; i < G * D; ++i) qs[i] = load(q_row, i) * pb.scale;
  std::fill(acc, acc + G * D, 0.0f);
  std::fill(m, m + G, -INFINITY);
  std::fill(l, l + G, 0.0f);

  const int64_t end = static_cast<int64_t>(pos) + 1;  // keys [start, end) are visible
  int64_t start = 0;
  if (pb.window > 0) start = std::max<int64_t>(0, end - pb.window);
  const int32_t* pages = pb.page_tables + seq * pb.pages_per_seq;
  const int64_t head_base = (static_cast<int64_t>(pb.layer) * pb.num_kv_heads + h) * pb.num_blocks;

  const int64_t first_page = std::max(start / bs, span.page_begin);
  const int64_t end_page = std::min((end + bs - 1) / bs, span.page_end);
  for (int64_t page_index = first_page; page_index < end_page; ++page_index) {
    const int64_t lo = std::max<int64_t>(start - page_index * bs, 0);
    const int64_t hi = std::min<int64_t>(end - page_index * bs, bs);
    const int64_t block = pages[page_index];
    const T* k_page = k_cache + (head_base + block) * bs * D;
    const T* v_page = v_cache + (head_base + block) * bs * D;
    prefetch_ahead(k_cache, v_cache, pages, head_base, page_index, first_page, end, bs, D);
    // Scores: every query head of the group against each key, the group's dot products side by side
    // (independent chains) and one horizontal sum each at the end.
    for (int64_t j = lo; j < hi; ++j) {
      const T* k_row = k_page + j * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qs + g * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * load(k_row, d);
        s[g * bs + j] = dot;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * bs;
      const float correction = softmax_page(sg, lo, hi, bs, pb.soft_cap, m[g], l[g]);
      // Weighted values: the head's accumulator row stays in registers over the page's keys (D / 16
      // independent chains when D is fixed).
      float row[FIXED_D > 0 ? FIXED_D : 1];
      float* a = FIXED_D > 0 ? row : acc + g * D;
      if (FIXED_D > 0) {
        for (int64_t d = 0; d < D; ++d) a[d] = acc[g * D + d] * correction;
      } else {
        for (int64_t d = 0; d < D; ++d) a[d] *= correction;
      }
      for (int64_t j = lo; j < hi; ++j) {
        const T* v_row = v_page + j * D;
        const float p = sg[j];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p * load(v_row, d);
      }
      if (FIXED_D > 0) std::copy(a, a + D, acc + g * D);
    }
  }
  if (span.partial) {
    std::copy(acc, acc + G * D, span.partial);
    std::copy(m, m + G, span.partial + G * D);
    std::copy(l, l + G, span.partial + G * D + G);
    return;
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    for (int64_t d = 0; d < D; ++d) store(out_row, g * D + d, acc[g * D + d] * inv);
  }
}

// The output of a decode token's KV head `h` from the partial results of its `num_parts` parts (each
// [G * D] unnormalised accumulators, [G] maxima, [G] sums): every part's sums rescaled to the largest maximum.
template <typename T>
void combine_parts(const Problem& pb, T* out, int64_t t, int64_t h, const float* parts, int64_t num_parts) {
  const int64_t G = pb.num_q_heads / pb.num_kv_heads, D = pb.head_dim, stride = G * D + 2 * G;
  T* out_row = out + (t * pb.num_q_heads + h * G) * D;
  std::vector<float> row(D), weight(num_parts);
  for (int64_t g = 0; g < G; ++g) {
    float m = -INFINITY;
    for (int64_t p = 0; p < num_parts; ++p) m = std::max(m, parts[p * stride + G * D + g]);
    float l = 0.0f;
    for (int64_t p = 0; p < num_parts; ++p) {
      const float* part = parts + p * stride;
      weight[p] = part[G * D + g] == -INFINITY ? 0.0f : exp_nonpositive(part[G * D + g] - m);
      l += part[G * D + G + g] * weight[p];
    }
    std::fill(row.begin(), row.end(), 0.0f);
    for (int64_t p = 0; p < num_parts; ++p) {
      const float* acc = parts + p * stride + g * D;
      for (int64_t d = 0; d < D; ++d) row[d] += acc[d] * weight[p];
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int64_t d = 0; d < D; ++d) store(out_row, g * D + d, row[d] * inv);
  }
}


#if defined(__AVX512F__)
// AVX-512 decode item for pages of 16 keys and head_dim a multiple of 16 (the engine's defaults). The
// portable loops above leave most of the time in horizontal sums and scalar exps (perf: the score's
// lane-by-lane adds and the softmax's scalar polynomial dominate); here the 16 dot products of a page
// are reduced together (one transpose-and-add tree instead of 16 horizontal sums), the exp is one vector
// polynomial with scalef, and the group's accumulators stay in registers.

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return paged::load_bf16x16(p); }

// Sums each of 16 vectors across its lanes: lane j of the result is the sum of v[j]. Four rounds of
// pairwise merges (each halves the vectors and doubles the keys per vector): 15 adds, 30 permutes.
inline __m512 transpose_sum16(__m512 v[16]) {
  // Round w (w = 8, 4, 2, 1 lanes): merge v[i] and v[i + n] so that lanes of blocks of w come from either.
  const __m512i idx8a = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i idx8b = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const __m512i idx4a = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
  const __m512i idx4b = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512i idx2a = _mm512_setr_epi32(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
  const __m512i idx2b = _mm512_setr_epi32(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  const __m512i idx1a = _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
  const __m512i idx1b = _mm512_setr_epi32(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  // After round 1, w[i] (i < 8) holds keys i (low half) and i + 8 (high half), each as 8 partial sums.
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[i], idx8a, v[i + 8]), _mm512_permutex2var_ps(v[i], idx8b, v[i + 8]));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_permutex2var_ps(a[i], idx4a, a[i + 4]), _mm512_permutex2var_ps(a[i], idx4b, a[i + 4]));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_permutex2var_ps(b[i], idx2a, b[i + 2]), _mm512_permutex2var_ps(b[i], idx2b, b[i + 2]));
  return _mm512_add_ps(_mm512_permutex2var_ps(c[0], idx1a, c[1]), _mm512_permutex2var_ps(c[0], idx1b, c[1]));
}

// The page ahead's K and V lines, requested in order over PARTS calls (a page's work makes that many): each
// call adds a page's lines / PARTS to its credit and requests whole lines while the credit lasts. A running
// count instead of each call's share computed from its index: that division and loop took ~5% of the kernel
// with K/V in cache (48 decodes, 8 layers: 1.58 -> 1.50 ms).
template <typename T, int64_t PAGE_ELEMS, int64_t PARTS>
class PageTrickle {
 public:
  PageTrickle() = default;  // requests nothing
  PageTrickle(const T* k_cache, const T* v_cache, int64_t page_offset)
      : k_(reinterpret_cast<const char*>(k_cache + page_offset)),
        v_(reinterpret_cast<const char*>(v_cache + page_offset)) {}

  __attribute__((always_inline)) void request() {
    if (!k_) return;
    for (credit_ += kLines; credit_ >= PARTS; credit_ -= PARTS, ++line_) {
      __builtin_prefetch(k_ + 64 * line_, 0, 1);
      __builtin_prefetch(v_ + 64 * line_, 0, 1);
    }
  }

 private:
  static constexpr int64_t kLines = PAGE_ELEMS * static_cast<int64_t>(sizeof(T)) / 64;
  const char* k_ = nullptr;
  const char* v_ = nullptr;
  int64_t credit_ = 0;
  int64_t line_ = 0;
};

// softmax_page for a page of 16 scores in a vector: soft cap, then the running max m and sum l over the
// `visible` keys (the others, not yet written or behind the window, may hold anything). Returns the
// probabilities (0 outside `visible`) and sets the factor that rescales the row's accumulator.
__attribute__((always_inline)) inline __m512 softmax_page16(__m512 scores, __mmask16 visible, float soft_cap,
                                                          float& m, float& l, float& correction) {
  if (soft_cap > 0.0f) {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, scores);
    for (int j = 0; j < 16; ++j) tmp[j] = soft_cap * std::tanh(tmp[j] / soft_cap);
    scores = _mm512_load_ps(tmp);
  }
  const float m_new = std::max(m, _mm512_mask_reduce_max_ps(visible, scores));
  correction = exp_nonpositive(m - m_new);
  const __m512 p = _mm512_maskz_mov_ps(visible, exp512(_mm512_sub_ps(scores, _mm512_set1_ps(m_new))));
  l = l * correction + _mm512_reduce_add_ps(p);
  m = m_new;
  return p;
}

// softmax_page for the G heads of a group, each with a page of 16 scores in a vector: soft cap, then each
// head's running max m and sum l over the `visible` keys (the others, not yet written or behind the window,
// may hold anything). Writes the probabilities (0 outside `visible`) to probs [G, 16] and rescales each
// head's accumulator by exp(m_old - m_new). The G corrections take one vector exp.
template <int G, int C>
__attribute__((always_inline)) inline void softmax_heads16(__m512 (&scores)[G], __mmask16 visible, float soft_cap,
                                                           float (&m)[G], float (&l)[G], float* probs,
                                                           __m512 (&acc)[G][C]) {
  static_assert(G <= 16, "one vector of corrections");
  if (soft_cap > 0.0f) {
    alignas(64) float tmp[16];
    for (int g = 0; g < G; ++g) {
      _mm512_store_ps(tmp, scores[g]);
      for (int j = 0; j < 16; ++j) tmp[j] = soft_cap * std::tanh(tmp[j] / soft_cap);
      scores[g] = _mm512_load_ps(tmp);
    }
  }
  alignas(64) float m_old[16] = {}, m_new[16] = {}, correction[16];
  for (int g = 0; g < G; ++g) {
    m_old[g] = m[g];  // -inf at the first page: its correction is exp(-inf) = 0 (exp512 clamps)
    m_new[g] = std::max(m[g], _mm512_mask_reduce_max_ps(visible, scores[g]));
  }
  _mm512_store_ps(correction, exp512(_mm512_sub_ps(_mm512_load_ps(m_old), _mm512_load_ps(m_new))));
  for (int g = 0; g < G; ++g) {
    const __m512 p = _mm512_maskz_mov_ps(visible, exp512(_mm512_sub_ps(scores[g], _mm512_set1_ps(m_new[g]))));
    _mm512_storeu_ps(probs + g * 16, p);
    l[g] = l[g] * correction[g] + _mm512_reduce_add_ps(p);
    m[g] = m_new[g];
    const __m512 corr = _mm512_set1_ps(correction[g]);
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], corr);
  }
}

// Keys [lo, hi) of a page of 16.
__attribute__((always_inline)) inline __mmask16 keys_mask(int64_t lo, int64_t hi) {
  return static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

template <typename T, int G, int D>
void attend_item_avx512(const Problem& pb, const T* q, const T* k_cache, const T* v_cache, T* out, int64_t t,
                        int64_t h, float* scratch, const NextPages& next, const Span& span) {
  constexpr int64_t bs = 16, C = D / 16;  // vectors per head row
  // The page ahead is requested in parts over this page's work: one per (query head, key) score and one
  // per key's PV product (keys this row cannot see send theirs at once). Over the scores alone the
  // requests came in bursts: 48 decodes, contexts 100-511, 8 layers, one process: 3-13% slower.
  constexpr int64_t kParts = G * bs + bs;
  T* out_row = out + (t * pb.num_q_heads + h * G) * D;
  if (zero_if_padding(pb, out_row, t, G * D)) return;
  const int32_t seq = pb.token_seq_ids[t];
  const int32_t pos = pb.positions[t];
  const T* q_row = q + (t * pb.num_q_heads + h * G) * D;
  float* qs = scratch;  // [G, D] scaled queries
  float* probs = qs + G * D;  // [G, 16] a page's probabilities
#if defined(__AVX512BF16__)
  // bfloat16 scores by vdpbf16ps: one instruction multiplies 32 (query, key) pairs exactly and adds them
  // into 16 float32 lanes, where widening each key row again for every head of the group and an FMA took
  // twice the instructions (the group's arithmetic, not the memory, bounds a GQA-7 decode). The scale is
  // applied to the sums.
  constexpr bool kDot = std::is_same_v<T, uint16_t> && D % 32 == 0;
  __m512bh qb[G][kDot ? D / 32 : 1];
  if constexpr (kDot)
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < D / 32; ++c) qb[g][c] = (__m512bh)_mm512_loadu_si512(q_row + g * D + c * 32);
#else
  constexpr bool kDot = false;
#endif
  if constexpr (!kDot)
    for (int64_t i = 0; i < G * D; ++i) qs[i] = load(q_row, i) * pb.scale;
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  float m[G], l[G];
  for (int g = 0; g < G; ++g) m[g] = -INFINITY, l[g] = 0.0f;

  const int64_t end = static_cast<int64_t>(pos) + 1;
  const int64_t start = pb.window > 0 ? std::max<int64_t>(0, end - pb.window) : 0;
  const int32_t* pages = pb.page_tables + seq * pb.pages_per_seq;
  const int64_t head_base = (static_cast<int64_t>(pb.layer) * pb.num_kv_heads + h) * pb.num_blocks;
  const int64_t first_page = std::max(start / bs, span.page_begin);
  const int64_t end_page = std::min((end + bs - 1) / bs, span.page_end);
  for (int64_t page_index = first_page; page_index < end_page; ++page_index) {
    const int64_t lo = std::max<int64_t>(start - page_index * bs, 0);
    const int64_t hi = std::min<int64_t>(end - page_index * bs, bs);
    const __mmask16 visible = keys_mask(lo, hi);
    const T* k_page = k_cache + (head_base + pages[page_index]) * bs * D;
    const T* v_page = v_cache + (head_base + pages[page_index]) * bs * D;
    if (page_index == first_page)  // the pages before the first one trickled
      for (int64_t pf = page_index + 1; pf < page_index + kTrickleDistance && pf < end_page; ++pf)
        prefetch_page(k_cache, v_cache, (head_base + pages[pf]) * bs * D, bs * D);
    const int64_t ahead = page_index + kTrickleDistance;
    const int64_t past = ahead - end_page;  // >= 0: the next item's page `past`
    using Trickle = PageTrickle<T, bs * D, kParts>;
    Trickle trickle = past < 0             ? Trickle(k_cache, v_cache, (head_base + pages[ahead]) * bs * D)
                      : past < next.count ? Trickle(k_cache, v_cache, (next.head_base + next.pages[past]) * bs * D)
                                          : Trickle();
    // All G heads' scores first, then their softmax updates side by side: the per-head chains (max, exp,
    // sum) are latency-bound, and one head after another left the FMA pipes idle between them. 48 decodes,
    // 8 layers: K/V in cache 2.25 -> 1.68 ms; from memory 3.61 -> 3.10 ms, or no change when the machine's
    // memory is in a slow phase (reads, not arithmetic, bound it then).
    __m512 scores[G];
    for (int g = 0; g < G; ++g) {
#if defined(__AVX512BF16__)
      if constexpr (kDot) {
        __m512 part[16];
        for (int j = 0; j < 16; ++j) {
          trickle.request();
          const T* k_row = k_page + j * D;
          __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], (__m512bh)_mm512_loadu_si512(k_row));
          for (int c = 1; c < D / 32; ++c)
            sum = _mm512_dpbf16_ps(sum, qb[g][c], (__m512bh)_mm512_loadu_si512(k_row + c * 32));
          part[j] = sum;
        }
        scores[g] = _mm512_mul_ps(transpose_sum16(part), _mm512_set1_ps(pb.scale));
        continue;
      }
#endif
      __m512 qv[C];
      for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qs + g * D + c * 16);
      __m512 part[16];
      for (int j = 0; j < 16; ++j) {
        trickle.request();
        const T* k_row = k_page + j * D;
        __m512 sum = _mm512_mul_ps(qv[0], load16(k_row));
        for (int c = 1; c < C; ++c) sum = _mm512_fmadd_ps(qv[c], load16(k_row + c * 16), sum);
        part[j] = sum;
      }
      scores[g] = transpose_sum16(part);
    }
    softmax_heads16<G>(scores, visible, pb.soft_cap, m, l, probs, acc);
    for (int64_t j = 0; j < lo; ++j) trickle.request();
    for (int64_t j = hi; j < bs; ++j) trickle.request();
    for (int64_t j = lo; j < hi; ++j) {
      trickle.request();
      const T* v_row = v_page + j * D;
      for (int c = 0; c < C; ++c) {
        const __m512 v = load16(v_row + c * 16);
        for (int g = 0; g < G; ++g) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(probs[g * 16 + j]), v, acc[g][c]);
      }
    }
  }
  if (span.partial) {
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(span.partial + g * D + c * 16, acc[g][c]);
      span.partial[G * D + g] = m[g];
      span.partial[G * D + G + g] = l[g];
    }
    return;
  }
  for (int g = 0; g < G; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    alignas(64) float row[D];
    for (int c = 0; c < C; ++c) _mm512_store_ps(row + c * 16, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv)));
    for (int64_t d = 0; d < D; ++d) store(out_row, g * D + d, row[d]);
  }
}
#endif  // __AVX512F__

// Rows of a tile's score block computed together: 8 independent FMA chains keep both FMA pipes busy.
constexpr int64_t kRowBlock = 8;
// Query rows (tokens x group heads) per tile: enough to amortise each page's transpose, small enough that
// a tile's accumulators stay in L1/L2.
constexpr int64_t kTileRows = 64;

// Attention of a run of `n` tokens of one sequence (a prompt chunk) for KV head `h`: every page is read
// once for the whole tile instead of once per token. Keys are transposed per page into kt [D, bs] so the
// scores of kRowBlock rows against a page's keys are plain vector FMAs (no horizontal sums), and each row
// keeps its own causal/window mask and online softmax. Rows are r = i * G + g (token i, query head g).
// Scratch: qs [Rp*D], acc [Rp*D], kt [D*bs], s [Rp*bs], m [Rp], l [Rp], where Rp = R rounded up to
// kRowBlock.
template <typename T, int FIXED_D, int FIXED_BS>
void attend_tile(const Problem& pb, const T* q, const T* k_cache, const T* v_cache, T* out, int64_t t0,
                 int64_t n, int64_t h, float* scratch) {
  const int64_t G = pb.num_q_heads / pb.num_kv_heads;
  const int64_t D = FIXED_D > 0 ? FIXED_D : pb.head_dim;
  const int64_t bs = FIXED_BS > 0 ? FIXED_BS : pb.block_size;
  const int64_t R = n * G;
  const int64_t Rp = (R + kRowBlock - 1) / kRowBlock * kRowBlock;
  float* qs = scratch;
  float* acc = qs + Rp * D;
  float* kt = acc + Rp * D;
  float* s = kt + D * bs;
  float* m = s + Rp * bs;
  float* l = m + Rp;
  for (int64_t i = 0; i < n; ++i) {
    const T* q_row = q + ((t0 + i) * pb.num_q_heads + h * G) * D;
    for (int64_t e = 0; e < G * D; ++e) qs[i * G * D + e] = load(q_row, e) * pb.scale;
  }
  std::fill(qs + R * D, qs + Rp * D, 0.0f);
  std::fill(acc, acc + Rp * D, 0.0f);
  std::fill(m, m + Rp, -INFINITY);
  std::fill(l, l + Rp, 0.0f);

  const int32_t seq = pb.token_seq_ids[t0];
  int64_t start = INT64_MAX, end = 0;  // keys [start, end) are visible to some row
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row_end = static_cast<int64_t>(pb.positions[t0 + i]) + 1;
    end = std::max(end, row_end);
    start = std::min(start, pb.window > 0 ? std::max<int64_t>(0, row_end - pb.window) : 0);
  }
  const int32_t* pages = pb.page_tables + seq * pb.pages_per_seq;
  const int64_t head_base = (static_cast<int64_t>(pb.layer) * pb.num_kv_heads + h) * pb.num_blocks;

  for (int64_t page_index = start / bs; page_index * bs < end; ++page_index) {
    const int64_t key0 = page_index * bs;
    const T* k_page = k_cache + (head_base + pages[page_index]) * bs * D;
    const T* v_page = v_cache + (head_base + pages[page_index]) * bs * D;
    if ((page_index + 1) * bs < end)  // the next page, while this one is computed
      prefetch_page(k_cache, v_cache, (head_base + pages[page_index + 1]) * bs * D, bs * D);
    for (int64_t j = 0; j < bs; ++j)
      for (int64_t d = 0; d < D; ++d) kt[d * bs + j] = load(k_page, j * D + d);
    // Scores [Rp, bs]: kRowBlock rows at a time, one page row of keys per FMA.
    for (int64_t r0 = 0; r0 < Rp; r0 += kRowBlock) {
      float block[kRowBlock][FIXED_BS > 0 ? FIXED_BS : 128];
      for (int64_t r = 0; r < kRowBlock; ++r)
        for (int64_t j = 0; j < bs; ++j) block[r][j] = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        const float* kd = kt + d * bs;
        for (int64_t r = 0; r < kRowBlock; ++r) {
          const float qd = qs[(r0 + r) * D + d];
#pragma omp simd
          for (int64_t j = 0; j < bs; ++j) block[r][j] += qd * kd[j];
        }
      }
      for (int64_t r = 0; r < kRowBlock; ++r) std::copy(block[r], block[r] + bs, s + (r0 + r) * bs);
    }
    // Masks and the online softmax, row by row.
    for (int64_t r = 0; r < R; ++r) {
      float* sr = s + r * bs;
      const int64_t row_end = static_cast<int64_t>(pb.positions[t0 + r / G]) + 1;
      const int64_t row_start = pb.window > 0 ? std::max<int64_t>(0, row_end - pb.window) : 0;
      const int64_t lo = std::max<int64_t>(row_start - key0, 0), hi = std::min<int64_t>(row_end - key0, bs);
      if (lo >= hi) {  // this row sees none of the page's keys
        std::fill(sr, sr + bs, 0.0f);
        continue;
      }
      float correction;
#if defined(__AVX512F__)
      if constexpr (FIXED_BS == 16)  // vector exp: the scalar loop below was ~40% of a tile's time
        _mm512_storeu_ps(sr, softmax_page16(_mm512_loadu_ps(sr), keys_mask(lo, hi), pb.soft_cap, m[r], l[r],
                                            correction));
      else
#endif
        correction = softmax_page(sr, lo, hi, bs, pb.soft_cap, m[r], l[r]);
      float* a = acc + r * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= correction;
    }
    // Weighted values: two rows at a time share each value row's loads; their accumulators stay in
    // registers over the page's keys when D is fixed.
    for (int64_t r0 = 0; r0 < R; r0 += 2) {
      const bool pair = r0 + 1 < R;
      float a0[FIXED_D > 0 ? FIXED_D : 256], a1[FIXED_D > 0 ? FIXED_D : 256];
      for (int64_t d = 0; d < D; ++d) {
        a0[d] = acc[r0 * D + d];
        a1[d] = pair ? acc[(r0 + 1) * D + d] : 0.0f;
      }
      const float* p0 = s + r0 * bs;
      const float* p1 = pair ? p0 + bs : p0;
      for (int64_t j = 0; j < bs; ++j) {
        const T* v_row = v_page + j * D;
        const float w0 = p0[j], w1 = p1[j];
        if (w0 == 0.0f && w1 == 0.0f) continue;  // masked keys (and stale slots past the context)
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          const float vd = load(v_row, d);
          a0[d] += w0 * vd;
          a1[d] += w1 * vd;
        }
      }
      std::copy(a0, a0 + D, acc + r0 * D);
      if (pair) std::copy(a1, a1 + D, acc + (r0 + 1) * D);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    T* out_row = out + ((t0 + r / G) * pb.num_q_heads + h * G + r % G) * D;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int64_t d = 0; d < D; ++d) store(out_row, d, acc[r * D + d] * inv);
  }
}

template <typename T, int FIXED_D>
auto pick_group(int64_t group, int64_t block_size) {
#if defined(__AVX512F__)
  if (FIXED_D > 0 && block_size == 16) {
    switch (group) {
      case 1: return attend_item_avx512<T, 1, (FIXED_D > 0 ? FIXED_D : 16)>;
      case 2: return attend_item_avx512<T, 2, (FIXED_D > 0 ? FIXED_D : 16)>;
      case 3: return attend_item_avx512<T, 3, (FIXED_D > 0 ? FIXED_D : 16)>;
      case 4: return attend_item_avx512<T, 4, (FIXED_D > 0 ? FIXED_D : 16)>;
      case 5: return attend_item_avx512<T, 5, (FIXED_D > 0 ? FIXED_D : 16)>;
      case 6: return attend_item_avx512<T, 6, (FIXED_D > 0 ? FIXED_D : 16)>;  // Qwen2.5-1.5B
      case 7: return attend_item_avx512<T, 7, (FIXED_D > 0 ? FIXED_D : 16)>;  // Qwen2.5-0.5B and 7B
      case 8: return attend_item_avx512<T, 8, (FIXED_D > 0 ? FIXED_D : 16)>;
      default: break;
    }
  }
#endif
  (void)block_size;
#if defined(__AVX512F__)
  // Only other page sizes and groups come here: head_dim stays fixed, the group not (fewer instantiations,
  // and the first build of the library is a shorter wait).
  (void)group;
  return attend_item<T, 0, FIXED_D>;
#endif
  return group == 1 ? attend_item<T, 1, FIXED_D>
       : group == 2 ? attend_item<T, 2, FIXED_D>
       : group == 4 ? attend_item<T, 4, FIXED_D>
       : group == 8 ? attend_item<T, 8, FIXED_D>
                    : attend_item<T, 0, FIXED_D>;
}

template <typename T, int FIXED_D>
auto pick_tile(int64_t block_size) {
  return block_size == 16 ? attend_tile<T, FIXED_D, 16> : attend_tile<T, FIXED_D, 0>;
}

// Query rows per prompt tile on AMX (amx_attention.cc): each page is packed into tiles once per tile, so
// larger tiles pack less often.
constexpr int64_t kAmxTileRows = 256;

// Whether prompt tiles of this problem go to the AMX kernel: bfloat16, pages of 16, head_dim a multiple of
// 32, no soft cap (its tanh is not there), and a positive scale (the kernel takes the max of unscaled scores).
template <typename T>
bool prompts_on_amx(const Problem& pb) {
  return std::is_same_v<T, uint16_t> && paged::amx::AttendsPrompts() && paged::amx::Available() &&
         pb.block_size == 16 && pb.head_dim % 32 == 0 && pb.head_dim <= paged::amx::kMaxHeadDim &&
         pb.soft_cap == 0.0f && pb.scale > 0.0f;
}

// The tokens [t0, t0 + n) of one sequence for KV head h, on AMX tiles.
void attend_tile_amx(const Problem& pb, const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                     uint16_t* out, int64_t t0, int64_t n, int64_t h) {
  const int64_t G = pb.num_q_heads / pb.num_kv_heads, D = pb.head_dim;
  const int64_t head_base = (static_cast<int64_t>(pb.layer) * pb.num_kv_heads + h) * pb.num_blocks;
  paged::amx::PromptRun run{};
  run.q = q + (t0 * pb.num_q_heads + h * G) * D;
  run.out = out + (t0 * pb.num_q_heads + h * G) * D;
  run.token_stride = pb.num_q_heads * D;
  run.tokens = n;
  run.group = G;
  run.head_dim = D;
  run.positions = pb.positions + t0;
  run.window = pb.window;
  run.scale = pb.scale;
  run.k_head = k_cache + head_base * pb.block_size * D;
  run.v_head = v_cache + head_base * pb.block_size * D;
  run.pages = pb.page_tables + pb.token_seq_ids[t0] * pb.pages_per_seq;
  paged::amx::AttendPrompt(run);
}

// Items in chunks of 4: few enough atomics, fine enough to balance long and short contexts.
constexpr int64_t kItemChunk = 4;

// A work item: the tokens [first, first + count) of one sequence, for one KV head; a decode token's item
// may cover only the pages [page_begin, page_end) of its context, leaving a partial result in slot `part`.
struct Item {
  int64_t first, count, head;
  int64_t page_begin = 0, page_end = INT64_MAX, part = -1;
};

// A split decode token's KV head: its parts' results, slots [first_part, first_part + num_parts).
struct SplitToken {
  int64_t token, head, first_part, num_parts;
};

template <typename T>
void run(const Problem& pb, const T* q, const T* k, const T* v, T* out, ffi::ThreadPool* pool) {
  const int64_t G = pb.num_q_heads / pb.num_kv_heads;
  const int64_t D = pb.head_dim;
  const bool amx_tiles = prompts_on_amx<T>(pb);
  const int64_t max_tile = std::max<int64_t>(1, (amx_tiles ? kAmxTileRows : kTileRows) / G);
  const int64_t rows = (max_tile * G + kRowBlock - 1) / kRowBlock * kRowBlock;
  const int64_t scratch_size = std::max(2 * G * D + G * pb.block_size + 2 * G,
                                        2 * rows * D + D * pb.block_size + rows * pb.block_size + 2 * rows);
  const int64_t bs = pb.block_size;
  auto item_fn = D == 32 ? pick_group<T, 32>(G, bs) : D == 64 ? pick_group<T, 64>(G, bs)
               : D == 80 ? pick_group<T, 80>(G, bs) : D == 96 ? pick_group<T, 96>(G, bs)
               : D == 128 ? pick_group<T, 128>(G, bs) : D == 256 ? pick_group<T, 256>(G, bs)
                          : pick_group<T, 0>(G, bs);
  auto tile_fn = D == 32 ? pick_tile<T, 32>(bs) : D == 64 ? pick_tile<T, 64>(bs) : D == 80 ? pick_tile<T, 80>(bs)
               : D == 96 ? pick_tile<T, 96>(bs) : D == 128 ? pick_tile<T, 128>(bs) : D == 256 ? pick_tile<T, 256>(bs)
                         : pick_tile<T, 0>(bs);
  if (D > 256 || pb.block_size > 128) tile_fn = nullptr;  // beyond the tile's stack buffers: token by token

  // Runs of consecutive positions of one sequence (prompt chunks) become tiles, listed first: they are the
  // expensive items, and handing them out first balances the threads. Single tokens (decodes) follow, those
  // seeing more than kSplitKeys keys as parts of kSplitKeys keys each.
  const int64_t split_pages = std::max<int64_t>(1, kSplitKeys / bs);
  std::vector<Item> items;
  std::vector<Item> singles;
  std::vector<SplitToken> splits;
  int64_t num_parts = 0;
  for (int64_t t = 0; t < pb.num_tokens;) {
    const int32_t seq = pb.token_seq_ids[t];
    const bool valid = seq >= 0 && seq < pb.num_seqs && pb.positions[t] >= 0;
    int64_t count = 1;
    // A run continues while the positions do: the engine's padding tokens carry sequence 0 at position 0,
    // and joined to a decode of sequence 0 they would turn it into a tile of mostly idle rows.
    while (valid && (tile_fn || amx_tiles) && count < max_tile && t + count < pb.num_tokens &&
           pb.token_seq_ids[t + count] == seq && pb.positions[t + count] == pb.positions[t + count - 1] + 1)
      ++count;
    const int64_t end = valid ? static_cast<int64_t>(pb.positions[t]) + 1 : 0;
    const int64_t first_page = (pb.window > 0 ? std::max<int64_t>(0, end - pb.window) : 0) / bs;
    const int64_t pages = (end + bs - 1) / bs - first_page;
    for (int64_t h = 0; h < pb.num_kv_heads; ++h) {
      if (count > 1) {
        items.push_back({t, count, h});
      } else if (pages > split_pages) {
        const int64_t parts = (pages + split_pages - 1) / split_pages;
        splits.push_back({t, h, num_parts, parts});
        for (int64_t p = 0; p < parts; ++p)  // equal shares, so no part is a sliver
          singles.push_back({t, 1, h, first_page + pages * p / parts, first_page + pages * (p + 1) / parts,
                             num_parts + p});
        num_parts += parts;
      } else {
        singles.push_back({t, 1, h});
      }
    }
    t += count;
  }
  items.insert(items.end(), singles.begin(), singles.end());
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t part_stride = G * D + 2 * G;
  std::vector<float> partials(num_parts * part_stride);
  // Parts are long: handed out one at a time, each worth waking a helper for.
  const int64_t chunk = num_parts > 0 ? 1 : kItemChunk;
  const int64_t max_helpers = num_parts > 0 ? num_items : num_items / 8;

  // The first pages of decode item i, to be requested by the item before it.
  auto first_pages = [&](int64_t i) {
    const Item& it = items[i];
    const int32_t seq = pb.token_seq_ids[it.first];
    const int64_t end = static_cast<int64_t>(pb.positions[it.first]) + 1;
    if (it.count != 1 || seq < 0 || seq >= pb.num_seqs || end <= 0) return NextPages{};
    const int64_t first = std::max((pb.window > 0 ? std::max<int64_t>(0, end - pb.window) : 0) / bs, it.page_begin);
    const int64_t last = std::min((end + bs - 1) / bs, it.page_end);
    return NextPages{pb.page_tables + seq * pb.pages_per_seq + first,
                     (static_cast<int64_t>(pb.layer) * pb.num_kv_heads + it.head) * pb.num_blocks,
                     std::min<int64_t>(kTrickleDistance, last - first)};
  };

  // One scratch buffer per thread that runs items (thread_local: XLA's pool threads are long-lived).
  auto run_item = [&](int64_t i) {
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < scratch_size) scratch.resize(scratch_size);
    const Item& it = items[i];
    // Items are handed out `chunk` at a time, so within a chunk this thread runs item i + 1 next.
    const bool next_is_ours = i + 1 < num_items && (i + 1) % chunk != 0;
    if (it.count == 1) {
      const Span span{it.page_begin, it.page_end, it.part >= 0 ? partials.data() + it.part * part_stride : nullptr};
      item_fn(pb, q, k, v, out, it.first, it.head, scratch.data(), next_is_ours ? first_pages(i + 1) : NextPages{},
              span);
    } else if constexpr (std::is_same_v<T, uint16_t>) {
      amx_tiles ? attend_tile_amx(pb, q, k, v, out, it.first, it.count, it.head)
                : tile_fn(pb, q, k, v, out, it.first, it.count, it.head, scratch.data());
    } else {
      tile_fn(pb, q, k, v, out, it.first, it.count, it.head, scratch.data());
    }
  };
  // Helpers only when there are enough items to pay for waking them.
  paged::run_parallel(pool, num_items, chunk, max_helpers, run_item);
  for (const SplitToken& split : splits)
    combine_parts(pb, out, split.token, split.head, partials.data() + split.first_part * part_stride,
                  split.num_parts);
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                              ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> layer,
                              ffi::Buffer<ffi::S32> page_tables, ffi::Buffer<ffi::S32> token_seq_ids,
                              ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> window, float scale,
                              float soft_cap, ffi::Result<ffi::AnyBuffer> out) {
  const auto qd = q.dimensions();
  const auto kd = k_cache.dimensions();
  const auto pd = page_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || pd.size() != 2)
    return ffi::Error::InvalidArgument("paged_attention_cpu: q must be rank 3, the pools rank 5, page_tables rank 2");
  if (q.element_type() != k_cache.element_type() || q.element_type() != v_cache.element_type() ||
      q.element_type() != out->element_type())
    return ffi::Error::InvalidArgument("paged_attention_cpu: q, the pools and the output must share a dtype");
  Problem pb{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], kd[3], pd[0], pd[1],
             layer.typed_data()[0], window.typed_data()[0], scale, soft_cap,
             page_tables.typed_data(), token_seq_ids.typed_data(), positions.typed_data()};
  if (kd[4] != pb.head_dim || pb.num_q_heads % pb.num_kv_heads)
    return ffi::Error::InvalidArgument("paged_attention_cpu: head_dim or head counts do not match");
  if (pb.layer < 0 || pb.layer >= pb.num_layers)
    return ffi::Error::InvalidArgument("paged_attention_cpu: layer index out of range");
  // Page ids come from the block manager; a corrupt table must not read outside the pool.
  for (int64_t i = 0; i < pb.num_seqs * pb.pages_per_seq; ++i) {
    if (pb.page_tables[i] < 0 || pb.page_tables[i] >= pb.num_blocks)
      return ffi::Error::InvalidArgument("paged_attention_cpu: page table entry outside the pool");
  }
  for (int64_t t = 0; t < pb.num_tokens; ++t) {
    const int32_t seq = pb.token_seq_ids[t];
    if (seq >= 0 && seq < pb.num_seqs && pb.positions[t] >= pb.pages_per_seq * pb.block_size)
      return ffi::Error::InvalidArgument("paged_attention_cpu: a position lies past its page table");
  }
  switch (q.element_type()) {
    case ffi::DataType::F32:
      run(pb, q.typed_data<float>(), k_cache.typed_data<float>(), v_cache.typed_data<float>(),
          out->typed_data<float>(), &pool);
      break;
    case ffi::DataType::BF16:
      run(pb, reinterpret_cast<const uint16_t*>(q.untyped_data()),
          reinterpret_cast<const uint16_t*>(k_cache.untyped_data()),
          reinterpret_cast<const uint16_t*>(v_cache.untyped_data()),
          reinterpret_cast<uint16_t*>(out->untyped_data()), &pool);
      break;
    default:
      return ffi::Error::InvalidArgument("paged_attention_cpu: dtype must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionCpu, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::AnyBuffer>());

// Whether bfloat16 prompt tiles run on AMX here (pages of 16, head_dim a multiple of 32: prompts_on_amx).
extern "C" int PromptAttentionUsesAmx() { return paged::amx::AttendsPrompts() && paged::amx::Available(); }
