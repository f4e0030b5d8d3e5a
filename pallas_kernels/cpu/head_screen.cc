// The greedy tied LM head read at half its bytes: an int8 copy of the table screens every row, and only the
// rows that could still be the maximum are summed exactly (head_screen.h: ScreenedArgmax).
//
// Why: at decode sizes the fused greedy head (amx.cc or transposed.cc: MatmulTransposedArgmax) reads the whole
// bfloat16 table every step: 272 MB at the 0.5B shape, about 40% of an int4 model's step. The screen reads 136
// MB of int8 codes.
//
// Exactness. For row m of x and table row n the full walk gives y[m, n], the float32 sum of the bfloat16
// products. The screen gives s = tau_m * sigma_n * (codes(x_m) . codes(w_n)), the exact int32 product of the
// two int8 copies times their scales, and a bound e with |y - s| <= e:
//   |x.w - x^.w^| <= ||x|| ||w - w^|| + ||x - x^|| ||w^||   (Cauchy-Schwarz on x.(w - w^) + (x - x^).w^)
//   |y - x.w|     <= gamma_K ||x|| ||w||                      (K float32 additions of exact products, in any
//                                                              order: the tiles' and vdpbf16ps's alike)
// plus s's own two roundings and those of s +- e (each below 2^-23 |s| <= 2^-23 ||x^|| ||w^||: charged to the
// ||w^|| term), the rounding of e (its per-row factors carry a relative 2^-20 over), and flushed denormals (an
// absolute floor). Per table row the loader keeps sigma_n, ||w^_n|| and ||w_n - w^_n|| + gamma_K ||w_n||
// (rounded up: pallas_kernels/cpu: greedy_screen); per row of x the call computes tau, ||x|| and ||x - x^|| in
// float64. The first maximum of y lies among the rows whose s + e reaches the largest s - e of the row (a
// maximum is at least every other row's lower bound), so the union of those candidates, summed with the full
// walk's own arithmetic, holds every maximum of every row at its exact value, and the first maximum among them
// is the full walk's answer. Where a bound could overflow, x is not finite, or the candidates outgrow their
// room, the call takes the full walk instead.
//
// Two ways to the int32 products, by what the CPU has:
// - AMX-INT8: the codes are B tiles in the order the walk reads them, x's codes the A tiles (row-major, 32 rows
//   a chunk); C tile (t, h) holds x rows 16 t.., table rows 16 h.., so each row of x reads its 16 table rows'
//   sums as one vector. The candidates are summed with the full walk's tile steps (amx_head.h).
// - AVX-512 VNNI (CPUs without AMX): the same bytes are what vpdpbusd takes. A 64-byte run (b, s, h, q) holds
//   four k of 16 table rows, one row a 32-bit lane, so one vpdpbusd against x's four codes at those k
//   (broadcast) adds to each table row's sum in its own lane: 16 rows' sums in one vector, no reduction. It
//   multiplies unsigned by signed bytes, so the table's codes go in offset by 128 (their sign bit flipped as
//   they are loaded), and 128 * sum(x's codes) comes off each sum. The candidates are summed with
//   transposed.cc's block walk (ArgmaxAmong).
//
// Layout (head_screen.h: ScreenTable): [N32 / 32][K64 / 64 steps][2 halves][16 quads][16 rows][4], byte (b, s, h,
// q, j, e) = code of w[32 b + 16 h + j, 64 s + 4 q + e], zeros past N and K.

#include "head_screen.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "amx.h"
#include "amx_tiles.h"
#include "bf16.h"
#include "lane_argmax.h"
#include "parallel.h"
#include "transposed.h"
#include "vnni.h"

#if defined(PAGED_AMX) && defined(__AMX_INT8__)
#include "amx_head.h"
#define PAGED_SCREEN_AMX 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define PAGED_SCREEN_VNNI 1
#endif

