// Weight-only int4 (GPTQ and other group-quantized 4-bit layers) at decode sizes on Intel AMX tiles: y[M, N] =
// sum over groups g of (x_g @ (u_g - 8)) * scale[g, n] - (sum_k in g x[m, k]) * offset[g, n] (+ bias), i.e.
// x @ ((u - 8) * scale - offset) with u the stored nibbles (0..15). amx.h: Int4MatmulPacked. Prompt-sized calls
// (over 64 rows) dequantize each panel once instead (amx_widened.cc).
//
// Why: a decode step streams every weight once, and int4 is a quarter of bfloat16's bytes. The codes are never
// dequantized: each group's sums of x times the codes are exact (or float32) and meet the group's scales once.
//   - 1 to 4 rows: x as int8 digits (amx_digits.h) against the nibbles split into bytes a step at a time (two
//     ANDs and a shift per 64 bytes), TDPBSUD (signed digits x unsigned codes, exact int32 sums): four rows of
//     x fill one A tile, so a step is four tile products, and the walk waits on memory, not the tiles.
//   - 5 to 64 rows: x as it is on the bf16 tiles against the codes looked up as exact bfloat16 values (below):
//     one A tile for 16 rows, eight tile products a step, where the digits would take sixteen; a panel's further
//     blocks of 16 rows take it again from L2.
//
// Layout (pallas_kernels/cpu: pack_int4_for_amx): the int8 codes' layout (amx_int8.cc: [N / 64][ceil(K / 64)]
// [4 tiles][16 quads][16 n][4]) with each 4 KB step folded into 2 KB: byte j of a step holds code j in its low
// nibble and code j + 2048 in its high one, so tiles 0-1 come from the low nibbles and 2-3 from the high.
//
// Walk: each thread takes a run of 64-column panels and streams each panel's steps from memory group by group:
// the group's steps summed in four C tiles, stored, and folded into float32 sums with the group's scales.
// Groups are whole 64-deep steps (a group size that is a multiple of 64, or one group over all of K).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "amx_tiles.h"
#include "bf16.h"
#include "parallel.h"

#if defined(PAGED_AMX) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
#include "amx_digits.h"
#include "amx_int8_walk.h"
#endif

