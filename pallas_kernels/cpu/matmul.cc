// Decode-sized matmul y[M, N] = x[M, K] @ w[K, N] on the CPU, as an XLA FFI custom call: float32 or bfloat16
// operands with float32 accumulation and result; and the quantized matmul (int8 or int4 codes with per-group
// scales, QuantMatmulCpu, at the end of this file).
//
// Why: XLA's CPU dot (YNNPACK) runs the decode steps' matmuls (M = 8-64 rows against the weights) at about
// 63% of its large-matmul rate whatever M is; in the CPU benchmark those matmuls are most of the step.
// This one computes y in 64-column panels: 6 rows x 64 columns of accumulators stay in registers while a
// block of KC rows of the panel, read once from memory, serves every row tile from L1. Each thread owns a
// contiguous range of panels and walks it block row by block row, so its reads of one weight row are one
// contiguous piece; while a block computes, its tiles prefetch the block that comes next.
//
// bfloat16 (AVX-512 BF16, vdpbf16ps): each instruction multiplies pairs of adjacent k and adds both products
// to one float32 lane, so a lane must hold (w[k, n], w[k+1, n]): two weight rows are interleaved in registers
// (vpunpck{l,h}wd, within 128-bit lanes, which permutes the columns; the tile's stores undo it), and the pair
// (x[m, k], x[m, k+1]) is one 32-bit broadcast, as x is row-major. The weights stay [K, N] as loaded, at half
// the bytes per decode step. XLA's own bf16 dot (f32 result) is 206 GFLOP/s at 8 rows on the benchmark CPU.
//
// Contract:
//   x     [M, K]  float32, or bfloat16 (then K even) (row-major)
//   w     [K, N]  x's dtype, N a multiple of 64
//   live  []      int32: rows [0, live) are computed, rows [live, M) of y are zeros. A step's products are
//                 padded to a bucket of rows; the padding is 8-12% of the rows of its compute-bound decode
//                 steps on the benchmark workload, and skipping it leaves every live row's result as it was
//                 (each row's sums run in the same order whatever the tile it falls in).
//   y     [M, N]  float32
// bfloat16 on a CPU with AMX runs on its tiles instead, at every row count (amx.cc). Other AVX-512 machines run
// the register-blocked path; elsewhere a plain loop keeps the call correct, and MatmulCpuIsVectorized() tells
// the model to keep XLA's dot.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "amx.h"
#include "bf16.h"
#include "head_screen.h"
#include "panels.h"
#include "parallel.h"
#include "transposed.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using paged::kPanel;
using paged::over_row_tiles;
using paged::over_panels;
using paged::zero_rows_past_live;

// Panel rows per block, read once from memory and kept in L1 across row tiles: 128 float32 rows or 256
// bfloat16 rows, 32 KB either way. (bf16 blocks of 128 rows moved y's partial sums twice as often: 64 rows
// ran at 709 against 799 GFLOP/s, 256 rows at 745 against 820; 512-row blocks were no faster.)
// Quantized blocks are 128 rows too: widened to float32 into an L1 buffer, a block is 32 KB again.
template <typename T>
constexpr int64_t kBlockK = 128;
template <>
constexpr int64_t kBlockK<uint16_t> = 256;
template <>
constexpr int64_t kBlockK<int8_t> = 128;

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return paged::bf16_to_float(v); }

#if defined(__AVX512F__)
// Rows [0, rows) of `next` (stride ldw) for a tile to prefetch: its share of the next block's weights, so
// they stream in while this block computes from L1. Prefetching only in the first tile (the row block that
// misses) ran the 48-row matmuls at 76% of the machine's matmul rate; spread over all tiles, 87%.
template <typename T>
struct Ahead {
  const T* next = nullptr;
  int64_t rows = 0;
};

// Requests one weight row of a panel (64 columns: 4 cache lines in float32, 2 in bfloat16).
template <typename T>
inline void prefetch_row(const T* row) {
  const char* line0 = reinterpret_cast<const char*>(row);
  for (int line = 0; line < static_cast<int>(kPanel * sizeof(T) / 64); ++line)
    _mm_prefetch(line0 + 64 * line, _MM_HINT_T1);
}

template <int MR>
inline void micro_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
                       int64_t kc, bool first, Ahead<float> ahead) {
  // One row of `ahead` every `stride` steps, spread over the tile so the memory requests trickle out.
  const int64_t stride = ahead.rows ? std::max<int64_t>(1, kc / ahead.rows) : kc + 1;
  int64_t next_row = 0;
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * ldy + c * 16);
  for (int64_t k = 0; k < kc; ++k) {
    const float* wk = w + k * ldw;
    if (k % stride == 0 && next_row < ahead.rows) prefetch_row(ahead.next + next_row++ * ldw);
    const __m512 b0 = _mm512_loadu_ps(wk), b1 = _mm512_loadu_ps(wk + 16);
    const __m512 b2 = _mm512_loadu_ps(wk + 32), b3 = _mm512_loadu_ps(wk + 48);
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(a, b3, acc[r][3]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(y + r * ldy + c * 16, acc[r][c]);
}

// Quantized weights: each block [kc, 64] is widened to float32 once, into a buffer that stays in L1 (`widened`),
// and every row tile runs the float32 tile on it (widening inside each tile repeated the conversion M / 6 times:
// 192-row products ran at 302 GFLOP/s against 386 for XLA's dot on the dequantized weights).
template <int MR>
inline void float_tile(const float* x, int64_t ldx, const float* w, float* y, int64_t ldy, int64_t kc, bool first) {
  micro_tile<MR>(x, ldx, w, kPanel, y, ldy, kc, first, Ahead<float>{});
}

// The float32 tiles over a widened block `buffer` [kc, 64] (row stride 64), accumulating into y.
inline void float_tiles(const float* x, int64_t ldx, const float* buffer, float* y, int64_t ldy, int64_t M,
                        int64_t kc, bool first) {
  over_row_tiles(M, [&](auto rows, int64_t m0) {
    float_tile<decltype(rows)::value>(x + m0 * ldx, ldx, buffer, y + m0 * ldy, ldy, kc, first);
  });
}

alignas(64) static thread_local float widened[kBlockK<int8_t> * kPanel];

// Row `q` (64 int8 codes) times the panel's 64 scales `s`, into `row`.
inline void widen_scaled_row(__m512i q, const __m512 s[4], float* row) {
  _mm512_store_ps(row, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(q))), s[0]));
  for (int c = 1; c < 4; ++c) {
    const __m128i part = c == 1 ? _mm512_extracti32x4_epi32(q, 1) : c == 2 ? _mm512_extracti32x4_epi32(q, 2)
                                                                          : _mm512_extracti32x4_epi32(q, 3);
    _mm512_store_ps(row + 16 * c, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(part)), s[c]));
  }
}

