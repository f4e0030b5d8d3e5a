// Int8 codes on Intel AMX tiles: W8A8 (below); weight-only int8, with x as int8 digits at decode sizes
// (amx_digits.h) and the codes widened to bfloat16 for prompts; and int4's prompt steps, dequantized to
// bfloat16 a panel at a time (its decode steps: amx_int4.cc).
//
// W8A8 on Intel AMX tiles: y[M, N] = (xq @ wq) * x_scale[m] * w_scale[n] (- zero points) (+ bias), with x
// quantized per row inside the call, int8 codes on both sides and exact int32 sums (amx.h: W8A8MatmulPacked;
// int8_matmul.cc binds it as XLA FFI calls); gated, silu of that times the up projection's, so that neither
// product reaches memory in float32 and no separate pass applies the activation (XLA's bfloat16 silu * up
// over [2048, 4864] took 27 ms, about what the two products take on the tiles).
//
// Why: TDPBSSD multiplies a 16 x 64 int8 tile by a 64 x 16 one into 16 x 16 int32 sums in the time TDPBF16PS
// takes for half the depth: twice the multiply-adds of the bfloat16 tiles (amx.cc) for the same bytes moved,
// and the weights are half bfloat16's bytes, which is what a decode step waits for. Quantizing x here
// instead of in XLA matters as much: XLA's per-row quantization (models/quantization.py: activation_codes,
// whose true divisions it must not fold) makes several passes over a float32 copy of x, which at prompt sizes
// cost about what the product itself does.
//
// x's codes are exactly activation_codes': scale = max|x| / 127.5 (float32 machine epsilon where x is all
// zeros), code = clip(round_half_even(x / scale), -128, 127), with true float32 divisions. They go straight
// into the A tiles' order, [M / 32][32 rows][K / 64 steps][64], zero-padded; the weights come packed at load
// (pallas_kernels/cpu: pack_for_amx of int8 codes), [N / 64][K / 64][4 tiles][16 quads][16 n][4]: byte (p, s, t, r, c, e)
// is w[64 s + 4 r + e, 64 p + 16 t + c], so each step of a panel is 4 KB contiguous and the C tiles' columns
// come out in order.
//
// Walk: each thread takes a contiguous run of 64-column panels. Up to 16 rows, one A tile meets each panel's
// four B tiles as they stream from memory. Larger steps take a pass of panels whose whole K fits kPassBytes
// (L2), then every 32-row block against each panel of it: the panels stream from memory for the first block
// and come from L2 after, and a 32 x 64 block of y is summed in the tiles from the first step to the last (no
// partial sums in memory; the tile stores, which stall the tile loads after them, come once per block).

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "amx_tiles.h"
#include "bf16.h"
#include "parallel.h"
#include "vector_math.h"

#if defined(PAGED_AMX) && defined(__AMX_INT8__)
#include "amx_digits.h"
#endif

