// Prompt attention on AMX tiles: one KV head's attention for a run of tokens of one sequence (amx.h: PromptRun).
//
// Why: a prompt chunk's QK^T and PV are matmuls (rows = tokens x the group's query heads), and the float32 FMA
// tiles of paged_attention.cc ran them at ~100 GFLOP/s on the benchmark CPU, 27% of a 500-token prompt step
// at the 0.5B shape. TDPBF16PS does a 16 x 16 x 32 product in 16 cycles.
//
// Plan. The run's keys are walked in segments of 16 pages (256 keys). A segment's pages are packed once for
// every row of the run: K as B tiles (the 16 x 16 transpose of a page's (d, d + 1) pairs: S = Q K^T comes out
// with a row per query row) and V as B tiles of key pairs (O += P V). Then, 32 query rows at a time:
//   S [32, 256]  = Q K^T     2 x 2 C tiles per two pages, Q's A tiles packed once per run
//   softmax      row by row in float32 (scores are left unscaled by the tiles: scale x log2(e) is applied
//                in one FMA before a base-2 exp), running max m and sum l per row; P rounded to bfloat16
//   O [32, D]   += P V       2 x 2 C tiles per 32 columns of D, O waiting in float32 between segments
// A row's O is rescaled only when a later segment raises its max. Keys no row of the run can see (past the
// context, before the window) are zeros in V's tiles: pages past a sequence's end hold stale values, maybe
// NaN, and 0 x NaN would still poison a row.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "amx_tiles.h"