// A block of kc rows of quantized weights, all in one group, widened to float32 times the group's scales
// (64 floats at `scale`) into `widened`. Bits 8: int8 rows [kc, 64] (stride ldw). Bits 4: kc / 2 rows of
// packed pairs (low nibble row 2i, high nibble row 2i + 1, each code + 8).
// `next` (same stride, or null): the block that comes after, whose rows are prefetched one per row widened.
template <int Bits>
inline void widen_scaled_block(const uint8_t* w, int64_t ldw, const float* scale, int64_t kc, const uint8_t* next) {
  const __m512 s[4] = {_mm512_loadu_ps(scale), _mm512_loadu_ps(scale + 16), _mm512_loadu_ps(scale + 32),
                       _mm512_loadu_ps(scale + 48)};
  if constexpr (Bits == 8) {
    for (int64_t k = 0; k < kc; ++k) {
      if (next) _mm_prefetch(reinterpret_cast<const char*>(next + k * ldw), _MM_HINT_T0);
      widen_scaled_row(_mm512_loadu_si512(w + k * ldw), s, widened + k * kPanel);
    }
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    for (int64_t i = 0; i < kc / 2; ++i) {
      if (next) _mm_prefetch(reinterpret_cast<const char*>(next + i * ldw), _MM_HINT_T0);
      const __m512i packed = _mm512_loadu_si512(w + i * ldw);
      const __m512i lo = _mm512_sub_epi8(_mm512_and_si512(packed, low4), eight);
      const __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(packed, 4), low4), eight);
      widen_scaled_row(lo, s, widened + 2 * i * kPanel);
      widen_scaled_row(hi, s, widened + (2 * i + 1) * kPanel);
    }
  }
}
#endif

#if defined(__AVX512BF16__)
// After vpunpck{l,h}wd of two weight rows, the "lo" accumulator of 32 columns holds columns 8j..8j+3 of
// each 128-bit lane j and the "hi" one 8j+4..8j+7. kToOrder* pick columns [0, 16) and [16, 32) back out of
// (lo, hi); kFromOrder* build lo and hi from the columns in order (partial sums kept in y between blocks).
alignas(64) constexpr int32_t kToOrderFirst[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
alignas(64) constexpr int32_t kToOrderSecond[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
alignas(64) constexpr int32_t kFromOrderLo[16] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
alignas(64) constexpr int32_t kFromOrderHi[16] = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};

inline __m512 permute2(const int32_t* order, __m512 a, __m512 b) {
  return _mm512_permutex2var_ps(a, _mm512_load_si512(order), b);
}

// acc[r][0..1]: lo, hi of columns [0, 32) of row r; acc[r][2..3]: of columns [32, 64).
template <int MR>
inline void micro_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* y, int64_t ldy,
                       int64_t kc, bool first, Ahead<uint16_t> ahead) {
  const int64_t steps = kc / 2;  // k advances two rows per step
  const int64_t per_step = ahead.rows > steps ? 2 : 1;
  const int64_t stride = ahead.rows ? std::max<int64_t>(1, steps * per_step / ahead.rows) : steps + 1;
  int64_t next_row = 0;
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r) {
    for (int half = 0; half < 2; ++half) {
      if (first) {
        acc[r][2 * half] = acc[r][2 * half + 1] = _mm512_setzero_ps();
      } else {
        const __m512 c0 = _mm512_loadu_ps(y + r * ldy + 32 * half), c1 = _mm512_loadu_ps(y + r * ldy + 32 * half + 16);
        acc[r][2 * half] = permute2(kFromOrderLo, c0, c1);
        acc[r][2 * half + 1] = permute2(kFromOrderHi, c0, c1);
      }
    }
  }
  for (int64_t step = 0; step < steps; ++step) {
    const uint16_t* w0 = w + 2 * step * ldw;
    const uint16_t* w1 = w0 + ldw;
    if (step % stride == 0)
      for (int64_t i = 0; i < per_step && next_row < ahead.rows; ++i) prefetch_row(ahead.next + next_row++ * ldw);
    const __m512i r0a = _mm512_loadu_si512(w0), r1a = _mm512_loadu_si512(w1);
    const __m512i r0b = _mm512_loadu_si512(w0 + 32), r1b = _mm512_loadu_si512(w1 + 32);
    const __m512bh b0 = (__m512bh)_mm512_unpacklo_epi16(r0a, r1a), b1 = (__m512bh)_mm512_unpackhi_epi16(r0a, r1a);
    const __m512bh b2 = (__m512bh)_mm512_unpacklo_epi16(r0b, r1b), b3 = (__m512bh)_mm512_unpackhi_epi16(r0b, r1b);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;  // (x[r, k], x[r, k + 1]): the low half is x[r, k], as dpbf16 pairs it with w[k]
      std::memcpy(&pair, x + r * ldx + 2 * step, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, b3);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int half = 0; half < 2; ++half) {
      _mm512_storeu_ps(y + r * ldy + 32 * half, permute2(kToOrderFirst, acc[r][2 * half], acc[r][2 * half + 1]));
      _mm512_storeu_ps(y + r * ldy + 32 * half + 16, permute2(kToOrderSecond, acc[r][2 * half], acc[r][2 * half + 1]));
    }
  }
}
#endif

#if defined(__AVX512BF16__)
// ---- quantized weights against bfloat16 activations ----------------------------------------------------------
// Codes are small integers, exact in bfloat16 (every int8 fits its 8 significant bits), so a block of codes is
// widened once to bfloat16 pairs and multiplied by x's bfloat16 rows with vdpbf16ps: products exact, sums in
// float32, and the group's scales applied once to each block's sums instead of to every weight. Against the
// float32 path (codes times scales widened to float32, x in float32) a block is half the bytes in L1 and a
// k pair costs one instruction per 16 columns instead of two.
//
// `paired`: steps of two k rows, each four vectors of 16 column pairs (bf16(w[2s, n]), bf16(w[2s + 1, n])) in
// column order, the 32-bit lanes vdpbf16ps multiplies by (x[m, 2s], x[m, 2s + 1]).
alignas(64) static thread_local uint16_t paired[kBlockK<uint16_t> * kPanel];

// 16 int8 codes at p as floats (exact).
inline __m512 codes_as_floats(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The pairs of 16 columns from rows `even` and `odd` as floats: an exact small integer's bfloat16 is its
// float's high half, so each lane is (odd's high half, even's high half), no rounding needed.
inline __m512i pairs_of(__m512 even, __m512 odd) {
  return _mm512_ternarylogic_epi32(_mm512_castps_si512(odd), _mm512_srli_epi32(_mm512_castps_si512(even), 16),
                                   _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)), 0xEC);  // (a & c) | b
}

// bf16(code) for a nibble i = code + 8 (vpermw reads an index's low 5 bits: entries 16-31 repeat 0-15).
alignas(64) static const uint16_t kNibbleBf16[32] = {
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,  // -8 .. -1
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,  // 0 .. 7
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};