namespace paged::amx {

#if defined(PAGED_AMX) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
namespace {

constexpr int64_t kBlockRows = 16;                 // digit rows: one A tile
constexpr int64_t kBlockX = kBlockRows / kDigits;  // the most rows of x written as digits
constexpr int64_t kWideRows = 16;                  // rows of x on the bf16 tiles a pass: one A tile
// The most rows of x that take the lookups walk, kWideRows at a time over each panel while it is in L2: the codes
// are read from memory once, and each further block of rows costs a pass of lookups and tile products over
// cached codes. Up to 64 rows that beats dequantizing each panel once (amx_widened.cc, which the prompts keep):
// the 0.5B gate/up and down, 16 copies of each, alternating call by call in one process, went 835 -> 581 and
// 368 -> 249 us at 24 rows, 1078 -> 889 and 364 -> 272 at 48, 1185 -> 1065 and 556 -> 439 at 64.
constexpr int64_t kLookupRows = 64;
// Both walks request the nibbles this many steps (64 KB) ahead into L2, a step's lines at a time. The digits'
// tile work is so short that the loads wait on memory otherwise: touching the start of the page two steps
// ahead (as the int8 walk does) left one-row products at 48-66% of the read bandwidth; this gives 72-82%
// (`paged bench matmul --rows 1`, alternating builds; 16 steps ahead gave 72-83%). Near the end of a thread's
// panels the requests run past them: wasted, and a prefetch never faults.
constexpr int64_t kStreamAheadSteps = 32;

// ---- 1 to 4 rows: x as int8 digits against the codes as bytes ----------------------------------------------

// What a call's rows of x are, as its walk takes them.
struct CallRows {
  const int8_t* digits;       // 1-4 rows: [kBlockRows][lda] int8 digits (amx_digits.h)
  const uint16_t* x_tiles;    // 5-64 rows: [kLookupRows / 16][2 * steps][16][32] bfloat16 A tiles (below)
  int64_t lda;                // digits: bytes from one row to the next
  const float* digit_scales;  // [M][kDigits], with digits
  const float* group_sums;    // [M][groups]: float32 sums of x over each group
};

// sums[M][64] float32 of up to 4 rows of x as digits against one weight's panel of nibbles (from memory), group
// by group: each group's int32 sums times its scales, less the group's sums of x times 8 scale + offset. Each
// step is split into bytes in L1 just before its tile products, so the splitting overlaps the stream.
void panel_sums(const CallRows& x, int64_t M, const uint8_t* nibbles, const Int4Weights& w, int64_t K, int64_t N,
                int64_t n0, float* out) {
  alignas(64) int32_t sums[kBlockRows * kPanel];
  alignas(64) int8_t step_codes[kStepBytes];
  const int64_t steps = (K + kDepth - 1) / kDepth, groups = w.groups;
  const int64_t group_steps = groups == 1 ? steps : K / groups / kDepth;
  std::memset(out, 0, sizeof(float) * M * kPanel);
  for (int64_t g = 0; g < groups; ++g) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t s = g * group_steps; s < std::min(steps, (g + 1) * group_steps); ++s) {
      prefetch_into_l2(nibbles + (s + kStreamAheadSteps) * kStepNibbles, kStepNibbles);
      split_nibbles(nibbles + s * kStepNibbles, step_codes);
      _tile_loadd(4, x.digits + s * kDepth, x.lda);
      _tile_loadd(5, step_codes, 64);
      _tile_loadd(6, step_codes + 1024, 64);
      _tile_dpbsud(0, 4, 5);
      _tile_dpbsud(1, 4, 6);
      _tile_loadd(5, step_codes + 2048, 64);
      _tile_loadd(6, step_codes + 3072, 64);
      _tile_dpbsud(2, 4, 5);
      _tile_dpbsud(3, 4, 6);
    }
    _tile_stored(0, sums, 256); _tile_stored(1, sums + 16, 256);
    _tile_stored(2, sums + 32, 256); _tile_stored(3, sums + 48, 256);
    for (int v = 0; v < 4; ++v) {
      const __m512 scale = _mm512_loadu_ps(w.scales + g * N + n0 + 16 * v);
      const __m512 offset = _mm512_fmadd_ps(_mm512_set1_ps(8.0f), scale,
                                            w.offsets ? _mm512_loadu_ps(w.offsets + g * N + n0 + 16 * v)
                                                      : _mm512_setzero_ps());
      for (int64_t i = 0; i < M; ++i) {
        const __m512 product =
            combine_digits(sums + i * kDigits * kPanel + 16 * v, kPanel, x.digit_scales + i * kDigits);
        __m512 acc = _mm512_load_ps(out + i * kPanel + 16 * v);
        acc = _mm512_fmadd_ps(product, scale, acc);
        acc = _mm512_fnmadd_ps(_mm512_set1_ps(x.group_sums[i * groups + g]), offset, acc);
        _mm512_store_ps(out + i * kPanel + 16 * v, acc);
      }
    }
  }
}

// ---- 5 to 64 rows: bfloat16 x against the codes as exact bfloat16 values -----------------------------------
//
// From five rows of x, the digits' four A rows per row of x make more tile work than the stream leaves time for
// (at 16 rows, 64 digit rows: 16 tile products per 2 KB step, and the layers' products at 23% of the read
// bandwidth). Each u - 8 is a small integer, exact in bfloat16, so a step's nibbles become bf16 tiles by table
// lookup (VPERMW from a 32-word table indexed by the low five bits of each word: three shifts and four lookups
// per 64 bytes), and all 16 rows of x, as they are, make one A tile per 32 k: 8 tile products a step. The
// products of bfloat16 values are exact in the tiles' float32 sums.
//
// The lookups leave each quad row's codes (16 columns x 4 k) as two pair rows, k {0, 2} and k {1, 3} of the
// quad: the tile product sums over the pairs in any order, so x's copy swaps the middle two k of every four
// to match instead of the codes being reordered.

// Row m of x in its block's first A tile (x_tiles: [blocks of kWideRows rows][padded_k / 32 tiles][16][32]
// words); for the first row of a block, where the block's tiles start.
template <typename T>
inline T* row_in_tiles(T* x_tiles, int64_t m, int64_t padded_k) {
  return x_tiles + m / kWideRows * kWideRows * padded_k + m % kWideRows * 32;
}

