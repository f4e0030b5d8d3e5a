// W8A8 on the CPU as an integer product: y[M, N] = (xq @ wq) * x_scale[m] * w_scale[n], int8 codes on both
// sides, exact int32 sums, as XLA FFI custom calls: W8A8MatmulCpu takes x as the layer gets it and quantizes
// it per row in the call (row_codes.h), with the zero points; Int8MatmulCpu takes codes quantized beforehand.
//
// Why: a W8A8 layer's activations and weights are int8 codes; multiplying them as floats (dequantized) runs at
// the float matmul's rate. AVX-512 VNNI's vpdpbusd multiplies 64 byte pairs into 16 int32 lanes per
// instruction, four products a lane (u8 x s8), twice the pairs of vdpbf16ps.
//
// vpdpbusd takes one unsigned operand: x's codes are offset by 128 (the sign bit flipped: xu = xq + 128, in
// [0, 255]) and the extra 128 * sum_k wq[k, n] that brings is subtracted at the end of each block, summed in the
// same pass that lays the block out. A lane must hold four consecutive k of one column, (w[4s, n] .. w[4s + 3,
// n]): each block of kc rows x 64 columns is interleaved into that order once, into an L1 buffer, by byte then
// word unpacks, which leave each 128-bit lane's columns in the order 4j + i for vector j, lane dword i; the
// tile's stores transpose them back.
//
// Contract (Int8MatmulCpu; W8A8MatmulCpu's is above W8A8MatmulImpl):
//   x        [M, K]  int8 activation codes (one scale per row), K a multiple of 4
//   x_scale  [M]     float32
//   w        [K, N]  int8 weight codes (one scale per column), N a multiple of 64
//   w_scale  [N]     float32
//   live     []      int32: rows [0, live) are computed, the rest of y is zeros
//   y        [M, N]  float32
// Without AVX-512 VNNI a plain loop keeps the call correct, and Int8MatmulCpuIsVectorized() tells the model to
// keep its float path.
//
// On a CPU with AMX-INT8, W8A8 layers take W8A8MatmulPackedCpu and W8A8GatedMatmulPackedCpu instead (bound
// here, computed in amx_int8.cc): weights packed at load, x quantized in the call.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#if defined(__AVX512VNNI__)
#include <immintrin.h>
#endif

#include "amx.h"
#include "bf16.h"
#include "panels.h"
#include "parallel.h"
#include "row_codes.h"
#include "vector_math.h"
#include "vnni.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using paged::kPanel;
using paged::over_row_tiles;

// What the walk multiplies x by: its codes offset by 128 (xq + 128, vpdpbusd's unsigned operand; row stride
// K), each row's scale and the sum of its codes (for the zero points).
struct RowCodes {
  const uint8_t* codes;
  const float* scale;
  const int32_t* code_sum;
};

// One int8 layer of the walk: its codes [K, N] and vectors, where its partial sums wait between blocks
// (`sums`, [M, N] float32), and where its final sums (plus the bias) go: into `sums` too, or into `y`
// rounded once to y's type; with `gate` (the gated call's up projection) silu(gate's final sums) * them.
struct Layer {
  const int8_t* w;
  const float* w_scale;
  const float* zero_offsets;  // [N], or null
  float* sums;
  const float* bias = nullptr;  // [N], or null
  void* y = nullptr;            // null: the final sums stay in `sums`
  bool y_bf16 = false;
  const float* gate = nullptr;  // the gate projection's final sums [M, N], or null
};

#if defined(__AVX512VNNI__)
constexpr int64_t kBlock = 512;  // rows of w per block: 512 x 64 bytes = 32 KB interleaved

// The block interleaved: steps of four k rows, each four vectors of 16 column quads.
alignas(64) static thread_local int8_t quads[kBlock * kPanel];
// 128 * (the block's column sums), in the quads' column order: what offsetting x by 128 adds.
alignas(64) static thread_local int32_t offset_sums[kPanel];

