// Weight-only int4 (GPTQ and other group-quantized 4-bit layers) on Intel AMX-INT8 tiles: y[M, N] = sum over
// groups g of (x_g @ u_g) * scale[g, n] - (sum_k in g x[m, k]) * (8 scale[g, n] + offset[g, n]) (+ bias), i.e.
// x @ ((u - 8) * scale - offset) with u the stored nibbles (0..15), x bfloat16 written as int8 digits
// (amx_digits.h), the nibbles widened to bytes in L2 and multiplied as they are (TDPBSUD: signed digits x
// unsigned codes, exact int32 sums). amx.h: Int4MatmulPacked.
//
// Why: a decode step streams every weight once, and int4 is a quarter of bfloat16's bytes. The nibbles are split
// into bytes a panel at a time (two ANDs and a shift per 64 bytes), never converted to float: the products stay
// integer until each group's sums meet its scales.
//
// Layout (pallas_kernels/cpu: pack_int4_for_amx): the int8 codes' layout (amx_int8.cc: [N / 64][ceil(K / 64)]
// [4 tiles][16 quads][16 n][4]) with each 4 KB step folded into 2 KB: byte j of a step holds code j in its low
// nibble and code j + 2048 in its high one, so tiles 0-1 come from the low nibbles and 2-3 from the high.
//
// Walk: each thread takes a run of 64-column panels. A panel's nibbles are split into a buffer (all of K: at
// most a few hundred KB, in L2), then every block of 16 digit rows (four rows of x) runs group by group: the
// group's steps summed in four C tiles, stored, and folded into float32 sums with the group's scales. Groups
// are whole 64-deep steps (a group size that is a multiple of 64, or one group over all of K).

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

constexpr int64_t kBlockRows = 16;       // digit rows per block: one A tile
constexpr int64_t kBlockX = kBlockRows / kDigits;  // rows of x per block
// A single block's walk (1-4 rows of x) requests the nibbles this many steps (64 KB) ahead into L2, a step's
// lines at a time. Its tile work is so short that the loads wait on memory otherwise: touching the start of
// the page two steps ahead (as the int8 walk does) left one-row products at 48-66% of the read bandwidth;
// this gives 72-82% (`paged bench matmul --rows 1`, alternating builds; 16 steps ahead gave 72-83%).
// Near the end of a thread's panels the requests run past them: wasted, and a prefetch never faults.
constexpr int64_t kStreamAheadSteps = 32;

// A panel's nibbles ([steps][2048]) into bytes ([steps][4096]); `next`: the panel after (or null), requested
// into L2 as this one is read.
void split_panel(const uint8_t* nibbles, int64_t steps, int8_t* codes, const uint8_t* next) {
  for (int64_t s = 0; s < steps; ++s) {
    if (next) prefetch_into_l2(next + s * kStepNibbles, kStepNibbles);
    split_nibbles(nibbles + s * kStepNibbles, codes + s * kStepBytes);
  }
}

// What a block's rows of x know: their digit scales and, per group, their float32 sums.
struct BlockRows {
  const int8_t* digits;       // the block's 16 digit rows, lda bytes apart
  int64_t lda, count;         // rows of x in the block
  const float* digit_scales;  // [count][kDigits]
  const float* group_sums;    // [count][groups]
};

// sums[kBlockX][64] float32 of the block's rows against one weight's panel, group by group: each group's int32
// sums times its scales, less the group's row sums times 8 scale + offset. The panel's codes come split into
// bytes (`codes`), or with `codes` null as nibbles (`nibbles`, from memory) that are split a step at a time
// into L1 just before their tile products: a single block's walk, whose splitting then overlaps the stream.
void panel_sums(const BlockRows& rows, const int8_t* codes, const uint8_t* nibbles, const Int4Weights& w,
                int64_t K, int64_t N, int64_t n0, float* out) {
  alignas(64) int32_t sums[kBlockRows * kPanel];
  alignas(64) int8_t step_codes[kStepBytes];
  const int64_t steps = (K + kDepth - 1) / kDepth, groups = w.groups;
  const int64_t group_steps = groups == 1 ? steps : K / groups / kDepth;
  std::memset(out, 0, sizeof(float) * kBlockX * kPanel);
  for (int64_t g = 0; g < groups; ++g) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t s = g * group_steps; s < std::min(steps, (g + 1) * group_steps); ++s) {
      const int8_t* b = codes ? codes + s * kStepBytes : step_codes;
      if (!codes) {
        prefetch_into_l2(nibbles + (s + kStreamAheadSteps) * kStepNibbles, kStepNibbles);
        split_nibbles(nibbles + s * kStepNibbles, step_codes);
      }
      _tile_loadd(4, rows.digits + s * kDepth, rows.lda);
      _tile_loadd(5, b, 64);
      _tile_loadd(6, b + 1024, 64);
      _tile_dpbsud(0, 4, 5);
      _tile_dpbsud(1, 4, 6);
      _tile_loadd(5, b + 2048, 64);
      _tile_loadd(6, b + 3072, 64);
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
      for (int64_t i = 0; i < rows.count; ++i) {
        const __m512 product = combine_digits(sums + i * kDigits * kPanel + 16 * v, kPanel, rows.digit_scales + i * kDigits);
        __m512 acc = _mm512_load_ps(out + i * kPanel + 16 * v);
        acc = _mm512_fmadd_ps(product, scale, acc);
        acc = _mm512_fnmadd_ps(_mm512_set1_ps(rows.group_sums[i * groups + g]), offset, acc);
        _mm512_store_ps(out + i * kPanel + 16 * v, acc);
      }
    }
  }
}