namespace paged::screen {

// A float not below v (v >= 0): what the screen's bounds are rounded with, where it is built and where x's part
// is formed.
namespace {
inline float rounded_up(double v) { return static_cast<float>(v * (1.0 + 0x1p-20)); }
}  // namespace

#if defined(PAGED_SCREEN_AMX) || defined(PAGED_SCREEN_VNNI)
namespace {

constexpr int64_t kBlockRows = 32;     // table rows a block: two halves of 16
constexpr int64_t kStep = 64;          // int8 k a step: a tile step, or 16 quads of four
constexpr int64_t kHalfBytes = 1024;   // a half block's step: 16 quads x 16 rows x 4
constexpr int64_t kCapacity = 1024;    // candidates a thread keeps for a row of x before compacting them
constexpr int64_t kRefreshBlocks = 4;  // blocks between refreshes of each row's threshold
// The most rows of x the VNNI screen takes: beyond, it cost what the full head does (random 0.5B-shaped table:
// 32 rows 1.5x faster than the full head, 48 rows 0.9x, 128 rows 0.9x). Measured while the compiler still
// spilled vpdpbusd's accumulators (vnni.h), which the products at many rows paid for most.
constexpr int64_t kVnniMaxRows = 32;

using amx::TileVector;

// What a row of x brings to the bound: s = scale * sigma_n * I, e = norm * b_n + residual * a_n + floor, the
// three factors carrying every slack (screen_row); code_sum, the sum of its codes (VNNI's offset).
struct RowScreen {
  float scale, norm, residual, floor;
  int32_t code_sum;
};

// Row m of x as int8 codes (K64 bytes, zeros past K) and its screen; false when x is not finite or a bound
// could overflow.
bool screen_row(const uint16_t* x, int64_t K, int64_t K64, const ScreenTable& table, int8_t* codes,
                RowScreen& row) {
  float peak = 0.0f;
  for (int64_t k = 0; k < K; ++k) peak = std::max(peak, std::fabs(bf16_to_float(x[k])));
  if (!std::isfinite(peak)) return false;
  const float scale = peak / 127.0f;
  double norm = 0.0, residual = 0.0;
  int32_t code_sum = 0;
  std::memset(codes, 0, K64);
  for (int64_t k = 0; k < K; ++k) {
    const double v = bf16_to_float(x[k]);
    const float code = scale > 0.0f ? std::clamp(std::nearbyint(static_cast<float>(v) / scale), -127.0f, 127.0f) : 0.0f;
    codes[k] = static_cast<int8_t>(code);
    code_sum += codes[k];
    const double rest = v - static_cast<double>(scale) * code;
    norm += v * v;
    residual += rest * rest;
  }
  norm = std::sqrt(norm);
  if (!(norm * table.norm_max <= 0x1p100)) return false;
  // ||x^|| <= ||x|| + ||x - x^||: s's roundings and those of s +- e, 2^-21 ||x^|| in all, join x - x^'s factor.
  const double residual_norm = std::sqrt(residual), coded_norm = norm + residual_norm;
  // Flushed denormals: a product with a denormal factor (< 2^-126 times the other's peak) and a sum flushed
  // to zero, at most one each a step; 2^-80 for the float32 epilogue's own underflows.
  row = RowScreen{scale, rounded_up(norm), rounded_up(residual_norm + 0x1p-21 * coded_norm),
                  rounded_up(0x1p-80 + K * 0x1p-125 * (1.0 + peak + table.peak)), code_sum};
  return true;
}

// A thread's candidates for one row of x: table rows whose upper bound reached the threshold when seen. The
// row with the largest lower bound is always among them (its upper bound is above every lower one), so the
// candidates' lower bounds are enough to raise the threshold.
struct Candidates {
  __m512 lower_max;      // per lane, the largest lower bound among the candidates
  float threshold;       // the largest lower bound when last refreshed
  int64_t count;
  int32_t* rows;
  float* upper;
};

float lanes_max(__m512 v) { return _mm512_reduce_max_ps(v); }

// Keeps only the candidates whose upper bound reaches the refreshed threshold.
void compact(Candidates& c) {
  c.threshold = lanes_max(c.lower_max);
  int64_t kept = 0;
  for (int64_t i = 0; i < c.count; ++i)
    if (c.upper[i] >= c.threshold) c.rows[kept] = c.rows[i], c.upper[kept++] = c.upper[i];
  c.count = kept;
}

struct ThreadScreen {
  std::vector<Candidates> rows;
  TileVector<int32_t> row_ids;
  TileVector<float> uppers;
  bool overflow = false;
};

// The table's factors for its 16 rows from `first` (a half block), loaded once for every row of x.
struct HalfRows {
  int32_t first;
  __mmask16 valid;  // rows below table.rows
  __m512 sigma, code_norm, slack;
};

HalfRows half_rows(const ScreenTable& table, int64_t first) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const int64_t N32 = table.padded_rows;
  return HalfRows{static_cast<int32_t>(first),
                  _mm512_cmp_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(first))),
                                        _mm512_set1_epi32(static_cast<int32_t>(table.rows)), _MM_CMPINT_LT),
                  _mm512_loadu_ps(table.stats + first), _mm512_loadu_ps(table.stats + N32 + first),
                  _mm512_loadu_ps(table.stats + 2 * N32 + first)};
}