namespace paged::amx {

#if defined(PAGED_AMX) && defined(__AMX_INT8__)
namespace {

constexpr int64_t kRows = 32;             // x rows per block: two A tiles
constexpr int64_t kDepth = 64;            // bytes of k per tile step: 64 int8 k (or 32 bfloat16)
constexpr int64_t kPanel = 64;            // y columns per panel: four B tiles
constexpr int64_t kStepBytes = 4 * 1024;  // a panel's four B tiles for one step
constexpr int64_t kPassBytes = 1 << 20;   // the weights of a pass of panels for steps over 16 rows: L2

// Row m of x (K values, float32 or bfloat16) into `codes` (padded to steps * 64 with zeros); returns
// the row's scale and sets `code_sum` to the sum of its codes.
template <typename T>
float quantize_row(const T* x, int64_t K, int64_t padded, int8_t* codes, int32_t& code_sum) {
  auto load = [&](int64_t k, __mmask16 lanes) -> __m512 {
    if constexpr (sizeof(T) == 4) {
      return _mm512_maskz_loadu_ps(lanes, x + k);
    } else {
      const __m256i raw = _mm256_maskz_loadu_epi16(lanes, x + k);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
  };
  auto lanes_at = [&](int64_t k) -> __mmask16 {
    return K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (K - k)) - 1);
  };
  __m512 peak = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) peak = _mm512_max_ps(peak, _mm512_abs_ps(load(k, lanes_at(k))));
  float scale = _mm512_reduce_max_ps(peak) / 127.5f;
  if (scale == 0.0f) scale = FLT_EPSILON;
  const __m512 divisor = _mm512_set1_ps(scale);
  const __m512 low = _mm512_set1_ps(-128.0f), high = _mm512_set1_ps(127.0f);
  __m512i sums = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 lanes = lanes_at(k);
    const __m512 q = _mm512_min_ps(
        high, _mm512_max_ps(low, _mm512_roundscale_ps(_mm512_div_ps(load(k, lanes), divisor),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    const __m512i q32 = _mm512_maskz_cvtps_epi32(lanes, q);
    sums = _mm512_add_epi32(sums, q32);
    _mm_mask_storeu_epi8(codes + k, lanes, _mm512_cvtsepi32_epi8(q32));
  }
  std::memset(codes + K, 0, padded - K);
  code_sum = _mm512_reduce_add_epi32(sums);
  return scale;
}

// The tile product: int8 x int8 -> int32 (W8A8), or bfloat16 pairs -> float32 (int8 weights widened, x as it
// is). Both read 64-byte tile rows and 4 KB panel steps, so one walk serves both.
enum class Product { kInt8, kBf16 };

#define PAGED_TILE_PRODUCT(P, c, a, b) \
  if constexpr (P == Product::kInt8) _tile_dpbssd(c, a, b); else _tile_dpbf16ps(c, a, b)

// sums[32][64] (row stride 64 lanes of 4 bytes), columns [0, 32) from 32 rows of a (two A tiles, rows lda
// bytes apart) against b's two column tiles over `steps` (b: a panel's [steps][4][16][64 bytes], offset to
// the first of the two).
template <Product P>
inline void tile_32x32(const void* a_, int64_t lda, const void* b_, int64_t steps, void* sums_) {
  const char* a = static_cast<const char*>(a_);
  const char* b = static_cast<const char*>(b_);
  char* sums = static_cast<char*>(sums_);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, a + s * kDepth, lda);
    _tile_loadd(5, a + 16 * lda + s * kDepth, lda);
    _tile_loadd(6, b + s * kStepBytes, 64);
    _tile_loadd(7, b + s * kStepBytes + 1024, 64);
    PAGED_TILE_PRODUCT(P, 0, 4, 6);
    PAGED_TILE_PRODUCT(P, 1, 4, 7);
    PAGED_TILE_PRODUCT(P, 2, 5, 6);
    PAGED_TILE_PRODUCT(P, 3, 5, 7);
  }
  _tile_stored(0, sums, 256); _tile_stored(1, sums + 64, 256);
  _tile_stored(2, sums + 16 * 256, 256); _tile_stored(3, sums + 16 * 256 + 64, 256);
}

// sums[16][64] from 16 rows of a against the panel's four column tiles; `stream`: the panel comes from memory,
// and the page two steps ahead is started.
template <Product P>
inline void tile_16x64(const void* a_, int64_t lda, const void* b_, int64_t steps, void* sums_, bool stream) {
  const char* a = static_cast<const char*>(a_);
  const char* b = static_cast<const char*>(b_);
  char* sums = static_cast<char*>(sums_);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    if (stream) start_page_stream(b + (s + 2) * kStepBytes);
    _tile_loadd(4, a + s * kDepth, lda);
    _tile_loadd(6, b + s * kStepBytes, 64);
    _tile_loadd(7, b + s * kStepBytes + 1024, 64);
    PAGED_TILE_PRODUCT(P, 0, 4, 6);
    PAGED_TILE_PRODUCT(P, 1, 4, 7);
    _tile_loadd(6, b + s * kStepBytes + 2048, 64);
    _tile_loadd(7, b + s * kStepBytes + 3072, 64);
    PAGED_TILE_PRODUCT(P, 2, 4, 6);
    PAGED_TILE_PRODUCT(P, 3, 4, 7);
  }
  _tile_stored(0, sums, 256); _tile_stored(1, sums + 64, 256);
  _tile_stored(2, sums + 128, 256); _tile_stored(3, sums + 192, 256);
}