namespace paged::amx {

#if defined(PAGED_AMX) && defined(__AVX512BF16__)
namespace {

constexpr int64_t kPage = 16;           // keys per page, one C tile's columns of S
constexpr int64_t kSegmentPages = 16;   // pages packed together
constexpr int64_t kSegmentKeys = kSegmentPages * kPage;
constexpr int64_t kBlockKeys = 32;      // keys per PV tile step: two pages
constexpr int64_t kPassRows = 32;       // query rows per pass: two A tiles

// Transposes 16 x 16 dwords in registers: four rounds, round b swapping bit b of the row index with bit b of
// the column index between rows i and i + b.
struct TransposeIndex {
  alignas(64) int32_t low[4][16];
  alignas(64) int32_t high[4][16];
};
constexpr TransposeIndex make_transpose_index() {
  TransposeIndex index{};
  for (int round = 0; round < 4; ++round) {
    const int b = 1 << round;
    for (int j = 0; j < 16; ++j) {
      index.low[round][j] = (j & b) ? 16 + j - b : j;
      index.high[round][j] = (j & b) ? 16 + j : j + b;
    }
  }
  return index;
}
constexpr TransposeIndex kTranspose = make_transpose_index();

inline void transpose16(__m512i v[16]) {
  for (int round = 0; round < 4; ++round) {
    const int b = 1 << round;
    const __m512i low = _mm512_load_si512(kTranspose.low[round]);
    const __m512i high = _mm512_load_si512(kTranspose.high[round]);
    for (int i = 0; i < 16; ++i) {
      if (i & b) continue;
      const __m512i top = v[i], bottom = v[i + b];
      v[i] = _mm512_permutex2var_epi32(top, low, bottom);
      v[i + b] = _mm512_permutex2var_epi32(top, high, bottom);
    }
  }
}

// 2^t for t <= 0 in every lane (t below -126 gives ~0): 2^round(t) times a degree-5 Taylor polynomial of
// 2^f, |f| <= 1/2, relative error below 3e-6. The probabilities are rounded to bfloat16 (2^-9) after this,
// so more terms would buy nothing.
inline __m512 exp2_nonpositive(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);  // ln(2)^k / k!, k = 5 .. 0
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Keys [lo, hi) of the 16 starting at key0, as a lane mask.
inline __mmask16 visible_keys(int64_t lo, int64_t hi, int64_t key0) {
  const int64_t a = std::clamp<int64_t>(lo - key0, 0, 16), b = std::clamp<int64_t>(hi - key0, 0, 16);
  return a >= b ? 0 : static_cast<__mmask16>(((1u << b) - 1u) & ~((1u << a) - 1u));
}

// K's B tiles of one page for S = Q K^T: [head_dim / 32][16 pairs (d, d + 1)][16 keys][2]. page: [16, D].
void pack_keys(const uint16_t* page, int64_t D, uint16_t* out) {
  for (int64_t s = 0; s < D / 32; ++s) {
    __m512i v[16];
    for (int n = 0; n < 16; ++n) v[n] = _mm512_loadu_si512(page + n * D + 32 * s);
    transpose16(v);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + s * kTileWords + i * 32, v[i]);
  }
}

// V's B tiles of 32 keys (two pages; `second` null: past the run's pages) for O += P V:
// [head_dim / 16][16 key pairs][16 d][2]. Keys outside [lo, hi) (numbered from the first page's key0) are zeros.
void pack_values(const uint16_t* first, const uint16_t* second, int64_t D, int64_t key0, int64_t lo, int64_t hi,
                 uint16_t* out) {
  const __m512i low = _mm512_load_si512(kPairLow), high = _mm512_load_si512(kPairHigh);
  for (int64_t pair = 0; pair < 16; ++pair) {
    const int64_t j = 2 * pair;  // keys j and j + 1 of the block, on one page
    const uint16_t* page = j < kPage ? first : second;
    const bool a_real = page && key0 + j >= lo && key0 + j < hi;
    const bool b_real = page && key0 + j + 1 >= lo && key0 + j + 1 < hi;
    const uint16_t* a_row = page ? page + (j % kPage) * D : nullptr;
    for (int64_t h = 0; h < D / 32; ++h) {
      const __m512i a = a_real ? _mm512_loadu_si512(a_row + 32 * h) : _mm512_setzero_si512();
      const __m512i b = b_real ? _mm512_loadu_si512(a_row + D + 32 * h) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + (2 * h) * kTileWords + pair * 32, _mm512_permutex2var_epi16(a, low, b));
      _mm512_storeu_si512(out + (2 * h + 1) * kTileWords + pair * 32, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

// Per-thread buffers, grown to the largest run seen.
struct Scratch {
  TileVector<uint16_t> q;     // [passes][D / 32][2][16 rows][32]: Q's A tiles
  TileVector<uint16_t> keys;  // [kSegmentPages][D / 32][512]: the segment's K tiles
  TileVector<uint16_t> vals;  // [kSegmentPages / 2][D / 16][512]: the segment's V tiles
  TileVector<float> s;        // [kPassRows][kSegmentKeys]: a pass's scores
  TileVector<uint16_t> p;     // [kPassRows][kSegmentKeys]: its probabilities, bfloat16
  TileVector<float> o;        // [rows][D]: the accumulators
  TileVector<float> m, l;     // [rows]: running max (of unscaled scores) and sum
};

// The keys [lo, hi) that some row among tokens [first, last] sees.
void visible_range(const PromptRun& run, int64_t first, int64_t last, int64_t& lo, int64_t& hi) {
  lo = INT64_MAX, hi = 0;
  for (int64_t i = first; i <= last; ++i) {
    const int64_t end = static_cast<int64_t>(run.positions[i]) + 1;
    hi = std::max(hi, end);
    lo = std::min(lo, run.window > 0 ? std::max<int64_t>(0, end - run.window) : 0);
  }
}

// S = Q K^T for one pass (rows [32 pass, +32)) over blocks [b0, b1) of the segment.
void scores(const uint16_t* q_tiles, const uint16_t* k_tiles, float* s, int64_t steps, int64_t b0, int64_t b1) {
  constexpr int64_t stride = kSegmentKeys * sizeof(float);
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* k0 = k_tiles + 2 * b * steps * kTileWords;
    const uint16_t* k1 = k0 + steps * kTileWords;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t t = 0; t < steps; ++t) {
      _tile_loadd(4, q_tiles + 2 * t * kTileWords, 64);
      _tile_loadd(5, q_tiles + (2 * t + 1) * kTileWords, 64);
      _tile_loadd(6, k0 + t * kTileWords, 64);
      _tile_loadd(7, k1 + t * kTileWords, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    float* block = s + b * kBlockKeys;
    _tile_stored(0, block, stride);
    _tile_stored(1, block + kPage, stride);
    _tile_stored(2, block + 16 * kSegmentKeys, stride);
    _tile_stored(3, block + 16 * kSegmentKeys + kPage, stride);
  }
}

// O += P V for one pass over blocks [b0, b1) of the segment; o: the pass's first row (stride D).
void weighted_values(const uint16_t* p, const uint16_t* v_tiles, float* o, int64_t D, int64_t b0, int64_t b1) {
  const int64_t stride = D * sizeof(float), chunks = D / 16;
  constexpr int64_t p_stride = kSegmentKeys * sizeof(uint16_t);
  for (int64_t c = 0; c < chunks; c += 2) {
    float* oc = o + 16 * c;
    _tile_loadd(0, oc, stride);
    _tile_loadd(1, oc + 16, stride);
    _tile_loadd(2, oc + 16 * D, stride);
    _tile_loadd(3, oc + 16 * D + 16, stride);
    for (int64_t b = b0; b < b1; ++b) {
      _tile_loadd(4, p + b * kBlockKeys, p_stride);
      _tile_loadd(5, p + 16 * kSegmentKeys + b * kBlockKeys, p_stride);
      _tile_loadd(6, v_tiles + (b * chunks + c) * kTileWords, 64);
      _tile_loadd(7, v_tiles + (b * chunks + c + 1) * kTileWords, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, oc, stride);
    _tile_stored(1, oc + 16, stride);
    _tile_stored(2, oc + 16 * D, stride);
    _tile_stored(3, oc + 16 * D + 16, stride);
  }
}

// The online softmax of one row over the segment's keys [x0, x1) (multiples of 32, from the segment's key0):
// updates m and l, rescales the row's O when its max rises, and writes the row's probabilities as bfloat16.
void softmax_row(const float* s, uint16_t* p, float* o, int64_t D, float& m, float& l, float scale_log2,
                 int64_t key0, int64_t x0, int64_t x1, int64_t lo, int64_t hi) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t x = x0; x < x1; x += 16)
    top = _mm512_mask_max_ps(top, visible_keys(lo, hi, key0 + x), top, _mm512_loadu_ps(s + x));
  const float m_new = std::max(m, _mm512_reduce_max_ps(top));
  if (m_new == -INFINITY) {  // nothing visible yet
    std::fill(p + x0, p + x1, uint16_t{0});
    return;
  }
  const __m512 c = _mm512_set1_ps(scale_log2), offset = _mm512_set1_ps(m_new * scale_log2);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t x = x0; x < x1; x += 32) {
    const __m512 p0 = _mm512_maskz_mov_ps(visible_keys(lo, hi, key0 + x),
                                          exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + x), c, offset)));
    const __m512 p1 = _mm512_maskz_mov_ps(visible_keys(lo, hi, key0 + x + 16),
                                          exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + x + 16), c, offset)));
    sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
    _mm512_storeu_si512(p + x, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));
  }
  const float correction = m == -INFINITY ? 0.0f : std::exp2((m - m_new) * scale_log2);
  if (correction != 1.0f && m != -INFINITY) {
    const __m512 k = _mm512_set1_ps(correction);
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), k));
  }
  l = l * correction + _mm512_reduce_add_ps(sum);
  m = m_new;
}

}  // namespace

