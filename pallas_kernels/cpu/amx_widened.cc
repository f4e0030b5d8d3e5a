// Prompt-sized weight-only steps on Intel AMX-BF16 tiles: int8 codes widened to bfloat16, and int4 codes
// dequantized to bfloat16, one panel at a time into L2, then every 32-row block of x against that panel (amx.h:
// Int8WeightsWidenedMatmulPacked, Int4WidenedMatmulPacked). Decode-sized steps multiply the codes as they are
// (amx_int8.cc: x as int8 digits; amx_int4.cc).
//
// Why: from a few dozen rows the products are bound by the tiles, not by reading the weights, and x's digits
// would make four times the tile work; one widening per panel is shared by all of a prompt's row blocks, so the
// codes still stream at half (int8) or a quarter (int4) of bfloat16's bytes. The panel layouts are amx_int8.cc's
// and amx_int4.cc's; the walk's tile products are amx_int8_walk.h's.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "amx_tiles.h"
#include "parallel.h"

#if defined(PAGED_AMX) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
#include "amx_int8_walk.h"
#endif

namespace paged::amx {

#if defined(PAGED_AMX) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
namespace {

// ---- weight-only int8: bfloat16 x against the codes widened to bfloat16 ------------------------------------
//
// Codes are small integers, exact in bfloat16. For prompt-sized steps (over kDigitRows rows; decode-sized ones
// take the digits below) a panel's whole K is widened once into bf16 tiles (L2) and every row block of x runs
// the bfloat16 tile product against it, as amx.cc's packed weights: the codes stream from memory at half bf16's
// bytes, and the widening is paid once per call, not once per row block.

// Quad row j of an int8 tile (16 columns x 4 consecutive k) into the bf16 tiles' pair rows: its even words
// (the first two k) are pair row 2 (j mod 8), its odd words pair row 2 (j mod 8) + 1, of the step's first
// bf16 half (j < 8) or second.
alignas(64) inline constexpr uint16_t kEvenThenOddWords[32] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                                                 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};

// 32 int8 codes as 32 exact bfloat16 values.
inline __m512i widen_codes(__m256i codes) {
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(codes)));
  const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(codes, 1)));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
}

// Int8 step s of a panel (4 tiles of 16 quad rows, 4 KB) into its two bf16 steps at `out` ([2][4][16][32] words).
inline void widen_step(const int8_t* step, uint16_t* out) {
  const __m512i order = _mm512_load_si512(kEvenThenOddWords);
  for (int t = 0; t < 4; ++t) {
    for (int j = 0; j < 16; ++j) {
      const __m512i split = _mm512_permutexvar_epi16(order, _mm512_load_si512(step + t * 1024 + 64 * j));
      uint16_t* rows = out + ((j / 8) * 4 + t) * 512 + (2 * (j % 8)) * 32;
      _mm512_store_si512(rows, widen_codes(_mm512_castsi512_si256(split)));
      _mm512_store_si512(rows + 32, widen_codes(_mm512_extracti64x4_epi64(split, 1)));
    }
  }
}

// A panel's codes ([steps][4][16][64] bytes) into bf16 tiles ([2 steps][4][16][32] words), `next` (the panel
// after, or null) requested into L2 as this one is read.
void widen_panel(const int8_t* codes, int64_t steps, uint16_t* out, const int8_t* next) {
  for (int64_t s = 0; s < steps; ++s) {
    if (next) prefetch_into_l2(next + s * kStepBytes, kStepBytes);
    widen_step(codes + s * kStepBytes, out + 2 * s * 4 * 512);
  }
}

// Gated calls over kSmallRows rows (prompts) widen two panels of gate and up at a time and sum K in chunks of
// kGatedChunkSteps (amx_tiles.h): a chunk of a row block's x stays in L1 while both panels' eight column tiles
// pass over it, where whole K came from L2 for each of them. The 0.5B shape's gate/up at 1,536 rows, two copies
// of the layer, the variants alternating call by call in one process (median of 9 calls each): whole K int4
// 17.7 ms, int8 19.0; chunks of one panel 15.0 and 16.0; chunks of two panels 13.5-14.2 and 15.3-17.6 (two
// variants that differed only in the one-weight products). For those (q/k/v/o/down), 512-k blocks of eight
// panels with the partial sums in memory (amx.cc's large plan) were within the noise of whole K.
constexpr int64_t kGatedPanels = 2;