// Rows [0, kc) of one panel of w (stride ldw) into `quads` and `offset_sums`; each row of `next` (the block
// after, or null) is requested into L2 as its row is laid out.
inline void interleave_block(const int8_t* w, int64_t ldw, int64_t kc, const int8_t* next) {
  __m512i sums[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                     _mm512_setzero_si512()};
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t s = 0; s < kc / 4; ++s) {
    __m512i rows[4];
    for (int r = 0; r < 4; ++r) {
      if (next) _mm_prefetch(reinterpret_cast<const char*>(next + (4 * s + r) * ldw), _MM_HINT_T1);
      rows[r] = _mm512_loadu_si512(w + (4 * s + r) * ldw);
    }
    const __m512i low01 = _mm512_unpacklo_epi8(rows[0], rows[1]), high01 = _mm512_unpackhi_epi8(rows[0], rows[1]);
    const __m512i low23 = _mm512_unpacklo_epi8(rows[2], rows[3]), high23 = _mm512_unpackhi_epi8(rows[2], rows[3]);
    const __m512i q[4] = {_mm512_unpacklo_epi16(low01, low23), _mm512_unpackhi_epi16(low01, low23),
                          _mm512_unpacklo_epi16(high01, high23), _mm512_unpackhi_epi16(high01, high23)};
    for (int j = 0; j < 4; ++j) {
      _mm512_store_si512(quads + (4 * s + j) * 64, q[j]);
      sums[j] = paged::dot_bytes(sums[j], offset, q[j]);
    }
  }
  for (int j = 0; j < 4; ++j) _mm512_store_si512(offset_sums + 16 * j, sums[j]);
}

// Four vectors whose 128-bit lane L holds columns 16 L + 4 j + i (vector j, dword i) into column order:
// out[v] = (in[0].L_v, in[1].L_v, in[2].L_v, in[3].L_v), columns 16 v .. 16 v + 15.
inline void to_column_order(const __m512i in[4], __m512i out[4]) {
  const __m512i a = _mm512_shuffle_i32x4(in[0], in[1], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i b = _mm512_shuffle_i32x4(in[2], in[3], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i c = _mm512_shuffle_i32x4(in[0], in[1], _MM_SHUFFLE(3, 2, 3, 2));
  const __m512i d = _mm512_shuffle_i32x4(in[2], in[3], _MM_SHUFFLE(3, 2, 3, 2));
  out[0] = _mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0));
  out[1] = _mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1));
  out[2] = _mm512_shuffle_i32x4(c, d, _MM_SHUFFLE(2, 0, 2, 0));
  out[3] = _mm512_shuffle_i32x4(c, d, _MM_SHUFFLE(3, 1, 3, 1));
}

// Rows [m0, m0 + MR) of x (codes offset by 128) against the interleaved block of the layer's columns [n0, n0 +
// 64): sums[r, :64] (+)= (products - offset sums) * x_scale[r] * w_scale, and at the `last` block minus
// code_sum[r] * x_scale[r] * zero_offsets (if any), finished as the layer says.
template <int MR>
inline void quad_tile(const RowCodes& x, const Layer& layer, int64_t m0, int64_t n0, int64_t k0, int64_t K, int64_t N,
                      int64_t kc, bool first, bool last) {
  const uint8_t* codes = x.codes + m0 * K + k0;
  __m512i acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
  for (int64_t s = 0; s < kc / 4; ++s) {
    const int8_t* b = quads + 4 * s * 64;
    const __m512i b0 = _mm512_load_si512(b), b1 = _mm512_load_si512(b + 64);
    const __m512i b2 = _mm512_load_si512(b + 128), b3 = _mm512_load_si512(b + 192);
    for (int r = 0; r < MR; ++r) {
      int32_t four;  // x[r, 4s .. 4s + 3] as unsigned bytes, xq + 128
      std::memcpy(&four, codes + r * K + 4 * s, sizeof four);
      const __m512i a = _mm512_set1_epi32(four);
      acc[r][0] = paged::dot_bytes(acc[r][0], a, b0);
      acc[r][1] = paged::dot_bytes(acc[r][1], a, b1);
      acc[r][2] = paged::dot_bytes(acc[r][2], a, b2);
      acc[r][3] = paged::dot_bytes(acc[r][3], a, b3);
    }
  }
  const bool offsets = last && layer.zero_offsets, bias = last && layer.bias, to_y = last && layer.y;
  for (int r = 0; r < MR; ++r) {
    __m512i exact[4], ordered[4];
    for (int j = 0; j < 4; ++j) exact[j] = _mm512_sub_epi32(acc[r][j], _mm512_load_si512(offset_sums + 16 * j));
    to_column_order(exact, ordered);
    const float x_scale = x.scale[m0 + r];
    const __m512 row_scale = _mm512_set1_ps(x_scale);
    const __m512 row_offset = _mm512_set1_ps(static_cast<float>(x.code_sum[m0 + r]) * x_scale);
    for (int v = 0; v < 4; ++v) {
      const int64_t at = (m0 + r) * N + n0 + 16 * v;
      __m512 value = _mm512_mul_ps(_mm512_cvtepi32_ps(ordered[v]),
                                   _mm512_mul_ps(_mm512_loadu_ps(layer.w_scale + n0 + 16 * v), row_scale));
      if (!first) value = _mm512_add_ps(value, _mm512_loadu_ps(layer.sums + at));
      if (offsets) value = _mm512_fnmadd_ps(row_offset, _mm512_loadu_ps(layer.zero_offsets + n0 + 16 * v), value);
      if (bias) value = _mm512_add_ps(value, _mm512_loadu_ps(layer.bias + n0 + 16 * v));
      if (!to_y) {
        _mm512_storeu_ps(layer.sums + at, value);
        continue;
      }
      if (layer.gate) value = _mm512_mul_ps(paged::silu512(_mm512_loadu_ps(layer.gate + at)), value);
      if (layer.y_bf16) {
        paged::store_product_bf16x16(static_cast<uint16_t*>(layer.y) + at, value);
      } else {
        _mm512_storeu_ps(static_cast<float*>(layer.y) + at, value);
      }
    }
  }
}