// The float32 values of a block's row r, 16 columns v: sums * x_scale * w_scale - the zero points' share + bias.
struct BlockScales {
  __m512 w_scale[4], offset[4], bias[4];
  BlockScales(const W8A8Weights& w, int64_t n0) {
    for (int v = 0; v < 4; ++v) {
      w_scale[v] = w.w_scale ? _mm512_loadu_ps(w.w_scale + n0 + 16 * v) : _mm512_set1_ps(1.0f);
      offset[v] = w.zero_offsets ? _mm512_loadu_ps(w.zero_offsets + n0 + 16 * v) : _mm512_setzero_ps();
      bias[v] = w.bias ? _mm512_loadu_ps(w.bias + n0 + 16 * v) : _mm512_setzero_ps();
    }
  }
  // Zero points: W = q * scale - offset, so x W = the codes' product less (x's dequantized sum) * offset.
  __m512 value(const int32_t* sums, int64_t r, int v, __m512 row_scale, __m512 row_sum) const {
    const __m512 product = _mm512_mul_ps(
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + r * 64 + 16 * v)), row_scale), w_scale[v]);
    return _mm512_add_ps(_mm512_fnmadd_ps(row_sum, offset[v], product), bias[v]);
  }
};

// y's rows [m0, m0 + rows) x the 64 columns from n0, from a block's int32 sums (and, gated, up's: silu(w's
// values) * up's).
void finish_block(const W8A8Call& call, const int32_t* sums, const int32_t* up_sums, int64_t m0, int64_t rows,
                  int64_t n0, const float* x_scale, const int32_t* code_sums) {
  const BlockScales w(call.w, n0);
  const BlockScales up = call.up ? BlockScales(*call.up, n0) : w;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    const __m512 row_scale = _mm512_set1_ps(x_scale[m]);
    const __m512 row_sum = _mm512_set1_ps(static_cast<float>(code_sums[m]) * x_scale[m]);
    for (int v = 0; v < 4; ++v) {
      __m512 out = w.value(sums, r, v, row_scale, row_sum);
      if (call.up) out = _mm512_mul_ps(silu(out), up.value(up_sums, r, v, row_scale, row_sum));
      if (call.y_bf16) {
        store_bf16x16(static_cast<uint16_t*>(call.y) + m * call.N + n0 + 16 * v, out);
      } else {
        _mm512_storeu_ps(static_cast<float*>(call.y) + m * call.N + n0 + 16 * v, out);
      }
    }
  }
}

// sums[32 or 16][64] of a block of `rows` rows of a against a panel's weights b.
template <Product P = Product::kInt8>
inline void block_sums(const void* a, int64_t lda, const void* b, int64_t steps, int64_t rows, bool stream,
                       void* sums) {
  if (rows <= 16) {
    tile_16x64<P>(a, lda, b, steps, sums, stream);
  } else {
    tile_32x32<P>(a, lda, b, steps, sums);
    tile_32x32<P>(a, lda, static_cast<const char*>(b) + 2048, steps, static_cast<char*>(sums) + 128);
  }
}