// One row of x's 16 int32 products with a half block's rows into its candidates: those whose upper bound
// reaches the row's threshold.
inline void consider(__m512i products, const HalfRows& half, const RowScreen& xr, Candidates& cand, bool& overflow) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 sum = _mm512_cvtepi32_ps(products);
  const __m512 s = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(xr.scale), half.sigma), sum);
  const __m512 e = _mm512_fmadd_ps(_mm512_set1_ps(xr.norm), half.slack,
                                   _mm512_fmadd_ps(_mm512_set1_ps(xr.residual), half.code_norm,
                                                   _mm512_set1_ps(xr.floor)));
  const __m512 upper = _mm512_add_ps(s, e);
  const __mmask16 keep = _mm512_mask_cmp_ps_mask(half.valid, upper, _mm512_set1_ps(cand.threshold), _CMP_GE_OQ);
  if (!keep) return;
  cand.lower_max = _mm512_mask_max_ps(cand.lower_max, keep, cand.lower_max, _mm512_sub_ps(s, e));
  if (cand.count + 16 > kCapacity) {
    compact(cand);
    if (cand.count > kCapacity / 2) overflow = true, cand.count = 0;
  }
  _mm512_mask_compressstoreu_epi32(cand.rows + cand.count, keep, _mm512_add_epi32(lane, _mm512_set1_epi32(half.first)));
  _mm512_mask_compressstoreu_ps(cand.upper + cand.count, keep, upper);
  cand.count += __builtin_popcount(keep);
}

inline void refresh_thresholds(ThreadScreen& own, int64_t M) {
  for (int64_t m = 0; m < M; ++m) own.rows[m].threshold = lanes_max(own.rows[m].lower_max);
}

#if defined(PAGED_SCREEN_AMX)
// Table rows [n_begin, n_end) (whole blocks) against every row of x on AMX-INT8 tiles: each row's candidates
// into `own`.
void screen_rows_amx(const ScreenTable& table, const int8_t* x_codes, const RowScreen* x_rows, int64_t M,
                     int64_t K64, int64_t n_begin, int64_t n_end, ThreadScreen& own) {
  amx::configure_tiles();
  const int64_t steps = K64 / kStep, block_bytes = steps * 2 * kHalfBytes, chunks = (M + 31) / 32;
  alignas(64) int32_t sums[4][16][16];
  for (int64_t n0 = n_begin, block = 0; n0 < n_end; n0 += kBlockRows, ++block) {
    const int8_t* b = table.codes + n0 / kBlockRows * block_bytes;
    const char* ahead = n0 + kBlockRows < n_end ? reinterpret_cast<const char*>(b + block_bytes) : nullptr;
    const HalfRows halves[2] = {half_rows(table, n0), half_rows(table, n0 + 16)};
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t rows_m = std::min<int64_t>(32, M - 32 * c);
      const int8_t* a = x_codes + 32 * c * K64;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t s = 0; s < steps; ++s) {
        // The next block into L2 during the first chunk, a step's share at a time; step s + 2 into L1.
        if (ahead && c == 0)
          for (int64_t i = 0; i < 2 * kHalfBytes / 64; ++i)
            _mm_prefetch(ahead + s * 2 * kHalfBytes + 64 * i, _MM_HINT_T1);
        if (s + 2 < steps)
          for (int64_t i = 0; i < 2 * kHalfBytes / 64; ++i)
            _mm_prefetch(reinterpret_cast<const char*>(b + (s + 2) * 2 * kHalfBytes) + 64 * i, _MM_HINT_T0);
        _tile_loadd(6, b + s * 2 * kHalfBytes, 64);
        _tile_loadd(7, b + s * 2 * kHalfBytes + kHalfBytes, 64);
        _tile_loadd(4, a + s * kStep, K64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        if (rows_m > 16) {
          _tile_loadd(5, a + 16 * K64 + s * kStep, K64);
          _tile_dpbssd(2, 5, 6);
          _tile_dpbssd(3, 5, 7);
        }
      }
      _tile_stored(0, sums[0], 64);
      _tile_stored(1, sums[1], 64);
      _tile_stored(2, sums[2], 64);
      _tile_stored(3, sums[3], 64);
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t r = 0; r < rows_m; ++r)
          consider(_mm512_load_si512(sums[2 * (r / 16) + h][r % 16]), halves[h], x_rows[32 * c + r],
                   own.rows[32 * c + r], own.overflow);
    }
    if (block % kRefreshBlocks == kRefreshBlocks - 1) refresh_thresholds(own, M);
  }
  _tile_release();
}