// Sums [32][64] of one 32-row block of x (a, rows lda bytes apart) against `panels` panels' widened gate and up
// (each panel `panel_words` on from the one before; `steps` bf16 steps), into sums and up_sums ([panels][32][64]).
inline void gated_block_sums(const char* a, int64_t lda, const uint16_t* gate, const uint16_t* up, int64_t steps,
                             int64_t panels, int64_t panel_words, float* sums, float* up_sums) {
  for (int64_t s = 0; s < steps; s += kGatedChunkSteps) {
    const int64_t n = std::min(kGatedChunkSteps, steps - s);
    const char* rows = a + s * 64;  // 32 k of bfloat16 a step
    for (int64_t i = 0; i < panels; ++i) {
      for (int half = 0; half < 2; ++half) {  // each weight's column tiles 0-1, then 2-3
        const int64_t offset = s * kStepBytes + half * 2048;
        char* g = reinterpret_cast<char*>(sums + i * kRows * kPanel) + half * 128;
        char* u = reinterpret_cast<char*>(up_sums + i * kRows * kPanel) + half * 128;
        tile_32x32<Product::kBf16, NoWork>(rows, lda, reinterpret_cast<const char*>(gate + i * panel_words) + offset,
                                           n, g, nullptr, 0, nullptr, s > 0);
        tile_32x32<Product::kBf16, NoWork>(rows, lda, reinterpret_cast<const char*>(up + i * panel_words) + offset,
                                           n, u, nullptr, 0, nullptr, s > 0);
      }
    }
  }
}

// x's 32-row blocks as the walk reads them: the first `in_place` from x itself, the rest from a padded copy,
// rows `lda` bytes apart in both (x's own rows where K is a multiple of the step, so only a short last block is
// copied).
struct XRows {
  const char* x;
  const char* copied;
  int64_t in_place, lda;
  const char* block(int64_t mb) const {
    return mb < in_place ? x + mb * kRows * lda : copied + (mb - in_place) * kRows * lda;
  }
};

// Panels [p_begin, p_end) of bfloat16 x (its row blocks as `x` gives them, padded to whole steps) against
// weights that widen(p, more, out, up_out) writes as bf16 tiles ([2 steps][4][16][32] words; up_out only for a
// gated call; more: panel p + 1 follows) once a panel, then every 32-row block of x against them;
// finish_weights_block applies call.w's (and up's) vectors.
template <class Widen>
void widened_panels(const Int8WeightsCall& call, const XRows& x, const float* x_sums, int64_t p_begin,
                    int64_t p_end, const Widen& widen) {
  alignas(64) float sums[kGatedPanels * kRows * kPanel], up_sums[kGatedPanels * kRows * kPanel];
  const int64_t steps = (call.K + kDepth - 1) / kDepth, lda = x.lda;
  const bool chunked = call.up && call.M > kSmallRows;
  const int64_t group = chunked ? kGatedPanels : 1, panel_words = 2 * steps * 4 * 512;
  thread_local TileVector<uint16_t> widened, widened_up;
  widened.resize(group * panel_words), widened_up.resize(call.up ? widened.size() : 0);
  configure_tiles();
  const int64_t row_blocks = (call.M + kRows - 1) / kRows;
  for (int64_t p0 = p_begin; p0 < p_end; p0 += group) {
    const int64_t np = std::min(group, p_end - p0);
    for (int64_t i = 0; i < np; ++i)
      widen(p0 + i, p0 + i + 1 < p_end, widened.data() + i * panel_words, widened_up.data() + i * panel_words);
    for (int64_t mb = 0; mb < row_blocks; ++mb) {
      const int64_t m0 = mb * kRows, rows = std::min(kRows, call.M - m0);
      if (chunked) {
        gated_block_sums(x.block(mb), lda, widened.data(), widened_up.data(), 2 * steps, np, panel_words, sums,
                         up_sums);
        for (int64_t i = 0; i < np; ++i)
          finish_weights_block(call, sums + i * kRows * kPanel, up_sums + i * kRows * kPanel, m0, rows,
                               (p0 + i) * kPanel, x_sums);
        continue;
      }
      block_sums<Product::kBf16>(x.block(mb), lda, widened.data(), 2 * steps, rows, false, sums);
      if (call.up) block_sums<Product::kBf16>(x.block(mb), lda, widened_up.data(), 2 * steps, rows, false, up_sums);
      finish_weights_block(call, sums, up_sums, m0, rows, p0 * kPanel, x_sums);
    }
  }
  _tile_release();
}