// Pair rows of a step of bf16 tiles: [2 halves (k 0-31, 32-63)][4 column tiles][16 pair rows][32 words].
constexpr int64_t kWideStepWords = 2 * 4 * 512;

// bfloat16 of (i mod 16) - 8: the index's fifth bit is the next nibble's, ignored.
struct NibbleTable {
  alignas(64) uint16_t words[32];
  NibbleTable() {
    for (int i = 0; i < 32; ++i) words[i] = float_to_bf16(static_cast<float>((i & 15) - 8));
  }
};

// Quad row r of column tiles t and t + 2 of a step (64 bytes of nibbles at `nibbles`; chunk q = 16 t + r, t < 2)
// into the step's bf16 tiles at `out`: code j of the int8 step is in the low nibble of byte j, j + 2048 high.
inline void nibbles_to_bf16_chunk(const uint8_t* nibbles, uint16_t* out, __m512i table, int q) {
  const int t = q / 16, r = q % 16;
  // Word 2c + h of the quad row: byte 0 holds k = 4r + 2h of column c (tile t low, t + 2 high), byte 1 k + 1.
  const __m512i v = _mm512_load_si512(nibbles + 64 * q);
  uint16_t* low = out + ((r / 8) * 4 + t) * 512 + 2 * (r % 8) * 32;
  uint16_t* high = low + 2 * 512;
  _mm512_store_si512(low, _mm512_permutexvar_epi16(v, table));
  _mm512_store_si512(low + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), table));
  _mm512_store_si512(high, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table));
  _mm512_store_si512(high + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), table));
}

// x's rows in the order of the bf16 steps' pairs: k 4i, 4i + 2, 4i + 1, 4i + 3.
alignas(64) inline constexpr uint16_t kQuadMiddleSwapped[32] = {
    0,  2,  1,  3,  4,  6,  5,  7,  8,  10, 9,  11, 12, 14, 13, 15,
    16, 18, 17, 19, 20, 22, 21, 23, 24, 26, 25, 27, 28, 30, 29, 31};

// sums[count][64] float32 of up to 16 rows of x (`x_tiles`: their A tiles, [2 * steps][16][32] bfloat16 in the
// pairs' order) against one weight's panel of nibbles as they stream from memory, group by group as panel_sums
// does.
void wide_panel_sums(const uint16_t* x_tiles, int64_t count, const float* group_sums,
                     const uint8_t* nibbles, const Int4Weights& w, int64_t K, int64_t N, int64_t n0, float* out) {
  static const NibbleTable nibble_table;
  const __m512i table = _mm512_load_si512(nibble_table.words);
  alignas(64) float sums[kWideRows * kPanel];
  alignas(64) uint16_t wide[2][kWideStepWords];  // two steps, so one is written while the other's tiles load
  const int64_t steps = (K + kDepth - 1) / kDepth, groups = w.groups;
  const int64_t group_steps = groups == 1 ? steps : K / groups / kDepth;
  std::memset(out, 0, sizeof(float) * count * kPanel);
  for (int q = 0; q < 32; ++q) nibbles_to_bf16_chunk(nibbles, wide[0], table, q);
  for (int64_t g = 0; g < groups; ++g) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t s = g * group_steps; s < std::min(steps, (g + 1) * group_steps); ++s) {
      // Step s's tile products, with the next step's lookups and the prefetch of the step kStreamAheadSteps on
      // between them: a burst of loads or prefetches between two bursts of tile products kept fewer lines in
      // flight.
      const uint16_t* b = wide[s % 2];
      uint16_t* next = wide[(s + 1) % 2];
      const uint8_t* next_nibbles = nibbles + (s + 1) * kStepNibbles;
      const uint8_t* ahead = nibbles + (s + kStreamAheadSteps) * kStepNibbles;
      const bool more = s + 1 < steps;
      // Step s + 2 into L1 as well, so the next step's lookups find it there (one thread a half of the 0.5B
      // gate at 16 rows, both cores streaming: 5-10%; int4 decode at 16 sequences, alternating processes:
      // 431 -> 463 output tok/s with amx.cc's transposed_block change, five rounds each).
      const uint8_t* after_next = next_nibbles + kStepNibbles;
      auto between = [&](int i) {
        prefetch_into_l2(ahead + i * kStepNibbles / 8, kStepNibbles / 8);
        prefetch_into_l1(after_next + i * kStepNibbles / 8, kStepNibbles / 8);
        if (more)
          for (int q = 4 * i; q < 4 * i + 4; ++q) nibbles_to_bf16_chunk(next_nibbles, next, table, q);
      };
      _tile_loadd(4, x_tiles + 2 * s * kTileWords, 64);
      _tile_loadd(5, b, 64); _tile_dpbf16ps(0, 4, 5); between(0);
      _tile_loadd(6, b + 512, 64); _tile_dpbf16ps(1, 4, 6); between(1);
      _tile_loadd(5, b + 1024, 64); _tile_dpbf16ps(2, 4, 5); between(2);
      _tile_loadd(6, b + 1536, 64); _tile_dpbf16ps(3, 4, 6); between(3);
      _tile_loadd(4, x_tiles + (2 * s + 1) * kTileWords, 64);
      _tile_loadd(5, b + 2048, 64); _tile_dpbf16ps(0, 4, 5); between(4);
      _tile_loadd(6, b + 2560, 64); _tile_dpbf16ps(1, 4, 6); between(5);
      _tile_loadd(5, b + 3072, 64); _tile_dpbf16ps(2, 4, 5); between(6);
      _tile_loadd(6, b + 3584, 64); _tile_dpbf16ps(3, 4, 6); between(7);
    }
    _tile_stored(0, sums, 256); _tile_stored(1, sums + 16, 256);
    _tile_stored(2, sums + 32, 256); _tile_stored(3, sums + 48, 256);
    for (int v = 0; v < 4; ++v) {
      // The tiles summed x (u - 8) already: only the zero offsets meet the group's sums of x.
      const __m512 scale = _mm512_loadu_ps(w.scales + g * N + n0 + 16 * v);
      const __m512 offset = w.offsets ? _mm512_loadu_ps(w.offsets + g * N + n0 + 16 * v) : _mm512_setzero_ps();
      for (int64_t i = 0; i < count; ++i) {
        __m512 acc = _mm512_load_ps(out + i * kPanel + 16 * v);
        acc = _mm512_fmadd_ps(_mm512_load_ps(sums + i * kPanel + 16 * v), scale, acc);
        acc = _mm512_fnmadd_ps(_mm512_set1_ps(group_sums[i * groups + g]), offset, acc);
        _mm512_store_ps(out + i * kPanel + 16 * v, acc);
      }
    }
  }
}