// tokens[m] = the first maximum of row m's exact sums over `rows` (ascending table rows that hold every
// maximum of every row), with the full walk's tile steps; the rows in 32-row groups, a run of groups a thread.
void exact_among_amx(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* w, int64_t M, int64_t K,
                     const std::vector<int32_t>& rows, int32_t* tokens) {
  using amx::kTileWords;
  namespace head = amx::head;
  const int64_t steps = K / head::kDepth, chunks = (M + head::kRows - 1) / head::kRows;
  TileVector<uint16_t> xb(chunks * steps * 2 * kTileWords);
  for (int64_t c = 0; c < chunks; ++c)
    head::pack_rows_as_pairs(x, M, K, c * head::kRows, xb.data() + c * steps * 2 * kTileWords);
  const int64_t groups = (static_cast<int64_t>(rows.size()) + 31) / 32;
  const int64_t parts = std::min(groups, std::max<int64_t>(1, pool.num_threads()));
  std::vector<std::vector<float>> best(parts, std::vector<float>(M, -INFINITY));
  std::vector<std::vector<int32_t>> first(parts, std::vector<int32_t>(M, rows.front()));
  run_parallel(&pool, parts, 1, parts - 1, [&](int64_t part) {
    amx::configure_tiles();
    TileVector<uint16_t> gathered(32 * K);
    alignas(64) head::TransposedBlock block;
    for (int64_t g = part * groups / parts * 32; g < (part + 1) * groups / parts * 32; g += 32) {
      const int64_t count = std::min<int64_t>(32, rows.size() - g);
      for (int64_t j = 0; j < 32; ++j)
        if (j < count) std::memcpy(gathered.data() + j * K, w + rows[g + j] * K, K * sizeof(uint16_t));
        else std::memset(gathered.data() + j * K, 0, K * sizeof(uint16_t));
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t rows_m = std::min(head::kRows, M - c * head::kRows);
        head::transposed_block(gathered.data(), xb.data() + c * steps * 2 * kTileWords, K, rows_m, nullptr, 0,
                               block);
        for (int64_t r = 0; r < rows_m; ++r)
          for (int64_t j = 0; j < count; ++j) {
            float v = block[2 * (j / 16) + r / 16][j % 16][r % 16];
            if (std::isnan(v)) v = INFINITY;  // as first_argmax
            const int64_t m = c * head::kRows + r;
            if (v > best[part][m]) best[part][m] = v, first[part][m] = rows[g + j];
          }
      }
    }
    _tile_release();
  });
  first_of_parts(best, first, M, tokens);
}
#endif