// A prompt-sized call on the bf16 tiles: x read in place where K is a multiple of the step, else (and for a
// last block of fewer than 32 rows) copied padded to whole steps and row blocks, with its float32 row sums
// where the weights have zero points; then widened_panels over the threads. (A copy of all of x is written and
// read again: 20 MB at 2,048 rows of the 0.5B shape's down projection.) False: x's copy could not be allocated.
template <class Widen>
bool widened_matmul(xla::ffi::ThreadPool& pool, const Int8WeightsCall& call, const Widen& widen) {
  const int64_t padded_k = (call.K + kDepth - 1) / kDepth * kDepth;
  const int64_t padded_rows = (call.M + kRows - 1) / kRows * kRows;
  const int64_t in_place = call.K == padded_k ? call.M / kRows : 0, first_copied = in_place * kRows;
  thread_local TileVector<uint16_t> x;
  thread_local TileVector<float> x_sums;
  try {
    if (x.size() < static_cast<size_t>((padded_rows - first_copied) * padded_k))
      x.resize((padded_rows - first_copied) * padded_k);
    if (x_sums.size() < static_cast<size_t>(call.M)) x_sums.resize(call.M);
  } catch (const std::bad_alloc&) {
    return false;
  }
  uint16_t* xp = x.data();
  float* sp = x_sums.data();
  // Only zero offsets read x's row sums (int4's are folded into its dequantized weights: none here).
  const bool zero_points = call.w.zero_offsets || (call.up && call.up->zero_offsets);
  std::memset(xp + (call.M - first_copied) * padded_k, 0, (padded_rows - call.M) * padded_k * sizeof(uint16_t));
  run_parallel(&pool, call.M, 8, call.M / 8, [&](int64_t m) {
    const uint16_t* row = call.x + m * call.K;
    if (m >= first_copied) {
      std::memcpy(xp + (m - first_copied) * padded_k, row, call.K * sizeof(uint16_t));
      std::memset(xp + (m - first_copied) * padded_k + call.K, 0, (padded_k - call.K) * sizeof(uint16_t));
    }
    __m512 sum = _mm512_setzero_ps();
    if (zero_points) {
      for (int64_t k = 0; k < call.K; k += 16) sum = _mm512_add_ps(sum, load_bf16x16(row + k, lanes16(call.K, k)));
    }
    sp[m] = _mm512_reduce_add_ps(sum);
  });
  const XRows rows{reinterpret_cast<const char*>(call.x), reinterpret_cast<const char*>(xp), in_place,
                   padded_k * static_cast<int64_t>(sizeof(uint16_t))};
  const int64_t num_panels = call.N / kPanel, parts = std::min(num_panels, std::max<int64_t>(1, pool.num_threads()));
  run_parallel(&pool, parts, 1, parts - 1, [&](int64_t part) {
    widened_panels(call, rows, sp, part * num_panels / parts, (part + 1) * num_panels / parts, widen);
  });
  return true;
}

// ---- int4 prompt steps: the codes dequantized into bf16 tiles -----------------------------------------------
//
// Group scales keep int4's sums from running over the whole of K in the tiles, and x's digits make four times
// the tile work; for prompt-sized steps each panel is instead dequantized once, (u - 8) * scale - offset rounded
// to bfloat16 (as a bfloat16 model's dequantized weights are), into bf16 tiles that every row block reuses.