#endif

// Panels [p_begin, p_end) of each layer (one, or gate then up), a block of w's rows at a time; partial sums
// wait in the layers' sums between blocks.
void int8_panels(const RowCodes& x, const Layer* layers, int num_layers, int64_t M, int64_t K, int64_t N,
                 int64_t p_begin, int64_t p_end) {
#if defined(__AVX512VNNI__)
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    const int64_t kc = std::min(kBlock, K - k0);
    for (int64_t p = p_begin; p < p_end; ++p) {
      const int64_t n0 = p * kPanel;
      for (int l = 0; l < num_layers; ++l) {
        const Layer& layer = layers[l];
        const int8_t* block_rows = layer.w + k0 * N;
        const int8_t* next = p + 1 < p_end ? block_rows + n0 + kPanel
                             : k0 + kBlock < K ? layer.w + (k0 + kBlock) * N + p_begin * kPanel
                                               : nullptr;
        interleave_block(block_rows + n0, N, kc, next);
        over_row_tiles(M, [&](auto rows, int64_t m0) {
          quad_tile<decltype(rows)::value>(x, layer, m0, n0, k0, K, N, kc, k0 == 0, k0 + kBlock >= K);
        });
      }
    }
  }
#else
  for (int l = 0; l < num_layers; ++l) {
    const Layer& layer = layers[l];
    for (int64_t n = p_begin * kPanel; n < p_end * kPanel; ++n) {
      for (int64_t m = 0; m < M; ++m) {
        int64_t acc = 0;
        for (int64_t k = 0; k < K; ++k) acc += (int64_t{x.codes[m * K + k]} - 128) * int64_t{layer.w[k * N + n]};
        float value = static_cast<float>(acc) * (layer.w_scale[n] * x.scale[m]);
        if (layer.zero_offsets) value -= static_cast<float>(x.code_sum[m]) * x.scale[m] * layer.zero_offsets[n];
        if (layer.bias) value += layer.bias[n];
        if (!layer.y) {
          layer.sums[m * N + n] = value;
          continue;
        }
        if (layer.gate) {
          const float g = layer.gate[m * N + n];
          value *= g / (1.0f + std::exp(-g));
        }
        if (layer.y_bf16) {
          static_cast<uint16_t*>(layer.y)[m * N + n] = paged::float_to_bf16(value);
        } else {
          static_cast<float*>(layer.y)[m * N + n] = value;
        }
      }
    }
  }
#endif
}

// Rows [0, M) of x's codes offset by 128, with their scales and code sums, kept from call to call (fresh pages
// for every prompt step cost more than filling them); null where they could not be allocated.
struct RowBuffers {
  std::vector<uint8_t> codes;
  std::vector<float> scale;
  std::vector<int32_t> code_sum;
};