#if defined(PAGED_SCREEN_VNNI)
// Rows [0, MR) of x (codes at x, row stride K64) against both halves of a block (`b`, steps of 2 KB): the int32
// products into acc[r][h], table row 16 h + j in lane j. With `ahead`, the next block is requested into L2.
template <int MR>
inline void block_products_vnni(const int8_t* b, const int8_t* x, int64_t K64, const char* ahead, __m512i acc[MR][2]) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // signed code + 128, as vpdpbusd's unsigned
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  for (int64_t s = 0; s < K64 / kStep; ++s) {
    const int8_t* t = b + s * 2 * kHalfBytes;
    if (ahead)
      for (int64_t i = 0; i < 2 * kHalfBytes / 64; ++i) _mm_prefetch(ahead + s * 2 * kHalfBytes + 64 * i, _MM_HINT_T1);
    for (int64_t q = 0; q < 16; ++q) {
      const __m512i low = _mm512_xor_si512(_mm512_loadu_si512(t + 64 * q), flip);
      const __m512i high = _mm512_xor_si512(_mm512_loadu_si512(t + kHalfBytes + 64 * q), flip);
      for (int r = 0; r < MR; ++r) {
        int32_t quad;  // x's codes at k = 64 s + 4 q .. + 3
        std::memcpy(&quad, x + r * K64 + s * kStep + 4 * q, sizeof quad);
        const __m512i xq = _mm512_set1_epi32(quad);
        acc[r][0] = paged::dot_bytes(acc[r][0], low, xq);
        acc[r][1] = paged::dot_bytes(acc[r][1], high, xq);
      }
    }
  }
}

// The most rows of x a pass over a block keeps in registers: 2 accumulators a row, and the two table vectors.
constexpr int kVnniRows = 12;

template <int MR>
void pass_vnni(const int8_t* b, const int8_t* x_codes, const RowScreen* x_rows, int64_t m0, int64_t K64,
               const char* ahead, const HalfRows halves[2], ThreadScreen& own) {
  __m512i acc[MR][2];
  block_products_vnni<MR>(b, x_codes + m0 * K64, K64, ahead, acc);
  for (int r = 0; r < MR; ++r) {
    const RowScreen& xr = x_rows[m0 + r];
    const __m512i offset = _mm512_set1_epi32(128 * xr.code_sum);
    for (int h = 0; h < 2; ++h)
      consider(_mm512_sub_epi32(acc[r][h], offset), halves[h], xr, own.rows[m0 + r], own.overflow);
  }
}

template <int MR = kVnniRows>
void pass_vnni_rows(int64_t rows, const int8_t* b, const int8_t* x_codes, const RowScreen* x_rows, int64_t m0,
                    int64_t K64, const char* ahead, const HalfRows halves[2], ThreadScreen& own) {
  if constexpr (MR > 1)
    if (rows < MR) return pass_vnni_rows<MR - 1>(rows, b, x_codes, x_rows, m0, K64, ahead, halves, own);
  pass_vnni<MR>(b, x_codes, x_rows, m0, K64, ahead, halves, own);
}

// As screen_rows_amx, on AVX-512 VNNI: each block's rows of x in passes of up to kVnniRows rows (their sizes
// differing by one at most); the first pass requests the next block.
void screen_rows_vnni(const ScreenTable& table, const int8_t* x_codes, const RowScreen* x_rows, int64_t M,
                      int64_t K64, int64_t n_begin, int64_t n_end, ThreadScreen& own) {
  const int64_t block_bytes = K64 / kStep * 2 * kHalfBytes;
  const int64_t passes = (M + kVnniRows - 1) / kVnniRows;
  for (int64_t n0 = n_begin, block = 0; n0 < n_end; n0 += kBlockRows, ++block) {
    const int8_t* b = table.codes + n0 / kBlockRows * block_bytes;
    const char* ahead = n0 + kBlockRows < n_end ? reinterpret_cast<const char*>(b + block_bytes) : nullptr;
    const HalfRows halves[2] = {half_rows(table, n0), half_rows(table, n0 + 16)};
    for (int64_t p = 0, m0 = 0; p < passes; ++p) {
      const int64_t rows = (M - m0) / (passes - p);
      pass_vnni_rows(rows, b, x_codes, x_rows, m0, K64, p == 0 ? ahead : nullptr, halves, own);
      m0 += rows;
    }
    if (block % kRefreshBlocks == kRefreshBlocks - 1) refresh_thresholds(own, M);
  }
}
#endif

}  // namespace