// Column c of each of the 32 values of a permuted quad row (16 columns x 2 k): lanes 2c and 2c + 1.
alignas(64) inline constexpr int32_t kPairColumnsLow[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
alignas(64) inline constexpr int32_t kPairColumnsHigh[16] = {8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};

// A panel's int4 codes (nibbles, [steps][2048]) into bf16 tiles of the dequantized weights.
void dequantize_int4_panel(const uint8_t* nibbles, const Int4Weights& w, int64_t K, int64_t N, int64_t n0,
                           uint16_t* out, const uint8_t* next) {
  const int64_t steps = (K + kDepth - 1) / kDepth;
  const int64_t group_steps = w.groups == 1 ? steps : K / w.groups / kDepth;
  const __m512i order = _mm512_load_si512(kEvenThenOddWords);
  const __m512i low_columns = _mm512_load_si512(kPairColumnsLow), high_columns = _mm512_load_si512(kPairColumnsHigh);
  alignas(64) int8_t codes[kStepBytes];
  __m512 scale[4][2], offset[4][2];  // per tile, for its columns 0-7 and 8-15 as the pairs lay them out
  for (int64_t s = 0; s < steps; ++s) {
    if (s % group_steps == 0) {
      const int64_t at = s / group_steps * N + n0;
      for (int t = 0; t < 4; ++t) {
        const __m512 sc = _mm512_loadu_ps(w.scales + at + 16 * t);
        const __m512 off = _mm512_fmadd_ps(_mm512_set1_ps(8.0f), sc, w.offsets ? _mm512_loadu_ps(w.offsets + at + 16 * t)
                                                                                : _mm512_setzero_ps());
        scale[t][0] = _mm512_permutexvar_ps(low_columns, sc), scale[t][1] = _mm512_permutexvar_ps(high_columns, sc);
        offset[t][0] = _mm512_permutexvar_ps(low_columns, off), offset[t][1] = _mm512_permutexvar_ps(high_columns, off);
      }
    }
    if (next) prefetch_into_l2(next + s * kStepNibbles, kStepNibbles);
    split_nibbles(nibbles + s * kStepNibbles, codes);
    uint16_t* step_out = out + 2 * s * 4 * 512;
    for (int t = 0; t < 4; ++t) {
      for (int j = 0; j < 16; ++j) {
        const __m512i split = _mm512_permutexvar_epi16(order, _mm512_load_si512(codes + t * 1024 + 64 * j));
        uint16_t* rows = step_out + ((j / 8) * 4 + t) * 512 + (2 * (j % 8)) * 32;
        for (int half = 0; half < 2; ++half) {  // the quad row's first two k, then its last two
          const __m256i pair_row = half ? _mm512_extracti64x4_epi64(split, 1) : _mm512_castsi512_si256(split);
          const __m512 lo = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(pair_row))),
                                            scale[t][0], offset[t][0]);
          const __m512 hi = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(pair_row, 1))),
                                            scale[t][1], offset[t][1]);
          _mm512_store_si512(rows + half * 32, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
        }
      }
    }
  }
}

}  // namespace

bool Int8WeightsWidenedMatmulPacked(xla::ffi::ThreadPool& pool, const Int8WeightsCall& call) {
  if (!Available()) return false;
  const int64_t panel_bytes = (call.K + kDepth - 1) / kDepth * kStepBytes;
  return widened_matmul(pool, call, [&](int64_t p, bool more, uint16_t* out, uint16_t* up_out) {
    const int8_t* codes = call.w.packed + p * panel_bytes;
    widen_panel(codes, panel_bytes / kStepBytes, out, more ? codes + panel_bytes : nullptr);
    if (call.up) {
      const int8_t* up_codes = call.up->packed + p * panel_bytes;
      widen_panel(up_codes, panel_bytes / kStepBytes, up_out, more ? up_codes + panel_bytes : nullptr);
    }
  });
}

bool Int4WidenedMatmulPacked(xla::ffi::ThreadPool& pool, const Int4Call& call) {
  if (!Available()) return false;
  // The scales and zero points go into the widened weights; what is left for the epilogue is the bias.
  const W8A8Weights w{nullptr, nullptr, nullptr, call.w.bias}, up{nullptr, nullptr, nullptr, nullptr};
  const Int8WeightsCall view{call.x, w, call.up ? &up : nullptr, call.y, call.y_bf16, call.M, call.K, call.N};
  const int64_t panel_bytes = (call.K + kDepth - 1) / kDepth * kStepNibbles;
  return widened_matmul(pool, view, [&](int64_t p, bool more, uint16_t* out, uint16_t* up_out) {
    const uint8_t* codes = call.w.packed + p * panel_bytes;
    dequantize_int4_panel(codes, call.w, call.K, call.N, p * kPanel, out, more ? codes + panel_bytes : nullptr);
    if (call.up) {
      const uint8_t* up_codes = call.up->packed + p * panel_bytes;
      dequantize_int4_panel(up_codes, *call.up, call.K, call.N, p * kPanel, up_out, more ? up_codes + panel_bytes : nullptr);
    }
  });
}

#else

bool Int8WeightsWidenedMatmulPacked(xla::ffi::ThreadPool&, const Int8WeightsCall&) { return false; }

bool Int4WidenedMatmulPacked(xla::ffi::ThreadPool&, const Int4Call&) { return false; }

#endif

}  // namespace paged::amx