RowBuffers* row_buffers(int64_t M, int64_t K) {
  thread_local RowBuffers buffers;
  try {
    if (buffers.codes.size() < static_cast<size_t>(M * K)) buffers.codes.resize(M * K);
    if (buffers.scale.size() < static_cast<size_t>(M)) buffers.scale.resize(M), buffers.code_sum.resize(M);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
  return &buffers;
}

// The walk over every panel of the layers, the threads taking contiguous runs of panels.
void int8_product(ffi::ThreadPool& pool, const RowCodes& x, const Layer* layers, int num_layers, int64_t M, int64_t K,
                  int64_t N) {
  paged::over_panels(pool, N / kPanel, [&](int64_t p0, int64_t p1) {
    int8_panels(x, layers, num_layers, M, K, N, p0, p1);
  });
}

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::F32> x_scale,
                          ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> w_scale, ffi::Buffer<ffi::S32> live,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || wd[1] % kPanel || xd[1] % 4)
    return ffi::Error::InvalidArgument(
        "int8_matmul_cpu: expected x [M, K] and w [K, N] with K a multiple of 4 and N a multiple of 64");
  if (x_scale.element_count() != xd[0] || w_scale.element_count() != wd[1] || live.element_count() != 1)
    return ffi::Error::InvalidArgument("int8_matmul_cpu: expected x_scale [M], w_scale [N] and a scalar live");
  const int64_t K = xd[1], N = wd[1];
  float* yp = y->typed_data();
  const int64_t M = paged::zero_rows_past_live(live, xd[0], N, yp);
  if (M == 0) return ffi::Error::Success();
  RowBuffers* rows = row_buffers(M, K);
  if (!rows) return ffi::Error::Internal("int8_matmul_cpu: x's codes could not be allocated");
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(x.typed_data());
  for (int64_t i = 0; i < M * K; ++i) rows->codes[i] = codes[i] ^ 0x80;
  std::fill(rows->code_sum.begin(), rows->code_sum.begin() + M, 0);
  const Layer layer{w.typed_data(), w_scale.typed_data(), nullptr, yp};
  int8_product(pool, {rows->codes.data(), x_scale.typed_data(), rows->code_sum.data()}, &layer, 1, M, K, N);
  return ffi::Error::Success();
}

// Rows [0, M) of x (float32 or bfloat16 [M, K]) quantized as activation_codes(x, "int8") does (row_codes.h),
// the codes offset by 128 for vpdpbusd; null where the buffers could not be allocated.
const RowBuffers* quantized_rows(ffi::ThreadPool& pool, ffi::AnyBuffer x, int64_t M, int64_t K) {
  RowBuffers* rows = row_buffers(M, K);
  if (!rows) return nullptr;
  uint8_t* codes = rows->codes.data();
  float* scale = rows->scale.data();
  int32_t* code_sum = rows->code_sum.data();
  const bool x_bf16 = x.element_type() == ffi::DataType::BF16;
  paged::run_parallel(&pool, M, 8, M / 8, [&](int64_t m) {
    int8_t* row = reinterpret_cast<int8_t*>(codes + m * K);
    scale[m] = x_bf16 ? paged::quantize_row(static_cast<const uint16_t*>(x.untyped_data()) + m * K, K, K, row, code_sum[m])
                      : paged::quantize_row(static_cast<const float*>(x.untyped_data()) + m * K, K, K, row, code_sum[m]);
    for (int64_t k = 0; k < K; ++k) codes[m * K + k] ^= 0x80;  // vpdpbusd's unsigned operand: xq + 128
  });
  return rows;
}

// x against one layer's codes, vectors and y: what the W8A8 calls check.
ffi::Error check_layer(const char* name, ffi::AnyBuffer x, ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> w_scale,
                       ffi::Buffer<ffi::F32> zero_offsets, ffi::Buffer<ffi::S32> live) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  auto invalid = [&](const char* what) { return ffi::Error::InvalidArgument(std::string(name) + ": " + what); };
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || wd[1] % kPanel || xd[1] % 4 ||
      (x.element_type() != ffi::DataType::BF16 && x.element_type() != ffi::DataType::F32))
    return invalid("expected float32 or bfloat16 x [M, K] and int8 w [K, N] with K a multiple of 4 and N a multiple "
                   "of 64");
  const int64_t N = wd[1];
  if (w_scale.element_count() != N || (zero_offsets.element_count() != 0 && zero_offsets.element_count() != N) ||
      live.element_count() != 1)
    return invalid("expected w_scale [N], zero_offsets [N] or [0] and a scalar live");
  return ffi::Error::Success();
}

// A vector operand (zero offsets, bias) as the walk takes it: its values, or null for [0].
const float* vector_or_null(ffi::Buffer<ffi::F32> vector) {
  return vector.element_count() ? vector.typed_data() : nullptr;
}

// W8A8 on AMX-INT8 with x quantized in the call (amx.h: W8A8MatmulPacked): x float32 or bfloat16 [M, K], w int8
// packed at load [N / 64, ceil(K / 64), 4096], w_scale float32 [N], zero_offsets and bias float32 [N] or [0]
// for none, y float32 or bfloat16 [M, N]; rows [live, M) of y zeros. Gated: silu(x @ gate) * (x @ up), each
// with its own scales and zero points, no bias.
using F32 = ffi::Buffer<ffi::F32>;