// Step s's four vectors of pairs (columns [0, 16), ..., [48, 64)) from a block of codes `w` (stride ldw).
template <int Bits>
inline void step_pairs(const uint8_t* w, int64_t ldw, int64_t s, __m512i out[4]) {
  if constexpr (Bits == 8) {
    const uint8_t* even = w + 2 * s * ldw;
    for (int c = 0; c < 4; ++c) out[c] = pairs_of(codes_as_floats(even + 16 * c), codes_as_floats(even + ldw + 16 * c));
  } else {  // byte row s holds rows 2s (low nibble) and 2s + 1 (high nibble): a table lookup per pair
    const __m512i table = _mm512_load_si512(kNibbleBf16);
    for (int c = 0; c < 4; ++c) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + s * ldw + 16 * c)));
      // Index words (b & 15, b >> 4): ((b << 12) | b) & 0x000F000F.
      const __m512i index = _mm512_ternarylogic_epi32(_mm512_slli_epi32(b, 12), b, _mm512_set1_epi32(0x000F000F), 0xA8);
      out[c] = _mm512_permutexvar_epi16(index, table);
    }
  }
}

// Requests step s's rows of `next` (the block that comes after), `lines` cache lines of each, as
// widen_scaled_block does its rows.
template <int Bits>
inline void prefetch_step(const uint8_t* next, int64_t ldw, int64_t s, int lines = 1) {
  if (!next) return;
  for (int64_t row = (Bits == 8 ? 2 * s : s); row < (Bits == 8 ? 2 * s + 2 : s + 1); ++row)
    for (int line = 0; line < lines; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(next + row * ldw + 64 * line), _MM_HINT_T1);
}

// kc rows (even) of codes into `paired`, for several row tiles to share.
template <int Bits>
inline void pair_block(const uint8_t* w, int64_t ldw, int64_t kc, const uint8_t* next) {
  for (int64_t s = 0; s < kc / 2; ++s) {
    prefetch_step<Bits>(next, ldw, s);
    __m512i pairs[4];
    step_pairs<Bits>(w, ldw, s, pairs);
    for (int c = 0; c < 4; ++c) _mm512_store_si512(paired + (4 * s + c) * 32, pairs[c]);
  }
}

// The block's sums for rows [0, MR) into y: y = scale * acc where `first`, else y += scale * acc.
template <int MR>
inline void store_scaled(const __m512 acc[MR][4], float* y, int64_t ldy, bool first, const float* scale) {
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < 4; ++c) {
      float* out = y + r * ldy + 16 * c;
      const __m512 sc = _mm512_loadu_ps(scale + 16 * c);
      _mm512_storeu_ps(out, first ? _mm512_mul_ps(acc[r][c], sc) : _mm512_fmadd_ps(acc[r][c], sc, _mm512_loadu_ps(out)));
    }
  }
}

template <int MR>
inline void multiply_step(const uint16_t* x, int64_t ldx, int64_t step, const __m512i pairs[4], __m512 acc[MR][4]) {
  for (int r = 0; r < MR; ++r) {
    int32_t pair;
    std::memcpy(&pair, x + r * ldx + 2 * step, sizeof pair);
    const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, (__m512bh)pairs[c]);
  }
}

// Up to 6 rows: one row tile, so each step's pairs go straight from the codes to the products (no buffer).
// P panels side by side (P x 64 columns, MR x 4P accumulators): one and two rows take 4 and 2, so that each
// weight row is read in P-line pieces rather than single lines at a stride of N bytes.
template <int Bits, int MR, int P>
inline void direct_tile(const uint16_t* x, int64_t ldx, const uint8_t* w, int64_t ldw, float* y, int64_t ldy,
                        int64_t kc, bool first, const float* scale, const uint8_t* next) {
  __m512 acc[MR][4 * P];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4 * P; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < kc / 2; ++s) {
    prefetch_step<Bits>(next, ldw, s, P);
    __m512i pairs[4 * P];
    for (int j = 0; j < P; ++j) step_pairs<Bits>(w + kPanel * j, ldw, s, pairs + 4 * j);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * s, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < 4 * P; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, (__m512bh)pairs[c]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < 4 * P; ++c) {
      float* out = y + r * ldy + 16 * c;
      const __m512 sc = _mm512_loadu_ps(scale + 16 * c);
      _mm512_storeu_ps(out, first ? _mm512_mul_ps(acc[r][c], sc) : _mm512_fmadd_ps(acc[r][c], sc, _mm512_loadu_ps(out)));
    }
  }
}

// The panels that one direct tile of M rows takes side by side.
inline int64_t direct_panels(int64_t M) { return M == 1 ? 4 : M == 2 ? 2 : 1; }

// M <= 6 rows over `width` panels (direct_panels(M), or fewer for a thread's last panels: one row over three
// panels rather than three single ones, which read each weight row in 64-byte pieces at a stride of N; the
// 0.5B down projection (4,864 x 896, int4 in groups of 128), one row: 1.2x).
template <int Bits>
inline void direct_tiles(const uint16_t* x, int64_t ldx, const uint8_t* w, int64_t ldw, float* y, int64_t ldy,
                         int64_t M, int64_t width, int64_t kc, bool first, const float* scale, const uint8_t* next) {
  if (M == 1 && width == 4) return direct_tile<Bits, 1, 4>(x, ldx, w, ldw, y, ldy, kc, first, scale, next);
  if (M == 1 && width == 3) return direct_tile<Bits, 1, 3>(x, ldx, w, ldw, y, ldy, kc, first, scale, next);
  if (M == 1 && width == 2) return direct_tile<Bits, 1, 2>(x, ldx, w, ldw, y, ldy, kc, first, scale, next);
  if (M == 2 && width == 2) return direct_tile<Bits, 2, 2>(x, ldx, w, ldw, y, ldy, kc, first, scale, next);
  over_row_tiles(M, [&](auto rows, int64_t) {  // M <= 6: one tile
    direct_tile<Bits, decltype(rows)::value, 1>(x, ldx, w, ldw, y, ldy, kc, first, scale, next);
  });
}

// y[r, :64] (+)= scale * (x[r, k0:k0+kc] @ the paired block), rows [0, MR): the block's sums start at zero and
// meet the group's scales (64 floats at `scale`) once, at the end.
template <int MR>
inline void paired_tile(const uint16_t* x, int64_t ldx, float* y, int64_t ldy, int64_t kc, bool first,
                        const float* scale) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t step = 0; step < kc / 2; ++step) {
    __m512i pairs[4];
    for (int c = 0; c < 4; ++c) pairs[c] = _mm512_load_si512(paired + (4 * step + c) * 32);
    multiply_step<MR>(x, ldx, step, pairs, acc);
  }
  store_scaled<MR>(acc, y, ldy, first, scale);
}

inline void paired_tiles(const uint16_t* x, int64_t ldx, float* y, int64_t ldy, int64_t M, int64_t kc, bool first,
                         const float* scale) {
  over_row_tiles(M, [&](auto rows, int64_t m0) {
    paired_tile<decltype(rows)::value>(x + m0 * ldx, ldx, y + m0 * ldy, ldy, kc, first, scale);
  });
}
#endif