// Panels [p_begin, p_end) of `rows` rows of int8 codes (`codes`: [row blocks][32][steps * 64]) against w's
// packed codes (and up's, or null), K deep. Each block's int32 sums go to finish(sums, up_sums, r0, rows, n0) as
// soon as they are in. (Running the previous block's epilogue between this block's tile calls instead, in the
// stall after their tile stores as amx.cc's gated call does, was slower here: the 0.5B shape's MLP at 2,048
// rows, alternating processes, 40-42 against 47.6-48.9 ms.)
template <class Finish>
void int8_panels(const int8_t* w, const int8_t* up, int64_t rows, int64_t K, const int8_t* codes, int64_t p_begin,
                 int64_t p_end, const Finish& finish) {
  alignas(64) int32_t sums[kRows * kPanel], up_sums[kRows * kPanel];
  configure_tiles();
  const int64_t steps = (K + kDepth - 1) / kDepth, lda = steps * kDepth, panel_bytes = steps * kStepBytes;
  const int64_t row_blocks = (rows + kRows - 1) / kRows, weights = up ? 2 : 1;
  const int64_t panels_per_pass = rows <= 16 ? 1 : std::max<int64_t>(1, kPassBytes / (weights * panel_bytes));
  for (int64_t p0 = p_begin; p0 < p_end; p0 += panels_per_pass) {
    const int64_t np = std::min(panels_per_pass, p_end - p0);
    for (int64_t mb = 0; mb < row_blocks; ++mb) {
      const int64_t r0 = mb * kRows, block_rows = std::min(kRows, rows - r0);
      const int8_t* a = codes + r0 * lda;
      for (int64_t p = p0; p < p0 + np; ++p) {
        block_sums(a, lda, w + p * panel_bytes, steps, block_rows, mb == 0, sums);
        if (up) block_sums(a, lda, up + p * panel_bytes, steps, block_rows, mb == 0, up_sums);
        finish(sums, up_sums, r0, block_rows, p * kPanel);
      }
    }
  }
  _tile_release();
}

// Panels [p_begin, p_end) of a W8A8 call, x's codes one row per row of x.
void w8a8_panels(const W8A8Call& call, const int8_t* codes, const float* x_scale, const int32_t* code_sums,
                 int64_t p_begin, int64_t p_end) {
  int8_panels(call.w.packed, call.up ? call.up->packed : nullptr, call.M, call.K, codes, p_begin, p_end,
              [&](const int32_t* sums, const int32_t* up_sums, int64_t m0, int64_t rows, int64_t n0) {
                finish_block(call, sums, up_sums, m0, rows, n0, x_scale, code_sums);
              });
}

#if defined(__AVX512BF16__)
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
    if (next)
      for (int line = 0; line < 64; ++line) _mm_prefetch(reinterpret_cast<const char*>(next + s * kStepBytes) + 64 * line, _MM_HINT_T1);
    widen_step(codes + s * kStepBytes, out + 2 * s * 4 * 512);
  }
}

// y's rows [m0, m0 + rows) x 64 columns from n0 from float32 sums: sums * w_scale - x's row sum * offset + bias
// (gated: silu of that times up's).
void finish_weights_block(const Int8WeightsCall& call, const float* sums, const float* up_sums, int64_t m0,
                          int64_t rows, int64_t n0, const float* x_sums) {
  const BlockScales w(call.w, n0);
  const BlockScales up = call.up ? BlockScales(*call.up, n0) : w;
  auto value = [](const BlockScales& b, const float* block, int64_t r, int v, __m512 row_sum) {
    const __m512 product = _mm512_mul_ps(_mm512_load_ps(block + r * 64 + 16 * v), b.w_scale[v]);
    return _mm512_add_ps(_mm512_fnmadd_ps(row_sum, b.offset[v], product), b.bias[v]);
  };
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    const __m512 row_sum = _mm512_set1_ps(x_sums[m]);
    for (int v = 0; v < 4; ++v) {
      __m512 out = value(w, sums, r, v, row_sum);
      if (call.up) out = _mm512_mul_ps(silu(out), value(up, up_sums, r, v, row_sum));
      if (call.y_bf16) {
        store_bf16x16(static_cast<uint16_t*>(call.y) + m * call.N + n0 + 16 * v, out);
      } else {
        _mm512_storeu_ps(static_cast<float*>(call.y) + m * call.N + n0 + 16 * v, out);
      }
    }
  }
}