void int4_panels(const Int4Call& call, const int8_t* digits, int64_t lda, const float* digit_scales,
                 const float* group_sums, int64_t p_begin, int64_t p_end) {
  const int64_t steps = (call.K + kDepth - 1) / kDepth, panel_bytes = steps * kStepNibbles;
  thread_local TileVector<int8_t> codes, up_codes;  // the panel split into bytes, for several blocks
  if (call.M > kBlockX) codes.resize(steps * kStepBytes), up_codes.resize(call.up ? steps * kStepBytes : 0);
  alignas(64) float values[kBlockX * kPanel], up_values[kBlockX * kPanel];
  configure_tiles();
  const bool stream = call.M <= kBlockX;  // one block: split each step as it streams in
  for (int64_t p = p_begin; p < p_end; ++p) {
    const uint8_t* nibbles = call.w.packed + p * panel_bytes;
    const uint8_t* up_nibbles = call.up ? call.up->packed + p * panel_bytes : nullptr;
    const bool more = p + 1 < p_end;
    if (!stream) {
      split_panel(nibbles, steps, codes.data(), more ? nibbles + panel_bytes : nullptr);
      if (call.up) split_panel(up_nibbles, steps, up_codes.data(), more ? up_nibbles + panel_bytes : nullptr);
    }
    const int8_t* split = stream ? nullptr : codes.data();
    const int8_t* up_split = stream ? nullptr : up_codes.data();
    const int64_t n0 = p * kPanel;
    for (int64_t m0 = 0; m0 < call.M; m0 += kBlockX) {
      const BlockRows rows{digits + m0 * kDigits * lda, lda, std::min(kBlockX, call.M - m0),
                           digit_scales + m0 * kDigits, group_sums + m0 * call.w.groups};
      panel_sums(rows, split, nibbles, call.w, call.K, call.N, n0, values);
      if (call.up) panel_sums(rows, up_split, up_nibbles, *call.up, call.K, call.N, n0, up_values);
      for (int64_t i = 0; i < rows.count; ++i) {
        for (int v = 0; v < 4; ++v) {
          __m512 out = _mm512_load_ps(values + i * kPanel + 16 * v);
          if (call.w.bias) out = _mm512_add_ps(out, _mm512_loadu_ps(call.w.bias + n0 + 16 * v));
          if (call.up) out = _mm512_mul_ps(silu(out), _mm512_load_ps(up_values + i * kPanel + 16 * v));
          const int64_t at = (m0 + i) * call.N + n0 + 16 * v;
          if (call.y_bf16) {
            store_bf16x16(static_cast<uint16_t*>(call.y) + at, out);
          } else {
            _mm512_storeu_ps(static_cast<float*>(call.y) + at, out);
          }
        }
      }
    }
  }
  _tile_release();
}

}  // namespace

bool Int4MatmulPacked(xla::ffi::ThreadPool& pool, const Int4Call& call) {
  if (!Available()) return false;
  if (call.M > kDigitRows) return Int4WidenedMatmulPacked(pool, call);
  const int64_t lda = (call.K + kDepth - 1) / kDepth * kDepth, groups = call.w.groups;
  const int64_t padded_rows = (call.M + kBlockX - 1) / kBlockX * kBlockRows;
  const int64_t group_size = groups == 1 ? call.K : call.K / groups;
  thread_local TileVector<int8_t> digits;
  thread_local TileVector<float> digit_scales, group_sums, row_sums;
  try {
    if (digits.size() < static_cast<size_t>(padded_rows * lda)) digits.resize(padded_rows * lda);
    if (digit_scales.size() < static_cast<size_t>(kDigits * call.M)) digit_scales.resize(kDigits * call.M);
    if (group_sums.size() < static_cast<size_t>(groups * call.M)) group_sums.resize(groups * call.M);
    if (row_sums.size() < static_cast<size_t>(call.M)) row_sums.resize(call.M);
  } catch (const std::bad_alloc&) {
    return false;
  }
  int8_t* dp = digits.data();
  float *scale_p = digit_scales.data(), *group_p = group_sums.data(), *row_p = row_sums.data();
  std::memset(dp + call.M * kDigits * lda, 0, (padded_rows - call.M * kDigits) * lda);
  run_parallel(&pool, call.M, 8, call.M / 8, [&](int64_t m) {
    const uint16_t* row = call.x + m * call.K;
    digit_row(row, call.K, lda, dp + m * kDigits * lda, scale_p + m * kDigits, row_p[m]);
    for (int64_t g = 0; g < groups; ++g) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 16)
        sum = _mm512_add_ps(sum, load_bf16x16(row + k, lanes16((g + 1) * group_size, k)));
      group_p[m * groups + g] = _mm512_reduce_add_ps(sum);
    }
  });
  const int64_t num_panels = call.N / kPanel, parts = std::min(num_panels, std::max<int64_t>(1, pool.num_threads()));
  run_parallel(&pool, parts, 1, parts - 1, [&](int64_t part) {
    int4_panels(call, dp, lda, scale_p, group_p, part * num_panels / parts, (part + 1) * num_panels / parts);
  });
  return true;
}

#else

bool Int4MatmulPacked(xla::ffi::ThreadPool&, const Int4Call&) { return false; }

#endif

}  // namespace paged::amx