// Whether this build has the register-blocked path for weights of type T (else the plain loops run; int8 stands
// for the quantized matmul).
template <typename T>
constexpr bool kVectorized = false;
#if defined(__AVX512F__)
template <>
constexpr bool kVectorized<float> = true;
template <>
constexpr bool kVectorized<int8_t> = true;
#endif
#if defined(__AVX512BF16__)
template <>
constexpr bool kVectorized<uint16_t> = true;
#endif

// Panels [p_begin, p_end) of y, a block of kBlockK<T> weight rows at a time: within a block a row's reads are
// contiguous across the panels (not one 256-byte piece per row and panel, which the hardware prefetcher
// and the TLB handle worse); partial sums wait in y between blocks.
template <typename X, typename T>
void panels(const X* x, const T* w, float* y, int64_t M, int64_t K, int64_t N, int64_t p_begin, int64_t p_end) {
  if constexpr (kVectorized<T>) {
#if defined(__AVX512F__)
    const int64_t tiles = (M + 5) / 6;
    constexpr int64_t block = kBlockK<T>;
    for (int64_t k0 = 0; k0 < K; k0 += block) {
      const int64_t kc = std::min(block, K - k0);
      const bool first = k0 == 0;
      for (int64_t p = p_begin; p < p_end; ++p) {
        const int64_t n0 = p * kPanel;
        const T* wp = w + k0 * N + n0;
        // The next panel's block, or after the last panel the first panel's next block.
        const T* next = nullptr;
        int64_t next_rows = 0;
        if (p + 1 < p_end) {
          next = wp + kPanel;
          next_rows = kc;
        } else if (k0 + block < K) {
          next = w + (k0 + block) * N + p_begin * kPanel;
          next_rows = std::min(block, K - k0 - block);
        }
        const int64_t per_tile = (next_rows + tiles - 1) / tiles;
        auto ahead = [&](int64_t tile) {
          const int64_t begin = std::min(next_rows, tile * per_tile);
          return Ahead<T>{next + begin * N, std::min(next_rows, begin + per_tile) - begin};
        };
        over_row_tiles(M, [&](auto rows, int64_t m0) {
          micro_tile<decltype(rows)::value>(x + m0 * K + k0, K, wp, N, y + m0 * N + n0, N, kc, first, ahead(m0 / 6));
        });
      }
    }
#endif
  } else {
    for (int64_t n0 = p_begin * kPanel; n0 < p_end * kPanel; n0 += kPanel) {
      for (int64_t m = 0; m < M; ++m) {
        float acc[kPanel] = {};
        for (int64_t k = 0; k < K; ++k) {
          const float a = to_float(x[m * K + k]);
          const T* wk = w + k * N + n0;
          for (int64_t c = 0; c < kPanel; ++c) acc[c] += a * to_float(wk[c]);
        }
        std::copy(acc, acc + kPanel, y + m * N + n0);
      }
    }
  }
}

template <typename X, typename T>
void matmul(ffi::ThreadPool& pool, const X* xp, const T* wp, float* yp, int64_t M, int64_t K, int64_t N) {
  over_panels(pool, N / kPanel, [&](int64_t p0, int64_t p1) { panels(xp, wp, yp, M, K, N, p0, p1); });
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> live,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || wd[1] % kPanel)
    return ffi::Error::InvalidArgument("matmul_cpu: expected x [M, K] and w [K, N] with N a multiple of 64");
  if (live.element_count() != 1) return ffi::Error::InvalidArgument("matmul_cpu: expected a scalar live row count");
  if (x.element_type() != w.element_type())
    return ffi::Error::InvalidArgument("matmul_cpu: x and w must share a dtype");
  const int64_t K = xd[1], N = wd[1];
  float* yp = y->typed_data();
  const int64_t M = zero_rows_past_live(live, xd[0], N, yp);
  if (M == 0) return ffi::Error::Success();
  switch (x.element_type()) {
    case ffi::DataType::F32:
      matmul(pool, x.typed_data<float>(), w.typed_data<float>(), yp, M, K, N);
      break;
    case ffi::DataType::BF16:
      if (K % 2) return ffi::Error::InvalidArgument("matmul_cpu: bfloat16 needs an even K");
      if (paged::amx::Available() &&
          paged::amx::Matmul(pool, static_cast<const uint16_t*>(x.untyped_data()),
                             static_cast<const uint16_t*>(w.untyped_data()), yp, M, K, N))
        break;
      matmul(pool, static_cast<const uint16_t*>(x.untyped_data()), static_cast<const uint16_t*>(w.untyped_data()),
             yp, M, K, N);
      break;
    default:
      return ffi::Error::InvalidArgument("matmul_cpu: dtype must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}


// y[M, N] = x[M, K] @ w in bfloat16 on AMX tiles, w packed at load (amx.h: MatmulPacked) [N / 64, ceil(K / 32),
// 2048]; rows [live, M) zeros.
ffi::Error MatmulPackedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> live,
                            ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != (xd[1] + 31) / 32 || wd[2] != 4 * 16 * 32)
    return ffi::Error::InvalidArgument("matmul_packed_cpu: expected x [M, K] and w [N / 64, ceil(K / 32), 2048]");
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("matmul_packed_cpu: x and w must be bfloat16");
  if (live.element_count() != 1)
    return ffi::Error::InvalidArgument("matmul_packed_cpu: expected a scalar live row count");
  const int64_t K = xd[1], N = wd[0] * kPanel;
  float* yp = y->typed_data();
  const int64_t M = zero_rows_past_live(live, xd[0], N, yp);
  if (M == 0) return ffi::Error::Success();
  if (!paged::amx::Available() ||
      !paged::amx::MatmulPacked(pool, static_cast<const uint16_t*>(x.untyped_data()),
                                static_cast<const uint16_t*>(w.untyped_data()), yp, M, K, N))
    return ffi::Error::Internal("matmul_packed_cpu: no AMX tiles, or x's packed copy could not be allocated");
  return ffi::Error::Success();
}