// ---- weight-only int8 at decode sizes: x as int8 digits against the codes as they are ---------------------
//
// Up to kDigitRows rows, x goes in as int8 digits (amx_digits.h) and meets the codes on the int8 tiles, W8A8's
// walk with kDigits rows of codes per row of x. Four digit rows fill a 16-row A tile with four rows of x, and a
// 32-row block with eight: up to 4 rows of x the tile work is W8A8's one A tile; at 16, 64 digit rows, the int8
// tiles take about as long as bf16's (paged bench matmul, docs/kernels.md), still ahead of widening the codes.

// A block's rows [r0, r0 + rows) of digit sums (kDigits per row of x) into y's rows from r0 / kDigits.
void finish_digit_block(const Int8WeightsCall& call, const int32_t* sums, const int32_t* up_sums, int64_t r0,
                        int64_t rows, int64_t n0, const float* scales, const float* x_sums) {
  alignas(64) float values[kRows / kDigits * kPanel], up_values[kRows / kDigits * kPanel];
  const int64_t m0 = r0 / kDigits, count = rows / kDigits;
  auto combine = [&](const int32_t* block, float* out) {
    for (int64_t i = 0; i < count; ++i)
      for (int v = 0; v < 4; ++v)
        _mm512_store_ps(out + i * 64 + 16 * v,
                        combine_digits(block + i * kDigits * 64 + 16 * v, 64, scales + (m0 + i) * kDigits));
  };
  combine(sums, values);
  if (call.up) combine(up_sums, up_values);
  finish_weights_block(call, values, up_values, m0, count, n0, x_sums);
}

// Decode-sized calls (M <= kDigitRows): false if the digits could not be allocated.
bool int8_weights_by_digits(xla::ffi::ThreadPool& pool, const Int8WeightsCall& call) {
  const int64_t lda = (call.K + kDepth - 1) / kDepth * kDepth, rows = kDigits * call.M;
  const int64_t padded_rows = (rows + kRows - 1) / kRows * kRows;
  thread_local TileVector<int8_t> codes;
  thread_local TileVector<float> scales, x_sums;
  try {
    if (codes.size() < static_cast<size_t>(padded_rows * lda)) codes.resize(padded_rows * lda);
    if (x_sums.size() < static_cast<size_t>(call.M)) x_sums.resize(call.M), scales.resize(kDigits * call.M);
  } catch (const std::bad_alloc&) {
    return false;
  }
  int8_t* cp = codes.data();
  float *scale_p = scales.data(), *sum_p = x_sums.data();
  std::memset(cp + rows * lda, 0, (padded_rows - rows) * lda);
  for (int64_t m = 0; m < call.M; ++m)
    digit_row(call.x + m * call.K, call.K, lda, cp + kDigits * m * lda, scale_p + kDigits * m, sum_p[m]);
  const int64_t num_panels = call.N / kPanel, parts = std::min(num_panels, std::max<int64_t>(1, pool.num_threads()));
  run_parallel(&pool, parts, 1, parts - 1, [&](int64_t part) {
    int8_panels(call.w.packed, call.up ? call.up->packed : nullptr, rows, call.K, cp, part * num_panels / parts,
                (part + 1) * num_panels / parts,
                [&](const int32_t* sums, const int32_t* up_sums, int64_t r0, int64_t block_rows, int64_t n0) {
                  finish_digit_block(call, sums, up_sums, r0, block_rows, n0, scale_p, sum_p);
                });
  });
  return true;
}