bool Available() {
#if defined(PAGED_SCREEN_AMX)
  if (amx::Available()) return true;
#endif
#if defined(PAGED_SCREEN_VNNI)
  return true;
#else
  return false;
#endif
}

bool ScreenedArgmax(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* w, const ScreenTable& table,
                    int32_t* tokens, int64_t M, int64_t K) {
  if (!Available() || K % 32) return false;
  bool tiles = false;
#if defined(PAGED_SCREEN_AMX)
  tiles = amx::Available();
#endif
  auto full_walk = [&] {
#if defined(PAGED_SCREEN_AMX)
    if (tiles) return amx::MatmulTransposedArgmax(pool, x, w, tokens, M, K, table.rows);
#endif
    return avx512bf16::MatmulTransposedArgmax(pool, x, w, tokens, M, K, table.rows);
  };
  const int64_t K64 = (K + kStep - 1) / kStep * kStep, chunks = (M + 31) / 32;
  // vpdpbusd's sums of (code + 128) * x code stay within int32 up to K64 = 65,536 (255 * 127 * K64 < 2^31).
  if (!tiles && (K64 > 65536 || M > kVnniMaxRows)) return full_walk();
  thread_local TileVector<int8_t> x_codes;  // (a thread_local is each thread's own: helpers get its data())
  x_codes.assign(chunks * 32 * K64, 0);
  const int8_t* codes = x_codes.data();
  std::vector<RowScreen> x_rows(chunks * 32);
  bool screened = true;
  for (int64_t m = 0; m < M && screened; ++m)
    screened = screen_row(x + m * K, K, K64, table, x_codes.data() + m * K64, x_rows[m]);
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // Kept from call to call on the calling thread (every greedy step comes here): the candidate lists of 64 rows
  // are 512 KB a thread, which a fresh allocation would fault in again each step.
  thread_local std::vector<ThreadScreen> kept;
  if (static_cast<int64_t>(kept.size()) < threads) kept.resize(threads);
  std::vector<ThreadScreen>& parts = kept;
  int64_t used = 0;
  if (screened) {
    used = split_table(pool, table.padded_rows, [&](int64_t part, int64_t n_begin, int64_t n_end) {
      ThreadScreen& own = parts[part];
      own.overflow = false;
      own.row_ids.resize(M * kCapacity);
      own.uppers.resize(M * kCapacity);
      own.rows.assign(M, Candidates{_mm512_set1_ps(-INFINITY), -INFINITY, 0, nullptr, nullptr});
      for (int64_t m = 0; m < M; ++m)
        own.rows[m].rows = own.row_ids.data() + m * kCapacity, own.rows[m].upper = own.uppers.data() + m * kCapacity;
#if defined(PAGED_SCREEN_AMX)
      if (tiles) return screen_rows_amx(table, codes, x_rows.data(), M, K64, n_begin, n_end, own);
#endif
#if defined(PAGED_SCREEN_VNNI)
      screen_rows_vnni(table, codes, x_rows.data(), M, K64, n_begin, n_end, own);
#endif
    });
  }
  // Every thread's candidates that reach their row's largest lower bound over all threads.
  std::vector<int32_t> rows;
  for (int64_t part = 0; part < used && screened; ++part) screened = !parts[part].overflow;
  for (int64_t m = 0; m < M && screened; ++m) {
    float threshold = -INFINITY;
    for (int64_t part = 0; part < used; ++part)
      threshold = std::max(threshold, lanes_max(parts[part].rows[m].lower_max));
    for (int64_t part = 0; part < used; ++part) {
      const Candidates& c = parts[part].rows[m];
      for (int64_t i = 0; i < c.count; ++i)
        if (c.upper[i] >= threshold) rows.push_back(c.rows[i]);
    }
    screened = static_cast<int64_t>(rows.size()) <= table.rows / 8;
  }
  if (!screened || rows.empty()) return full_walk();
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
#if defined(PAGED_SCREEN_AMX)
  if (tiles) return exact_among_amx(pool, x, w, M, K, rows, tokens), true;
#endif
  return avx512bf16::ArgmaxAmong(pool, x, w, M, K, rows.data(), static_cast<int64_t>(rows.size()), tokens);
}