// y[M, N] = bf16(x @ w + bias) on AMX tiles (amx.h: MatmulPackedRounded), w as matmul_packed_cpu's, bias
// bfloat16 [N] or [0] for none; sums: float32 [M, N] scratch for the partial sums of long products. Rows
// [live, M) of y zeros.
ffi::Error MatmulPackedRoundedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias,
                                   ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::BF16> y,
                                   ffi::ResultBuffer<ffi::F32> sums) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != (xd[1] + 31) / 32 || wd[2] != 4 * 16 * 32)
    return ffi::Error::InvalidArgument(
        "matmul_packed_rounded_cpu: expected x [M, K] and w [N / 64, ceil(K / 32), 2048]");
  const int64_t K = xd[1], N = wd[0] * kPanel;
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16 ||
      bias.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("matmul_packed_rounded_cpu: x, w and bias must be bfloat16");
  if (bias.dimensions().size() != 1 || (bias.element_count() != N && bias.element_count() != 0))
    return ffi::Error::InvalidArgument("matmul_packed_rounded_cpu: expected bias [N] or [0]");
  if (live.element_count() != 1)
    return ffi::Error::InvalidArgument("matmul_packed_rounded_cpu: expected a scalar live row count");
  if (sums->element_count() != xd[0] * N)
    return ffi::Error::InvalidArgument("matmul_packed_rounded_cpu: expected float32 sums [M, N]");
  uint16_t* yp = reinterpret_cast<uint16_t*>(y->untyped_data());
  const int64_t M = zero_rows_past_live(live, xd[0], N, yp);
  if (M == 0) return ffi::Error::Success();
  const auto* bp = bias.element_count() ? static_cast<const uint16_t*>(bias.untyped_data()) : nullptr;
  if (!paged::amx::Available() ||
      !paged::amx::MatmulPackedRounded(pool, static_cast<const uint16_t*>(x.untyped_data()),
                                       static_cast<const uint16_t*>(w.untyped_data()), bp, yp,
                                       sums->typed_data(), M, K, N))
    return ffi::Error::Internal(
        "matmul_packed_rounded_cpu: no AMX tiles, or x's packed copy could not be allocated");
  return ffi::Error::Success();
}

// y[M, N] = silu(x @ gate) * (x @ up), bfloat16, on AMX tiles (amx.h: GatedMatmulPacked), gate and up packed at
// load as matmul_packed_cpu's w; rows [live, M) zeros.
ffi::Error GatedMatmulPackedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                                 ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::BF16> y) {
  const auto xd = x.dimensions();
  const auto gd = gate.dimensions();
  if (xd.size() != 2 || gd.size() != 3 || gd[1] != (xd[1] + 31) / 32 || gd[2] != 4 * 16 * 32 ||
      up.dimensions().size() != 3 || up.element_count() != gate.element_count() || up.dimensions()[0] != gd[0])
    return ffi::Error::InvalidArgument(
        "gated_matmul_packed_cpu: expected x [M, K] and gate, up both [N / 64, ceil(K / 32), 2048]");
  if (x.element_type() != ffi::DataType::BF16 || gate.element_type() != ffi::DataType::BF16 ||
      up.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("gated_matmul_packed_cpu: x, gate and up must be bfloat16");
  if (live.element_count() != 1)
    return ffi::Error::InvalidArgument("gated_matmul_packed_cpu: expected a scalar live row count");
  const int64_t K = xd[1], N = gd[0] * kPanel;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y->untyped_data());
  const int64_t M = zero_rows_past_live(live, xd[0], N, yp);
  if (M == 0) return ffi::Error::Success();
  if (!paged::amx::Available() ||
      !paged::amx::GatedMatmulPacked(pool, static_cast<const uint16_t*>(x.untyped_data()),
                                     static_cast<const uint16_t*>(gate.untyped_data()),
                                     static_cast<const uint16_t*>(up.untyped_data()), yp, M, K, N))
    return ffi::Error::Internal("gated_matmul_packed_cpu: no AMX tiles, or x's packed copy could not be allocated");
  return ffi::Error::Success();
}

// y[M, N] = x[M, K] @ w[N, K]^T in bfloat16 on AMX tiles (amx.cc: MatmulTransposed), or on AVX-512 BF16 without
// them (transposed.cc), rows [live, M) zeros: the tied LM head against the embedding table as stored. K a
// multiple of 32.
ffi::Error MatmulTransposedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> live,
                                ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || x.element_type() != ffi::DataType::BF16 ||
      w.element_type() != ffi::DataType::BF16 || live.element_count() != 1)
    return ffi::Error::InvalidArgument("matmul_transposed_cpu: expected bfloat16 x [M, K], w [N, K], a scalar live");
  const int64_t K = xd[1], N = wd[0];
  float* yp = y->typed_data();
  const int64_t M = zero_rows_past_live(live, xd[0], N, yp);
  if (M == 0) return ffi::Error::Success();
  const auto* xp = static_cast<const uint16_t*>(x.untyped_data());
  const auto* wp = static_cast<const uint16_t*>(w.untyped_data());
  if (!(paged::amx::Available() ? paged::amx::MatmulTransposed(pool, xp, wp, yp, M, K, N)
                                : paged::avx512bf16::MatmulTransposed(pool, xp, wp, yp, M, K, N)))
    return ffi::Error::InvalidArgument("matmul_transposed_cpu: needs AMX or AVX-512 BF16, and K a multiple of 32");
  return ffi::Error::Success();
}

// tokens[m] = argmax over n of (x @ w^T)[m, n] (amx.cc: MatmulTransposedArgmax), rows [live, M) zeros: the
// greedy LM head without the logits. Same operands and conditions as matmul_transposed_cpu.
ffi::Error MatmulTransposedArgmaxImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                      ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::S32> tokens) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || wd[0] < 1 || x.element_type() != ffi::DataType::BF16 ||
      w.element_type() != ffi::DataType::BF16 || live.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "matmul_transposed_argmax_cpu: expected bfloat16 x [M, K], w [N, K] with N >= 1, a scalar live");
  const int64_t K = xd[1], N = wd[0];
  int32_t* out = tokens->typed_data();
  const int64_t M = std::clamp<int64_t>(live.typed_data()[0], 0, xd[0]);
  std::fill(out + M, out + xd[0], 0);
  if (M == 0) return ffi::Error::Success();
  const auto* xp = static_cast<const uint16_t*>(x.untyped_data());
  const auto* wp = static_cast<const uint16_t*>(w.untyped_data());
  if (!(paged::amx::Available() ? paged::amx::MatmulTransposedArgmax(pool, xp, wp, out, M, K, N)
                                : paged::avx512bf16::MatmulTransposedArgmax(pool, xp, wp, out, M, K, N)))
    return ffi::Error::InvalidArgument(
        "matmul_transposed_argmax_cpu: needs AMX or AVX-512 BF16, and K a multiple of 32");
  return ffi::Error::Success();
}