// Panels [p_begin, p_end) of the call (and its up projection's): y's 64 columns of each.
void int4_panels(const Int4Call& call, const CallRows& x, int64_t p_begin, int64_t p_end) {
  const int64_t steps = (call.K + kDepth - 1) / kDepth, panel_bytes = steps * kStepNibbles;
  alignas(64) float values[kLookupRows * kPanel], up_values[kLookupRows * kPanel];
  auto sums = [&](const uint8_t* nibbles, const Int4Weights& w, int64_t n0, float* out) {
    if (x.x_tiles) {
      // Each block of rows over the whole panel: the first pass streams its codes into L2, the others reuse them.
      for (int64_t m0 = 0; m0 < call.M; m0 += kWideRows)
        wide_panel_sums(row_in_tiles(x.x_tiles, m0, steps * kDepth), std::min(kWideRows, call.M - m0),
                        x.group_sums + m0 * w.groups, nibbles, w, call.K, call.N, n0, out + m0 * kPanel);
    } else {
      panel_sums(x, call.M, nibbles, w, call.K, call.N, n0, out);
    }
  };
  configure_tiles();
  for (int64_t p = p_begin; p < p_end; ++p) {
    const int64_t n0 = p * kPanel;
    sums(call.w.packed + p * panel_bytes, call.w, n0, values);
    if (call.up) sums(call.up->packed + p * panel_bytes, *call.up, n0, up_values);
    for (int64_t m = 0; m < call.M; ++m) {
      for (int v = 0; v < 4; ++v) {
        __m512 out = _mm512_load_ps(values + m * kPanel + 16 * v);
        if (call.w.bias) out = _mm512_add_ps(out, _mm512_loadu_ps(call.w.bias + n0 + 16 * v));
        if (call.up) out = _mm512_mul_ps(silu512(out), _mm512_load_ps(up_values + m * kPanel + 16 * v));
        const int64_t at = m * call.N + n0 + 16 * v;
        if (call.y_bf16) {
          store_product_bf16x16(static_cast<uint16_t*>(call.y) + at, out);
        } else {
          _mm512_storeu_ps(static_cast<float*>(call.y) + at, out);
        }
      }
    }
  }
  _tile_release();
}