bool AttendsPrompts() { return true; }

void AttendPrompt(const PromptRun& run) {
  const int64_t D = run.head_dim, G = run.group, steps = D / 32;
  const int64_t rows = run.tokens * G, passes = (rows + kPassRows - 1) / kPassRows;
  thread_local Scratch buf;
  buf.q.resize(passes * kPassRows * D);
  buf.keys.resize(kSegmentPages * steps * kTileWords);
  buf.vals.resize(kSegmentPages / 2 * (D / 16) * kTileWords);
  buf.s.resize(kPassRows * kSegmentKeys);
  buf.p.resize(kPassRows * kSegmentKeys);
  buf.o.assign(passes * kPassRows * D, 0.0f);
  buf.m.assign(passes * kPassRows, -INFINITY);
  buf.l.assign(passes * kPassRows, 0.0f);

  // Q's A tiles: row r of pass r / 32 at [pass][step][r % 32 / 16][r % 16], zeros past the last row.
  for (int64_t r = 0; r < passes * kPassRows; ++r) {
    const uint16_t* row = r < rows ? run.q + (r / G) * run.token_stride + (r % G) * D : nullptr;
    uint16_t* tiles = buf.q.data() + (r / kPassRows) * steps * 2 * kTileWords + (r % kPassRows) * 32;
    for (int64_t t = 0; t < steps; ++t)
      _mm512_storeu_si512(tiles + t * 2 * kTileWords, row ? _mm512_loadu_si512(row + 32 * t) : _mm512_setzero_si512());
  }
  int64_t lo, hi;  // keys some row sees
  visible_range(run, 0, run.tokens - 1, lo, hi);
  const float scale_log2 = run.scale * 1.44269504088896341f;
  configure_tiles();
  const int64_t first_page = lo / kPage, end_page = (hi + kPage - 1) / kPage;
  for (int64_t seg = first_page; seg < end_page; seg += kSegmentPages) {
    const int64_t seg_pages = std::min(kSegmentPages, end_page - seg), key0 = seg * kPage;
    for (int64_t i = 0; i < (seg_pages + 1) / 2 * 2; ++i) {
      uint16_t* out = buf.keys.data() + i * steps * kTileWords;
      if (i < seg_pages)
        pack_keys(run.k_head + run.pages[seg + i] * kPage * D, D, out);
      else  // the second page of the last block: its scores are masked, but NaN bits would still be read
        std::fill(out, out + steps * kTileWords, uint16_t{0});
    }
    for (int64_t b = 0; b < (seg_pages + 1) / 2; ++b) {
      const int64_t page = seg + 2 * b;
      pack_values(run.v_head + run.pages[page] * kPage * D,
                  2 * b + 1 < seg_pages ? run.v_head + run.pages[page + 1] * kPage * D : nullptr, D,
                  page * kPage, lo, hi, buf.vals.data() + b * (D / 16) * kTileWords);
    }
    for (int64_t pass = 0; pass < passes; ++pass) {
      const int64_t r0 = pass * kPassRows, r1 = std::min(rows, r0 + kPassRows);
      int64_t pass_lo, pass_hi;
      visible_range(run, r0 / G, (r1 - 1) / G, pass_lo, pass_hi);
      const int64_t x_lo = std::max(pass_lo, key0) - key0, x_hi = std::min(pass_hi, key0 + seg_pages * kPage) - key0;
      if (x_lo >= x_hi) continue;  // this pass sees none of the segment
      const int64_t b0 = x_lo / kBlockKeys, b1 = (x_hi + kBlockKeys - 1) / kBlockKeys;
      scores(buf.q.data() + pass * steps * 2 * kTileWords, buf.keys.data(), buf.s.data(), steps, b0, b1);
      for (int64_t r = r0; r < r0 + kPassRows; ++r) {
        uint16_t* p_row = buf.p.data() + (r - r0) * kSegmentKeys;
        if (r >= rows) {
          std::fill(p_row + b0 * kBlockKeys, p_row + b1 * kBlockKeys, uint16_t{0});
          continue;
        }
        const int64_t end = static_cast<int64_t>(run.positions[r / G]) + 1;
        const int64_t start = run.window > 0 ? std::max<int64_t>(0, end - run.window) : 0;
        softmax_row(buf.s.data() + (r - r0) * kSegmentKeys, p_row, buf.o.data() + r * D, D, buf.m[r], buf.l[r],
                    scale_log2, key0, b0 * kBlockKeys, b1 * kBlockKeys, start, end);
      }
      weighted_values(buf.p.data(), buf.vals.data(), buf.o.data() + r0 * D, D, b0, b1);
    }
  }
  _tile_release();

  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* out = run.out + (r / G) * run.token_stride + (r % G) * D;
    const __m512 inv = _mm512_set1_ps(buf.l[r] > 0.0f ? 1.0f / buf.l[r] : 0.0f);
    const float* o = buf.o.data() + r * D;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(o + d), inv), b = _mm512_mul_ps(_mm512_loadu_ps(o + d + 16), inv);
      _mm512_storeu_si512(out + d, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
    }
  }
}

#else

bool AttendsPrompts() { return false; }

void AttendPrompt(const PromptRun&) {}

#endif

}  // namespace paged::amx