// matmul_transposed_argmax_cpu's tokens through the table's int8 screen (head_screen.cc): x [M, K] and w [N, K]
// bfloat16, codes int8 [ceil(N / 32) * 32 * ceil(K / 64) * 64] in the screen's tile order, stats float32
// [3, ceil(N / 32) * 32], limits float32 [2] (the largest row norm, the largest |w|), live int32 [].
ffi::Error ScreenedArgmaxImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer codes,
                              ffi::Buffer<ffi::F32> stats, ffi::Buffer<ffi::F32> limits, ffi::Buffer<ffi::S32> live,
                              ffi::ResultBuffer<ffi::S32> tokens) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || wd[0] < 1 || x.element_type() != ffi::DataType::BF16 ||
      w.element_type() != ffi::DataType::BF16 || live.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "screened_argmax_cpu: expected bfloat16 x [M, K], w [N, K] with N >= 1, a scalar live");
  const int64_t K = xd[1], N = wd[0], padded_rows = (N + 31) / 32 * 32, K64 = (K + 63) / 64 * 64;
  if (codes.element_type() != ffi::DataType::S8 || static_cast<int64_t>(codes.element_count()) != padded_rows * K64 ||
      static_cast<int64_t>(stats.element_count()) != 3 * padded_rows || limits.element_count() != 2)
    return ffi::Error::InvalidArgument("screened_argmax_cpu: the screen's codes, stats or limits do not fit w");
  int32_t* out = tokens->typed_data();
  const int64_t M = std::clamp<int64_t>(live.typed_data()[0], 0, xd[0]);
  std::fill(out + M, out + xd[0], 0);
  if (M == 0) return ffi::Error::Success();
  const paged::screen::ScreenTable table{static_cast<const int8_t*>(codes.untyped_data()), stats.typed_data(), N,
                                      padded_rows, limits.typed_data()[0], limits.typed_data()[1]};
  if (!paged::screen::ScreenedArgmax(pool, static_cast<const uint16_t*>(x.untyped_data()),
                                  static_cast<const uint16_t*>(w.untyped_data()), table, out, M, K))
    return ffi::Error::InvalidArgument("screened_argmax_cpu: needs AMX-INT8 or AVX-512 VNNI and BF16, and K a multiple of 32");
  return ffi::Error::Success();
}

// The screen of a table w [N, K] bfloat16 (head_screen.cc: BuildScreen): codes int8 [ceil(N / 32) * 32 *
// ceil(K / 64) * 64], stats float32 [3, ceil(N / 32) * 32], limits float32 [2] (both NaN where w is not finite).
ffi::Error BuildScreenImpl(ffi::ThreadPool pool, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::S8> codes,
                           ffi::ResultBuffer<ffi::F32> stats, ffi::ResultBuffer<ffi::F32> limits) {
  const auto wd = w.dimensions();
  if (wd.size() != 2 || wd[0] < 1 || w.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("greedy_screen_cpu: expected a bfloat16 table [N, K] with N >= 1");
  const int64_t N = wd[0], K = wd[1], padded_rows = (N + 31) / 32 * 32, K64 = (K + 63) / 64 * 64;
  if (static_cast<int64_t>(codes->element_count()) != padded_rows * K64 ||
      static_cast<int64_t>(stats->element_count()) != 3 * padded_rows || limits->element_count() != 2)
    return ffi::Error::InvalidArgument("greedy_screen_cpu: the outputs do not fit the table");
  float* out_limits = limits->typed_data();
  if (!paged::screen::BuildScreen(pool, static_cast<const uint16_t*>(w.untyped_data()), N, K, codes->typed_data(),
                               stats->typed_data(), out_limits))
    out_limits[0] = out_limits[1] = NAN;
  return ffi::Error::Success();
}

// ---- quantized weights with per-group scales (GPTQ, AWQ, compressed-tensors; int8 or packed int4) -------
//
// y[M, N] = x[M, K] @ W + bias with W[k, n] = code[k, n] * scales[g, n] - offsets[g, n], g = k / group_rows:
// each block of weight rows (inside one group) is widened to float32 times its group's scales into the L1
// buffer, and the float32 tiles run on it; with bfloat16 x the codes are widened to bfloat16 pairs instead and
// the scales meet each block's sums (paired_tile, direct_tile). The zero points' part, (x's sums over the
// block) * offsets, is taken from each block's sums as it lands, and the bias is added and the result rounded
// once per pass of panels, so a layer is one call: its float32 product never leaves the call to meet its
// zero points, bias and rounding in three more passes of the step.
//   x        [M, K]      float32, or bfloat16 (then K and the rows per group even)
//   w        [K, N] int8 codes, or [K / 2, N] uint8: rows 2i and 2i + 1 in the low and high nibble, code + 8
//   scales   [G, N]      float32 or bfloat16, G = K / group_rows; group_rows a multiple or a divisor of 128
//                        (even for int4)
//   offsets  [G, N] or [0]  float32 or bfloat16: scale * (zero point - centre), or none
//   bias     [N] or [0]  float32 or bfloat16, or none
//   live     []          int32, as for MatmulCpu
//   y        [M, N]      float32 or bfloat16
//   sums     [M, N] or [0]  float32 scratch: the partial sums of a bfloat16 y (float32 y holds its own)

// A vector operand (scales, offsets or bias) as the call got it: float32 or bfloat16 values, or none.
struct Vector {
  const void* data = nullptr;
  bool bf16 = false;
  explicit operator bool() const { return data != nullptr; }
  float at(int64_t i) const {
    return bf16 ? paged::bf16_to_float(static_cast<const uint16_t*>(data)[i]) : static_cast<const float*>(data)[i];
  }
  // Whether the count values from index i are all +0: symmetric schemes' zero offsets (GPTQ with sym, online
  // int8) are, and testing their bits costs a fraction of converting and subtracting them.
  bool zeros(int64_t i, int64_t count) const {
    const int64_t bytes = count * (bf16 ? 2 : 4);
    const char* p = static_cast<const char*>(data) + i * (bf16 ? 2 : 4);
    int64_t b = 0;
#if defined(__AVX512F__)
    __m512i any = _mm512_setzero_si512();
    for (; b + 64 <= bytes; b += 64) any = _mm512_or_si512(any, _mm512_loadu_si512(p + b));
    if (_mm512_test_epi64_mask(any, any)) return false;
#endif
    for (; b < bytes; ++b)
      if (p[b]) return false;
    return true;
  }
  // count values from index i as float32: the data itself, or converted into `tmp`.
  const float* floats(int64_t i, int64_t count, float* tmp) const {
    if (!bf16) return static_cast<const float*>(data) + i;
    const uint16_t* p = static_cast<const uint16_t*>(data) + i;
#if defined(__AVX512F__)
    for (int64_t c = 0; c < count; c += 16) _mm512_storeu_ps(tmp + c, paged::load_bf16x16(p + c));
#else
    for (int64_t c = 0; c < count; ++c) tmp[c] = paged::bf16_to_float(p[c]);
#endif
    return tmp;
  }
};

// What one quantized call multiplies by, beside the codes.
struct QuantVectors {
  Vector scales, offsets, bias;
  const float* block_sums;  // with offsets: [M][blocks] float32 sums of x over each block's rows
  int64_t blocks;
};

// The most panels one direct tile takes side by side: the vectors' columns for a block fit a 256-float buffer.
constexpr int64_t kMaxTilePanels = 4;

// y[m, n0 + c] -= block_sums[m] * offsets[c] for c in [0, count), rows [0, M) (row stride ldy): the zero points'
// part of one block, whose rows lie in one group.
inline void subtract_offsets(float* y, int64_t ldy, int64_t M, const float* block_sums, int64_t blocks,
                             const float* offsets, int64_t count) {
  for (int64_t m = 0; m < M; ++m) {
    const float s = block_sums[m * blocks];
    float* row = y + m * ldy;
#if defined(__AVX512F__)
    for (int64_t c = 0; c < count; c += 16)
      _mm512_storeu_ps(row + c, _mm512_fnmadd_ps(_mm512_set1_ps(s), _mm512_loadu_ps(offsets + c), _mm512_loadu_ps(row + c)));
#else
    for (int64_t c = 0; c < count; ++c) row[c] -= s * offsets[c];
#endif
  }
}

// The rows per block quant_panels walks: bfloat16 blocks are 256 rows where the groups allow (32 KB paired,
// as float32's 128 rows are widened); else 128, or the group's rows. Blocks lie inside one group (or span the
// only one).
inline int64_t quant_block_rows(bool bf16, int64_t K, int64_t group_rows) {
  return bf16 && (group_rows == K || group_rows % kBlockK<uint16_t> == 0) ? kBlockK<uint16_t>
                                                                         : std::min<int64_t>(kBlockK<int8_t>, group_rows);
}

template <int Bits, typename X>
void quant_panels(const X* x, const uint8_t* w, const QuantVectors& v, float* y, int64_t M, int64_t K,
                  int64_t N, int64_t group_rows, int64_t p_begin, int64_t p_end) {
  constexpr bool bf16 = std::is_same_v<X, uint16_t>;
  if constexpr (bf16 ? kVectorized<uint16_t> : kVectorized<int8_t>) {
#if defined(__AVX512F__)
    alignas(64) float scale_tmp[kMaxTilePanels * kPanel], offset_tmp[kMaxTilePanels * kPanel];
    const int64_t block = quant_block_rows(bf16, K, group_rows);
    for (int64_t k0 = 0; k0 < K; k0 += block) {
      const int64_t kc = std::min(block, K - k0);
      const int64_t row = (k0 / group_rows) * N;  // the block's group's vectors
      const uint8_t* block_rows = w + (Bits == 8 ? k0 : k0 / 2) * N;
      const uint8_t* next_block = k0 + block < K ? w + (Bits == 8 ? k0 + block : (k0 + block) / 2) * N : nullptr;
      // Panels a tile at a time (several for the direct tiles of one or two rows).
      const int64_t group = bf16 && M <= 6 ? direct_panels(M) : 1;
      for (int64_t p = p_begin; p < p_end;) {
        const int64_t width = std::min(group, p_end - p);
        const int64_t n0 = p * kPanel;
        const float* scale = v.scales.floats(row + n0, width * kPanel, scale_tmp);
        // The next panels' block, or after the last panel the first panel's next block (as panels() does).
        const uint8_t* next = p + width < p_end ? block_rows + n0 + width * kPanel
                              : next_block ? next_block + p_begin * kPanel : nullptr;
        if constexpr (bf16) {
#if defined(__AVX512BF16__)
          if (M <= 6) {
            direct_tiles<Bits>(x + k0, K, block_rows + n0, N, y + n0, N, M, width, kc, k0 == 0, scale, next);
          } else {
            pair_block<Bits>(block_rows + n0, N, kc, next);
            paired_tiles(x + k0, K, y + n0, N, M, kc, k0 == 0, scale);
          }
#endif
        } else {
          widen_scaled_block<Bits>(block_rows + n0, N, scale, kc, next);
          float_tiles(x + k0, K, widened, y + n0, N, M, kc, k0 == 0);
        }
        if (v.offsets && !v.offsets.zeros(row + n0, width * kPanel))
          subtract_offsets(y + n0, N, M, v.block_sums + k0 / block, v.blocks,
                           v.offsets.floats(row + n0, width * kPanel, offset_tmp), width * kPanel);
        p += width;
      }
    }
#endif
  } else {
    for (int64_t n = p_begin * kPanel; n < p_end * kPanel; ++n) {
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.0f;
        for (int64_t k = 0; k < K; ++k) {
          const int code = Bits == 8 ? static_cast<int8_t>(w[k * N + n]) : ((w[(k / 2) * N + n] >> (4 * (k % 2))) & 15) - 8;
          const int64_t g = (k / group_rows) * N + n;
          const float weight = static_cast<float>(code) * v.scales.at(g) - (v.offsets ? v.offsets.at(g) : 0.0f);
          acc += to_float(x[m * K + k]) * weight;
        }
        y[m * N + n] = acc;
      }
    }
  }
}