#else

bool Available() { return false; }

bool ScreenedArgmax(xla::ffi::ThreadPool&, const uint16_t*, const uint16_t*, const ScreenTable&, int32_t*, int64_t,
                    int64_t) {
  return false;
}

#endif

// The screen of a table (any CPU): each 32-row block of rows on one thread, each row in one pass, float64 sums.
// sigma_n = float32(max|w_n| / 127) and codes round(w_n / sigma_n) (ties to even, clipped to +-127) are
// numpy's float64 arithmetic on the same values (the tests check the codes against it).
bool BuildScreen(xla::ffi::ThreadPool& pool, const uint16_t* w, int64_t N, int64_t K, int8_t* codes, float* stats,
                 float* limits) {
  const int64_t padded_rows = (N + 31) / 32 * 32, K64 = (K + 63) / 64 * 64, steps = K64 / 64;
  const int64_t blocks = padded_rows / 32;
  const double gamma = K * 0x1p-24 / (1.0 - K * 0x1p-24);
  std::vector<double> norm_max(blocks, 0.0), peak_max(blocks, 0.0);
  std::vector<char> finite(blocks, 1);
  run_parallel(&pool, blocks, 16, blocks - 1, [&](int64_t b) {
    std::vector<double> row(K);
    for (int64_t n = 32 * b; n < 32 * b + 32; ++n) {
      const int64_t h = (n % 32) / 16, j = n % 16;
      // Byte (b, s, h, q, j, e) of the tile order is the code of w[n, 64 s + 4 q + e].
      auto code_at = [&](int64_t k) -> int8_t& {
        return codes[((((b * steps + k / 64) * 2 + h) * 16 + (k % 64) / 4) * 16 + j) * 4 + k % 4];
      };
      if (n >= N) {
        for (int64_t k = 0; k < K64; ++k) code_at(k) = 0;
        for (int i = 0; i < 3; ++i) stats[i * padded_rows + n] = 0.0f;
        continue;
      }
      double peak = 0.0;
      bool row_finite = true;
      for (int64_t k = 0; k < K; ++k) {
        row[k] = bf16_to_float(w[n * K + k]);
        row_finite = row_finite && std::isfinite(row[k]);
        peak = std::max(peak, std::fabs(row[k]));
      }
      if (!row_finite) {
        finite[b] = 0;
        continue;
      }
      const float sigma = static_cast<float>(peak / 127.0);
      double approx_sq = 0.0, error_sq = 0.0, norm_sq = 0.0;
      for (int64_t k = 0; k < K64; ++k) {
        const double code = k < K && sigma > 0.0f ? std::clamp(std::nearbyint(row[k] / sigma), -127.0, 127.0) : 0.0;
        code_at(k) = static_cast<int8_t>(code);
        if (k >= K) continue;
        const double approx = code * sigma;
        approx_sq += approx * approx;
        error_sq += (row[k] - approx) * (row[k] - approx);
        norm_sq += row[k] * row[k];
      }
      stats[n] = sigma;
      stats[padded_rows + n] = rounded_up(std::sqrt(approx_sq));
      const double slack = std::sqrt(error_sq) + gamma * std::sqrt(norm_sq);
      stats[2 * padded_rows + n] = rounded_up(slack);
      norm_max[b] = std::max(norm_max[b], std::sqrt(norm_sq)), peak_max[b] = std::max(peak_max[b], peak);
    }
  });
  if (std::find(finite.begin(), finite.end(), 0) != finite.end()) return false;
  limits[0] = rounded_up(*std::max_element(norm_max.begin(), norm_max.end()));
  limits[1] = static_cast<float>(*std::max_element(peak_max.begin(), peak_max.end()));
  return true;
}

}  // namespace paged::screen