// Row x (K bfloat16) in the bf16 steps' pair order, zeros past K, into its block's A tiles: 32 k a tile of 16
// rows (512 words), the row's 32 words of the first at `out`. Each A tile is 1 KB in one piece rather than 16 rows
// a padded K apart: at 16 rows, the 0.5B gate/up and down, 16 copies alternating call by call in one process,
// took 1-5% less time, and 5-6% at 64 rows, whose blocks after the first run from L2.
inline void pair_order_row(const uint16_t* x, int64_t K, int64_t padded_k, uint16_t* out) {
  const __m512i order = _mm512_load_si512(kQuadMiddleSwapped);
  for (int64_t k = 0; k < padded_k; k += 32) {
    const __mmask32 lanes = K - k >= 32 ? ~__mmask32(0) : K > k ? (__mmask32(1) << (K - k)) - 1 : 0;
    const __m512i pairs = _mm512_permutexvar_epi16(order, _mm512_maskz_loadu_epi16(lanes, x + k));
    _mm512_store_si512(out + k / 32 * kTileWords, pairs);
  }
}

}  // namespace

bool Int4MatmulPacked(xla::ffi::ThreadPool& pool, const Int4Call& call) {
  if (!Available()) return false;
  if (call.M > kLookupRows) return Int4WidenedMatmulPacked(pool, call);
  const bool by_digits = call.M <= kBlockX;
  const int64_t padded_k = (call.K + kDepth - 1) / kDepth * kDepth, groups = call.w.groups;
  const int64_t group_size = groups == 1 ? call.K : call.K / groups;
  thread_local TileVector<int8_t> digits;
  thread_local TileVector<uint16_t> x_tiles;
  thread_local TileVector<float> digit_scales, group_sums, row_sums;
  try {
    if (by_digits && digits.size() < static_cast<size_t>(kBlockRows * padded_k)) digits.resize(kBlockRows * padded_k);
    if (!by_digits && x_tiles.size() < static_cast<size_t>(kLookupRows * padded_k))
      x_tiles.resize(kLookupRows * padded_k);
    if (by_digits && digit_scales.size() < static_cast<size_t>(kDigits * call.M)) digit_scales.resize(kDigits * call.M);
    if (group_sums.size() < static_cast<size_t>(groups * call.M)) group_sums.resize(groups * call.M);
    if (by_digits && row_sums.size() < static_cast<size_t>(call.M)) row_sums.resize(call.M);  // digit_row's x sums
  } catch (const std::bad_alloc&) {
    return false;
  }
  int8_t* dp = digits.data();
  uint16_t* xp = x_tiles.data();
  float *scale_p = digit_scales.data(), *group_p = group_sums.data(), *row_p = row_sums.data();
  // Rows past M are summed in the tiles but never read out: what they hold does not matter.
  run_parallel(&pool, call.M, 8, call.M / 8, [&](int64_t m) {
    const uint16_t* row = call.x + m * call.K;
    if (by_digits) {
      digit_row(row, call.K, padded_k, dp + m * kDigits * padded_k, scale_p + m * kDigits, row_p[m]);
    } else {
      pair_order_row(row, call.K, padded_k, row_in_tiles(xp, m, padded_k));
    }
    for (int64_t g = 0; g < groups; ++g) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 16)
        sum = _mm512_add_ps(sum, load_bf16x16(row + k, lanes16((g + 1) * group_size, k)));
      group_p[m * groups + g] = _mm512_reduce_add_ps(sum);
    }
  });
  const CallRows rows = by_digits ? CallRows{dp, nullptr, padded_k, scale_p, group_p}
                                  : CallRows{nullptr, xp, 0, nullptr, group_p};
  const int64_t num_panels = call.N / kPanel, parts = std::min(num_panels, std::max<int64_t>(1, pool.num_threads()));
  run_parallel(&pool, parts, 1, parts - 1, [&](int64_t part) {
    int4_panels(call, rows, part * num_panels / parts, (part + 1) * num_panels / parts);
  });
  return true;
}

#else

bool Int4MatmulPacked(xla::ffi::ThreadPool&, const Int4Call&) { return false; }

#endif

}  // namespace paged::amx