// The float32 sum of x[0, n).
template <typename X>
float sum_of(const X* x, int64_t n) {
  int64_t i = 0;
  float sum = 0.0f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    if constexpr (std::is_same_v<X, uint16_t>)
      acc = _mm512_add_ps(acc, paged::load_bf16x16(x + i));
    else
      acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + i));
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) sum += to_float(x[i]);
  return sum;
}

// [M][blocks] float32 sums of x over each block of `block` rows (the last may be short), for the offsets.
template <typename X>
std::vector<float> x_block_sums(const X* x, int64_t M, int64_t K, int64_t block) {
  const int64_t blocks = (K + block - 1) / block;
  std::vector<float> sums(M * blocks);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) sums[m * blocks + b] = sum_of(x + m * K + b * block, std::min(block, K - b * block));
  return sums;
}

// Panels [p_begin, p_end) of the float32 sums y32 (row stride N) plus the bias, into y: float32 in place, or
// rounded once to bfloat16.
void finish_panels(float* y32, const Vector& bias, void* y, bool y_bf16, int64_t M, int64_t N, int64_t p_begin,
                   int64_t p_end) {
  const int64_t n0 = p_begin * kPanel, count = (p_end - p_begin) * kPanel;
  for (int64_t m = 0; m < M; ++m) {
    float* row = y32 + m * N + n0;
    if (bias) {
      for (int64_t c = 0; c < count; c += kPanel) {
        alignas(64) float tmp[kPanel];
        const float* b = bias.floats(n0 + c, kPanel, tmp);
        for (int64_t i = 0; i < kPanel; ++i) row[c + i] += b[i];
      }
    }
    if (y_bf16) {
      uint16_t* out = static_cast<uint16_t*>(y) + m * N + n0;
#if defined(__AVX512F__)
      for (int64_t c = 0; c < count; c += 16) paged::store_bf16x16(out + c, _mm512_loadu_ps(row + c));
#else
      for (int64_t c = 0; c < count; ++c) out[c] = paged::float_to_bf16(row[c]);
#endif
    }
  }
}

// A float32 or bfloat16 vector operand of `count` values (0: none), or an error naming it.
ffi::Error vector_operand(ffi::AnyBuffer buffer, int64_t count, const char* what, Vector* out) {
  const auto type = buffer.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument(std::string("quant_matmul_cpu: ") + what + " must be float32 or bfloat16");
  if (buffer.element_count() == 0) return ffi::Error::Success();
  if (static_cast<int64_t>(buffer.element_count()) != count)
    return ffi::Error::InvalidArgument(std::string("quant_matmul_cpu: ") + what + " does not fit w");
  *out = Vector{buffer.untyped_data(), type == ffi::DataType::BF16};
  return ffi::Error::Success();
}