ffi::Error check_w8a8(const char* name, ffi::AnyBuffer x, ffi::Buffer<ffi::S8> w, F32 w_scale, F32 offsets, F32 bias,
                      ffi::Buffer<ffi::S32> live, ffi::Result<ffi::AnyBuffer>& y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  auto invalid = [&](const char* what) { return ffi::Error::InvalidArgument(std::string(name) + ": " + what); };
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != (xd[1] + 63) / 64 || wd[2] != 4096)
    return invalid("expected x [M, K] and w [N / 64, ceil(K / 64), 4096]");
  const auto x_type = x.element_type(), y_type = y->element_type();
  if ((x_type != ffi::DataType::F32 && x_type != ffi::DataType::BF16) ||
      (y_type != ffi::DataType::F32 && y_type != ffi::DataType::BF16))
    return invalid("x and y must be float32 or bfloat16");
  const int64_t N = wd[0] * kPanel;
  auto none_or_n = [&](const F32& b) { return b.element_count() == 0 || b.element_count() == N; };
  if (w_scale.element_count() != N || !none_or_n(offsets) || !none_or_n(bias) || live.element_count() != 1 ||
      y->dimensions().size() != 2 || y->dimensions()[0] != xd[0] || y->dimensions()[1] != N)
    return invalid("expected w_scale [N], zero_offsets and bias [N] or [0], a scalar live and y [M, N]");
  return ffi::Error::Success();
}

paged::amx::W8A8Weights w8a8_weights(ffi::Buffer<ffi::S8> w, F32 w_scale, F32 offsets, F32 bias) {
  return {w.typed_data(), w_scale.typed_data(), offsets.element_count() ? offsets.typed_data() : nullptr,
          bias.element_count() ? bias.typed_data() : nullptr};
}

// The rows to compute: y's rows from `live` on zeroed (float32 or bfloat16 y), the count below them returned.
int64_t live_rows_of_y(ffi::Buffer<ffi::S32> live, int64_t rows, ffi::Result<ffi::AnyBuffer>& y) {
  const int64_t N = y->dimensions()[1];
  return y->element_type() == ffi::DataType::BF16
             ? paged::zero_rows_past_live(live, rows, N, static_cast<uint16_t*>(y->untyped_data()))
             : paged::zero_rows_past_live(live, rows, N, static_cast<float*>(y->untyped_data()));
}

// A W8A8 layer in one call on CPUs without AMX-INT8: y[M, N] = (xq @ w) * x_scale[m] * w_scale[n] - (sum_k
// xq[m, k]) * x_scale[m] * zero_offsets[n] + bias[n], x (float32 or bfloat16 [M, K], K a multiple of 4)
// quantized per row here as activation_codes(x, "int8") does (row_codes.h); w int8 [K, N] as held (N a multiple
// of 64), w_scale float32 [N], zero_offsets and bias float32 [N] or [0] for none; y float32, or bfloat16
// rounded once with sums float32 [M, N] for the partial sums ([0] for a float32 y); rows [live, M) of y zeros.
ffi::Error W8A8MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S8> w, F32 w_scale,
                          F32 zero_offsets, F32 bias, ffi::Buffer<ffi::S32> live, ffi::Result<ffi::AnyBuffer> y,
                          ffi::ResultBuffer<ffi::F32> sums) {
  const char* name = "w8a8_matmul_cpu";
  if (auto error = check_layer(name, x, w, w_scale, zero_offsets, live); error.failure()) return error;
  const int64_t M_all = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[1];
  const bool y_bf16 = y->element_type() == ffi::DataType::BF16;
  if ((bias.element_count() != 0 && bias.element_count() != N) || y->dimensions().size() != 2 ||
      y->dimensions()[0] != M_all || y->dimensions()[1] != N ||
      (!y_bf16 && y->element_type() != ffi::DataType::F32) ||
      sums->element_count() != (y_bf16 ? M_all * N : 0))
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": expected bias [N] or [0], y float32 or bfloat16 [M, N], and sums float32 "
                                       "[M, N] for a bfloat16 y, else [0]");
  const int64_t M = live_rows_of_y(live, M_all, y);
  if (M == 0) return ffi::Error::Success();
  const RowBuffers* rows = quantized_rows(pool, x, M, K);
  if (!rows) return ffi::Error::Internal(std::string(name) + ": x's codes could not be allocated");
  Layer layer{w.typed_data(), w_scale.typed_data(), vector_or_null(zero_offsets), nullptr, vector_or_null(bias)};
  if (y_bf16) {
    layer.sums = sums->typed_data();
    layer.y = y->untyped_data();
    layer.y_bf16 = true;
  } else {
    layer.sums = static_cast<float*>(y->untyped_data());
  }
  int8_product(pool, {rows->codes.data(), rows->scale.data(), rows->code_sum.data()}, &layer, 1, M, K, N);
  return ffi::Error::Success();
}