// Panels [p_begin, p_end) of bfloat16 x (padded to whole steps and row blocks) against weights that
// widen(p, out, up_out) writes as bf16 tiles ([2 steps][4][16][32] words; up_out only for a gated call) once a
// panel, then every 32-row block of x against them; finish_weights_block applies call.w's (and up's) vectors.
template <class Widen>
void widened_panels(const Int8WeightsCall& call, const uint16_t* x, const float* x_sums, int64_t p_begin,
                    int64_t p_end, const Widen& widen) {
  alignas(64) float sums[kRows * kPanel], up_sums[kRows * kPanel];
  const int64_t steps = (call.K + kDepth - 1) / kDepth;
  const int64_t lda = steps * kDepth * sizeof(uint16_t);  // x's rows, padded to whole steps
  const char* a = reinterpret_cast<const char*>(x);
  thread_local TileVector<uint16_t> widened, widened_up;
  widened.resize(2 * steps * 4 * 512), widened_up.resize(call.up ? widened.size() : 0);
  configure_tiles();
  const int64_t row_blocks = (call.M + kRows - 1) / kRows;
  for (int64_t p = p_begin; p < p_end; ++p) {
    widen(p, p + 1 < p_end, widened.data(), widened_up.data());
    for (int64_t mb = 0; mb < row_blocks; ++mb) {
      const int64_t m0 = mb * kRows, rows = std::min(kRows, call.M - m0);
      block_sums<Product::kBf16>(a + m0 * lda, lda, widened.data(), 2 * steps, rows, false, sums);
      if (call.up) block_sums<Product::kBf16>(a + m0 * lda, lda, widened_up.data(), 2 * steps, rows, false, up_sums);
      finish_weights_block(call, sums, up_sums, m0, rows, p * kPanel, x_sums);
    }
  }
  _tile_release();
}