// x float32 or bfloat16 (then K and the rows per group even: k pairs), w, scales, offsets, bias, live -> y
// (see above).
ffi::Error QuantMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scales,
                           ffi::AnyBuffer offsets, ffi::AnyBuffer bias, ffi::Buffer<ffi::S32> live,
                           ffi::Result<ffi::AnyBuffer> y, ffi::ResultBuffer<ffi::F32> sums) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto sd = scales.dimensions();
  const int bits = w.element_type() == ffi::DataType::S8 ? 8 : w.element_type() == ffi::DataType::U8 ? 4 : 0;
  if (!bits) return ffi::Error::InvalidArgument("quant_matmul_cpu: w must be int8 codes or uint8 packed int4");
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  if (!bf16 && x.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: x must be float32 or bfloat16");
  if (xd.size() != 2 || wd.size() != 2 || sd.size() != 2 || live.element_count() != 1)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: expected x [M, K], w 2-D, scales [G, N], a scalar live");
  const int64_t K = xd[1], N = wd[1], G = sd[0];
  if (wd[0] * (bits == 4 ? 2 : 1) != K || N % kPanel || sd[1] != N || G < 1 || K % G)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: w must be [K, N] (int8) or [K / 2, N] (int4) with N a "
                                       "multiple of 64, scales [G, N] with G dividing K");
  const int64_t group_rows = K / G;
  if ((group_rows % kBlockK<int8_t> && kBlockK<int8_t> % group_rows) || (bits == 4 && group_rows % 2))
    return ffi::Error::InvalidArgument("quant_matmul_cpu: rows per group must be a multiple or a divisor of 128 "
                                       "(and even for int4)");
  if (bf16 && group_rows % 2)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: bfloat16 x needs an even number of rows per group");
  QuantVectors v{};
  for (auto [buffer, count, what, out] : {std::tuple{scales, G * N, "scales", &v.scales},
                                          std::tuple{offsets, G * N, "offsets", &v.offsets},
                                          std::tuple{bias, N, "bias", &v.bias}})
    if (auto error = vector_operand(buffer, count, what, out); error.failure()) return error;
  const bool y_bf16 = y->element_type() == ffi::DataType::BF16;
  if ((!y_bf16 && y->element_type() != ffi::DataType::F32) || y->dimensions().size() != 2 ||
      y->dimensions()[0] != xd[0] || y->dimensions()[1] != N)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: y must be float32 or bfloat16 [M, N]");
  if (static_cast<int64_t>(sums->element_count()) != (y_bf16 ? xd[0] * N : 0))
    return ffi::Error::InvalidArgument("quant_matmul_cpu: expected float32 sums [M, N] for a bfloat16 y, else [0]");
  const int64_t M = y_bf16 ? zero_rows_past_live(live, xd[0], N, static_cast<uint16_t*>(y->untyped_data()))
                           : zero_rows_past_live(live, xd[0], N, static_cast<float*>(y->untyped_data()));
  if (M == 0) return ffi::Error::Success();
  float* y32 = y_bf16 ? sums->typed_data() : static_cast<float*>(y->untyped_data());
  const auto* wp = static_cast<const uint8_t*>(w.untyped_data());
  const bool vectorized_bf16 = bf16 && kVectorized<uint16_t>;
  const int64_t block = kVectorized<int8_t> ? quant_block_rows(vectorized_bf16, K, group_rows) : K;
  std::vector<float> x_sums;
  if (v.offsets) {
    x_sums = bf16 ? x_block_sums(static_cast<const uint16_t*>(x.untyped_data()), M, K, block)
                  : x_block_sums(static_cast<const float*>(x.untyped_data()), M, K, block);
    v.block_sums = x_sums.data();
    v.blocks = (K + block - 1) / block;
  }
  over_panels(pool, N / kPanel, [&](int64_t p0, int64_t p1) {
    if (bf16) {
      const auto* xp = static_cast<const uint16_t*>(x.untyped_data());
      if (bits == 8)
        quant_panels<8>(xp, wp, v, y32, M, K, N, group_rows, p0, p1);
      else
        quant_panels<4>(xp, wp, v, y32, M, K, N, group_rows, p0, p1);
    } else {
      const auto* xp = static_cast<const float*>(x.untyped_data());
      if (bits == 8)
        quant_panels<8>(xp, wp, v, y32, M, K, N, group_rows, p0, p1);
      else
        quant_panels<4>(xp, wp, v, y32, M, K, N, group_rows, p0, p1);
    }
    if (v.bias || y_bf16) finish_panels(y32, v.bias, y->untyped_data(), y_bf16, M, N, p0, p1);
  });
  return ffi::Error::Success();
}

}  // namespace

// Whether this build has the fast path for float32 / bfloat16; without it the model keeps XLA's dot
// (models/linear.py: native_cpu_matmul).
extern "C" int MatmulCpuIsVectorized() { return kVectorized<float>; }
extern "C" int MatmulCpuBf16IsVectorized() { return kVectorized<uint16_t> || paged::amx::Available(); }
// Whether bfloat16 products run on AMX tiles (amx.cc): fast at every row count, so the model sends them all here.
extern "C" int MatmulCpuBf16UsesAmx() { return paged::amx::Available(); }
// Whether the transposed calls (the tied LM head) have a kernel: AMX tiles, or AVX-512 BF16 (transposed.cc).
extern "C" int MatmulTransposedIsAvailable() { return paged::amx::Available() || paged::avx512bf16::Available(); }
extern "C" int QuantMatmulCpuIsVectorized() { return kVectorized<int8_t>; }
// Whether bfloat16 x takes the vdpbf16ps path (else a plain loop: the model passes float32 x instead).
extern "C" int QuantMatmulCpuBf16IsVectorized() { return kVectorized<uint16_t>; }

// x, w, live -> y float32: the signature MatmulCpu, MatmulPackedCpu and MatmulTransposedCpu share.
static auto MatmulBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulCpu, MatmulImpl, MatmulBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulTransposedCpu, MatmulTransposedImpl, MatmulBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulPackedCpu, MatmulPackedImpl, MatmulBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulTransposedArgmaxCpu, MatmulTransposedArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScreenedArgmaxCpu, ScreenedArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(BuildScreenCpu, BuildScreenImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int ScreenedArgmaxIsAvailable() { return paged::screen::Available(); }

// x and two more operands (w and bias, or gate and up), live: the arguments both packed calls below take.
static auto ThreeOperandsAndLive() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulPackedRoundedCpu, MatmulPackedRoundedImpl,
                              ThreeOperandsAndLive().Ret<ffi::Buffer<ffi::BF16>>().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatedMatmulPackedCpu, GatedMatmulPackedImpl,
                              ThreeOperandsAndLive().Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantMatmulCpu, QuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