// silu(x @ gate) * (x @ up) for two W8A8 layers in one call on CPUs without AMX-INT8, each layer as
// W8A8MatmulImpl's (no bias): x quantized once for both, and the activation applied as up's last block
// lands, rounded once to y (float32 or bfloat16 [M, N]). sums: float32 [2, M, N], the two products' partial
// sums (the gate's final ones in the first half).
ffi::Error W8A8GatedMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S8> gate, F32 gate_scale,
                               F32 gate_offsets, ffi::Buffer<ffi::S8> up, F32 up_scale, F32 up_offsets,
                               ffi::Buffer<ffi::S32> live, ffi::Result<ffi::AnyBuffer> y, ffi::ResultBuffer<ffi::F32> sums) {
  const char* name = "w8a8_gated_matmul_cpu";
  if (auto error = check_layer(name, x, gate, gate_scale, gate_offsets, live); error.failure()) return error;
  if (auto error = check_layer(name, x, up, up_scale, up_offsets, live); error.failure()) return error;
  const int64_t M_all = x.dimensions()[0], K = x.dimensions()[1], N = gate.dimensions()[1];
  if (up.dimensions()[1] != N || y->dimensions().size() != 2 || y->dimensions()[0] != M_all ||
      y->dimensions()[1] != N || (y->element_type() != ffi::DataType::F32 && y->element_type() != ffi::DataType::BF16) ||
      sums->element_count() != 2 * M_all * N)
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": expected gate and up of the same shape, y float32 or bfloat16 [M, N] and "
                                       "sums float32 [2, M, N]");
  const int64_t M = live_rows_of_y(live, M_all, y);
  if (M == 0) return ffi::Error::Success();
  const RowBuffers* rows = quantized_rows(pool, x, M, K);
  if (!rows) return ffi::Error::Internal(std::string(name) + ": x's codes could not be allocated");
  float* gate_sums = sums->typed_data();
  const Layer layers[2] = {
      {gate.typed_data(), gate_scale.typed_data(), vector_or_null(gate_offsets), gate_sums},
      {up.typed_data(), up_scale.typed_data(), vector_or_null(up_offsets), gate_sums + M_all * N, nullptr,
       y->untyped_data(), y->element_type() == ffi::DataType::BF16, gate_sums}};
  int8_product(pool, {rows->codes.data(), rows->scale.data(), rows->code_sum.data()}, layers, 2, M, K, N);
  return ffi::Error::Success();
}

// The call on AMX after its checks: W8A8 (x quantized in the call), or with `weight_only` bfloat16 x against
// the int8 codes (amx.h: Int8WeightsMatmulPacked); `up`: the gated call's up projection, or null.
ffi::Error run_int8(const char* name, ffi::ThreadPool& pool, ffi::AnyBuffer x, paged::amx::W8A8Weights w,
                    const paged::amx::W8A8Weights* up, bool weight_only, ffi::Buffer<ffi::S32> live,
                    ffi::Result<ffi::AnyBuffer>& y) {
  const auto xd = x.dimensions();
  const bool x_bf16 = x.element_type() == ffi::DataType::BF16;
  if (weight_only && !x_bf16) return ffi::Error::InvalidArgument(std::string(name) + ": x must be bfloat16");
  const int64_t N = y->dimensions()[1];
  const bool y_bf16 = y->element_type() == ffi::DataType::BF16;
  const int64_t M = live_rows_of_y(live, xd[0], y);
  if (M == 0) return ffi::Error::Success();
  const bool done =
      weight_only
          ? paged::amx::Int8WeightsMatmulPacked(pool, {static_cast<const uint16_t*>(x.untyped_data()), w, up,
                                                       y->untyped_data(), y_bf16, M, xd[1], N})
          : paged::amx::W8A8MatmulPacked(pool, {x.untyped_data(), x_bf16, w, up, y->untyped_data(), y_bf16, M, xd[1], N});
  if (!done) return ffi::Error::Internal(std::string(name) + ": no AMX tiles, or x's copy could not be allocated");
  return ffi::Error::Success();
}

template <bool WeightOnly>
ffi::Error Int8PackedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S8> w, F32 w_scale, F32 offsets,
                          F32 bias, ffi::Buffer<ffi::S32> live, ffi::Result<ffi::AnyBuffer> y) {
  const char* name = WeightOnly ? "int8_weights_matmul_packed_cpu" : "w8a8_matmul_packed_cpu";
  if (auto error = check_w8a8(name, x, w, w_scale, offsets, bias, live, y); error.failure()) return error;
  return run_int8(name, pool, x, w8a8_weights(w, w_scale, offsets, bias), nullptr, WeightOnly, live, y);
}