// A prompt-sized call on the bf16 tiles: x copied padded to whole steps and row blocks (with its float32 row
// sums, for the zero points), then widened_panels over the threads. False: x's copy could not be allocated.
template <class Widen>
bool widened_matmul(xla::ffi::ThreadPool& pool, const Int8WeightsCall& call, const Widen& widen) {
  const int64_t padded_k = (call.K + kDepth - 1) / kDepth * kDepth;
  const int64_t padded_rows = (call.M + kRows - 1) / kRows * kRows;
  thread_local TileVector<uint16_t> x;
  thread_local TileVector<float> x_sums;
  try {
    if (x.size() < static_cast<size_t>(padded_rows * padded_k)) x.resize(padded_rows * padded_k);
    if (x_sums.size() < static_cast<size_t>(call.M)) x_sums.resize(call.M);
  } catch (const std::bad_alloc&) {
    return false;
  }
  uint16_t* xp = x.data();
  float* sp = x_sums.data();
  std::memset(xp + call.M * padded_k, 0, (padded_rows - call.M) * padded_k * sizeof(uint16_t));
  run_parallel(&pool, call.M, 8, call.M / 8, [&](int64_t m) {
    const uint16_t* row = call.x + m * call.K;
    std::memcpy(xp + m * padded_k, row, call.K * sizeof(uint16_t));
    std::memset(xp + m * padded_k + call.K, 0, (padded_k - call.K) * sizeof(uint16_t));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k = 0; k < call.K; k += 16) {
      const __mmask16 lanes = call.K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (call.K - k)) - 1);
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(
                                   _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, row + k)), 16)));
    }
    sp[m] = _mm512_reduce_add_ps(sum);
  });
  const int64_t num_panels = call.N / kPanel, parts = std::min(num_panels, std::max<int64_t>(1, pool.num_threads()));
  run_parallel(&pool, parts, 1, parts - 1, [&](int64_t part) {
    widened_panels(call, xp, sp, part * num_panels / parts, (part + 1) * num_panels / parts, widen);
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
    if (next)
      for (int line = 0; line < kStepBytes / 128; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(next + s * kStepBytes / 2) + 64 * line, _MM_HINT_T1);
    split_nibbles(nibbles + s * kStepBytes / 2, codes);
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
#endif

}  // namespace

bool Int8WeightsMatmulPacked(xla::ffi::ThreadPool& pool, const Int8WeightsCall& call) {
#if defined(__AVX512BF16__)
  if (!Available()) return false;
  if (call.M <= kDigitRows) return int8_weights_by_digits(pool, call);
  const int64_t panel_bytes = (call.K + kDepth - 1) / kDepth * kStepBytes;
  return widened_matmul(pool, call, [&](int64_t p, bool more, uint16_t* out, uint16_t* up_out) {
    const int8_t* codes = call.w.packed + p * panel_bytes;
    widen_panel(codes, panel_bytes / kStepBytes, out, more ? codes + panel_bytes : nullptr);
    if (call.up) {
      const int8_t* up_codes = call.up->packed + p * panel_bytes;
      widen_panel(up_codes, panel_bytes / kStepBytes, up_out, more ? up_codes + panel_bytes : nullptr);
    }
  });
#else
  (void)pool, (void)call;
  return false;
#endif
}

bool Int4WidenedMatmulPacked(xla::ffi::ThreadPool& pool, const Int4Call& call) {
#if defined(__AVX512BF16__)
  if (!Available()) return false;
  // The scales and zero points go into the widened weights; what is left for the epilogue is the bias.
  const W8A8Weights w{nullptr, nullptr, nullptr, call.w.bias}, up{nullptr, nullptr, nullptr, nullptr};
  const Int8WeightsCall view{call.x, w, call.up ? &up : nullptr, call.y, call.y_bf16, call.M, call.K, call.N};
  const int64_t panel_bytes = (call.K + kDepth - 1) / kDepth * kStepBytes / 2;
  return widened_matmul(pool, view, [&](int64_t p, bool more, uint16_t* out, uint16_t* up_out) {
    const uint8_t* codes = call.w.packed + p * panel_bytes;
    dequantize_int4_panel(codes, call.w, call.K, call.N, p * kPanel, out, more ? codes + panel_bytes : nullptr);
    if (call.up) {
      const uint8_t* up_codes = call.up->packed + p * panel_bytes;
      dequantize_int4_panel(up_codes, *call.up, call.K, call.N, p * kPanel, up_out, more ? up_codes + panel_bytes : nullptr);
    }
  });
#else
  (void)pool, (void)call;
  return false;
#endif
}

bool W8A8MatmulPacked(xla::ffi::ThreadPool& pool, const W8A8Call& call) {
  if (!Available()) return false;
  const int64_t steps = (call.K + kDepth - 1) / kDepth, lda = steps * kDepth;
  const int64_t padded_rows = (call.M + kRows - 1) / kRows * kRows;
  // x's codes and scales, kept from call to call (amx.cc's x tiles: fresh pages for every prompt step cost
  // more than filling them).
  thread_local TileVector<int8_t> codes;
  thread_local TileVector<float> x_scale;
  thread_local TileVector<int32_t> code_sums;
  try {
    if (codes.size() < static_cast<size_t>(padded_rows * lda)) codes.resize(padded_rows * lda);
    if (x_scale.size() < static_cast<size_t>(call.M)) x_scale.resize(call.M), code_sums.resize(call.M);
  } catch (const std::bad_alloc&) {
    return false;
  }
  int8_t* cp = codes.data();
  float* sp = x_scale.data();
  int32_t* sum_p = code_sums.data();
  std::memset(cp + call.M * lda, 0, (padded_rows - call.M) * lda);
  run_parallel(&pool, call.M, 8, call.M / 8, [&](int64_t m) {
    sp[m] = call.x_bf16
                ? quantize_row(static_cast<const uint16_t*>(call.x) + m * call.K, call.K, lda, cp + m * lda, sum_p[m])
                : quantize_row(static_cast<const float*>(call.x) + m * call.K, call.K, lda, cp + m * lda, sum_p[m]);
  });
  const int64_t num_panels = call.N / kPanel, parts = std::min(num_panels, std::max<int64_t>(1, pool.num_threads()));
  run_parallel(&pool, parts, 1, parts - 1, [&](int64_t part) {
    w8a8_panels(call, cp, sp, sum_p, part * num_panels / parts, (part + 1) * num_panels / parts);
  });
  return true;
}

#else

bool W8A8MatmulPacked(xla::ffi::ThreadPool&, const W8A8Call&) { return false; }

bool Int8WeightsMatmulPacked(xla::ffi::ThreadPool&, const Int8WeightsCall&) { return false; }

bool Int4WidenedMatmulPacked(xla::ffi::ThreadPool&, const Int4Call&) { return false; }

#endif

}  // namespace paged::amx