// silu(x @ gate) * (x @ up) for two int8 layers held for AMX (each as Int8PackedImpl's, without bias).
template <bool WeightOnly>
ffi::Error Int8GatedPackedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S8> gate, F32 gate_scale,
                               F32 gate_offsets, ffi::Buffer<ffi::S8> up, F32 up_scale, F32 up_offsets,
                               ffi::Buffer<ffi::S32> live, ffi::Result<ffi::AnyBuffer> y) {
  const char* name = WeightOnly ? "int8_weights_gated_matmul_packed_cpu" : "w8a8_gated_matmul_packed_cpu";
  // (No bias: the offsets stand in for it in the checks, which only read sizes.)
  if (auto error = check_w8a8(name, x, gate, gate_scale, gate_offsets, gate_offsets, live, y); error.failure())
    return error;
  if (auto error = check_w8a8(name, x, up, up_scale, up_offsets, up_offsets, live, y); error.failure()) return error;
  paged::amx::W8A8Weights gate_weights = w8a8_weights(gate, gate_scale, gate_offsets, gate_offsets);
  paged::amx::W8A8Weights up_weights = w8a8_weights(up, up_scale, up_offsets, up_offsets);
  gate_weights.bias = up_weights.bias = nullptr;
  return run_int8(name, pool, x, gate_weights, &up_weights, WeightOnly, live, y);
}

// Weight-only int4 on AMX (amx.h: Int4MatmulPacked): x bfloat16 [M, K], w uint8 packed at load [N / 64,
// ceil(K / 64), 2048], scales float32 [G, N] (G = 1, or K / G a multiple of 64), offsets float32 [G, N] or [0],
// bias float32 [N] or [0], y float32 or bfloat16 [M, N]; rows [live, M) of y zeros. Gated: silu(x @ gate) *
// (x @ up), both in the same groups, no bias.
ffi::Error check_int4(const char* name, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> w, F32 scales, F32 offsets,
                      const F32* bias, ffi::Buffer<ffi::S32> live, ffi::Result<ffi::AnyBuffer>& y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto sd = scales.dimensions();
  auto invalid = [&](const char* what) { return ffi::Error::InvalidArgument(std::string(name) + ": " + what); };
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != (xd[1] + 63) / 64 || wd[2] != 2048)
    return invalid("expected x [M, K] and w [N / 64, ceil(K / 64), 2048]");
  if (x.element_type() != ffi::DataType::BF16 ||
      (y->element_type() != ffi::DataType::F32 && y->element_type() != ffi::DataType::BF16))
    return invalid("x must be bfloat16, y float32 or bfloat16");
  const int64_t N = wd[0] * kPanel, K = xd[1];
  if (sd.size() != 2 || sd[1] != N || sd[0] < 1) return invalid("expected scales [groups, N]");
  const int64_t groups = sd[0];
  if (groups > 1 && (K % groups || (K / groups) % 64))
    return invalid("the groups must be one, or split K into groups of a multiple of 64 rows");
  if ((offsets.element_count() != 0 && offsets.element_count() != groups * N) ||
      (bias && bias->element_count() != 0 && bias->element_count() != N) || live.element_count() != 1 ||
      y->dimensions().size() != 2 || y->dimensions()[0] != xd[0] || y->dimensions()[1] != N)
    return invalid("expected offsets [groups, N] or [0], bias [N] or [0], a scalar live and y [M, N]");
  return ffi::Error::Success();
}

paged::amx::Int4Weights int4_weights(ffi::Buffer<ffi::U8> w, F32 scales, F32 offsets, const F32* bias) {
  return {w.typed_data(), scales.typed_data(), offsets.element_count() ? offsets.typed_data() : nullptr,
          bias && bias->element_count() ? bias->typed_data() : nullptr, scales.dimensions()[0]};
}

ffi::Error run_int4(const char* name, ffi::ThreadPool& pool, ffi::AnyBuffer x, paged::amx::Int4Weights w,
                    const paged::amx::Int4Weights* up, ffi::Buffer<ffi::S32> live, ffi::Result<ffi::AnyBuffer>& y) {
  const auto xd = x.dimensions();
  const int64_t N = y->dimensions()[1];
  const bool y_bf16 = y->element_type() == ffi::DataType::BF16;
  const int64_t M = live_rows_of_y(live, xd[0], y);
  if (M == 0) return ffi::Error::Success();
  if (!paged::amx::Int4MatmulPacked(pool, {static_cast<const uint16_t*>(x.untyped_data()), w, up, y->untyped_data(),
                                           y_bf16, M, xd[1], N}))
    return ffi::Error::Internal(std::string(name) + ": no AMX-INT8 tiles, or x's digits could not be allocated");
  return ffi::Error::Success();
}

ffi::Error Int4PackedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> w, F32 scales, F32 offsets,
                          F32 bias, ffi::Buffer<ffi::S32> live, ffi::Result<ffi::AnyBuffer> y) {
  const char* name = "int4_matmul_packed_cpu";
  if (auto error = check_int4(name, x, w, scales, offsets, &bias, live, y); error.failure()) return error;
  return run_int4(name, pool, x, int4_weights(w, scales, offsets, &bias), nullptr, live, y);
}

ffi::Error Int4GatedPackedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> gate, F32 gate_scales,
                               F32 gate_offsets, ffi::Buffer<ffi::U8> up, F32 up_scales, F32 up_offsets,
                               ffi::Buffer<ffi::S32> live, ffi::Result<ffi::AnyBuffer> y) {
  const char* name = "int4_gated_matmul_packed_cpu";
  if (auto error = check_int4(name, x, gate, gate_scales, gate_offsets, nullptr, live, y); error.failure()) return error;
  if (auto error = check_int4(name, x, up, up_scales, up_offsets, nullptr, live, y); error.failure()) return error;
  if (gate_scales.dimensions()[0] != up_scales.dimensions()[0])
    return ffi::Error::InvalidArgument(std::string(name) + ": gate and up must be in the same groups");
  const paged::amx::Int4Weights up_weights = int4_weights(up, up_scales, up_offsets, nullptr);
  return run_int4(name, pool, x, int4_weights(gate, gate_scales, gate_offsets, nullptr), &up_weights, live, y);
}

}  // namespace

// Whether weight-only int8 layers of bfloat16 models run on AMX tiles (Int8WeightsMatmulPackedCpu).
extern "C" int Int8WeightsMatmulPackedIsAvailable() {
#if defined(__AMX_INT8__) && defined(__AVX512BF16__)
  return paged::amx::Available();
#else
  return 0;
#endif
}

// Whether W8A8 layers run on AMX-INT8 tiles (W8A8MatmulPackedCpu): the build targets them and the OS granted the
// tile state.
extern "C" int W8A8MatmulPackedIsAvailable() {
#if defined(__AMX_INT8__)
  return paged::amx::Available();
#else
  return 0;
#endif
}

// Whether this build multiplies the codes with AVX-512 VNNI (else a plain loop: the model keeps its float path).
extern "C" int Int8MatmulCpuIsVectorized() {
#if defined(__AVX512VNNI__)
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Int8MatmulCpu, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The AMX int8 calls' arguments: x, then each weight's codes and vectors (scale, zero offsets, and for the plain
// calls the bias), then live; y.
namespace {
// One weight's arguments after `binding`'s: its packed codes (int8, or int4 nibbles as uint8), scales and zero
// offsets.
template <typename Codes = ffi::Buffer<ffi::S8>, typename Binding>
auto with_weight(Binding binding) {
  return std::move(binding)
      .template Arg<Codes>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>();
}

auto x_binding() { return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>(); }

auto plain_int8_binding() {
  return with_weight(x_binding()).Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>();
}

auto gated_int8_binding() {
  return with_weight(with_weight(x_binding())).Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>();
}

using Nibbles = ffi::Buffer<ffi::U8>;

auto plain_int4_binding() {
  return with_weight<Nibbles>(x_binding()).Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>();
}

auto gated_int4_binding() {
  return with_weight<Nibbles>(with_weight<Nibbles>(x_binding())).Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>();
}
}  // namespace

// The AVX-512 VNNI W8A8 calls take the same arguments, with int8 codes as held, and return the float32 partial
// sums beside y.
XLA_FFI_DEFINE_HANDLER_SYMBOL(W8A8MatmulCpu, W8A8MatmulImpl, plain_int8_binding().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(W8A8GatedMatmulCpu, W8A8GatedMatmulImpl, gated_int8_binding().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(W8A8MatmulPackedCpu, Int8PackedImpl<false>, plain_int8_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(Int8WeightsMatmulPackedCpu, Int8PackedImpl<true>, plain_int8_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(W8A8GatedMatmulPackedCpu, Int8GatedPackedImpl<false>, gated_int8_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(Int8WeightsGatedMatmulPackedCpu, Int8GatedPackedImpl<true>, gated_int8_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(Int4MatmulPackedCpu, Int4PackedImpl, plain_int4_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(Int4GatedMatmulPackedCpu, Int4GatedPackedImpl, gated_int4_binding());
