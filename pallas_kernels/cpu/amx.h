// bfloat16 on Intel AMX tiles: matmuls y[M, N] = x[M, K] @ w[K, N] with float32 accumulation and result
// (amx.cc), and prompt attention over pages (amx_attention.cc).
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace paged::amx {

// Whether this build has the AMX path and the OS lets this process use the tiles (Linux asks each process
// to request the tile state once: arch_prctl(ARCH_REQ_XCOMP_PERM)). False: the caller keeps its own path.
bool Available();

// x [M, K] bf16 row-major, w [K, N] bf16 row-major as loaded (K even, N a multiple of 64), y [M, N] float32,
// every element written. Work is spread over `pool`'s threads. Call only when Available(). False: x's packed
// copy could not be allocated, and y is untouched.
bool Matmul(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* w, float* y, int64_t M, int64_t K,
            int64_t N);

// As Matmul, with w packed at load into the tiles' order (pallas_kernels/cpu: pack_for_amx):
// [N / 64][ceil(K / 32)][4 tiles][16 pairs][16 n][2], where word (p, s, t, i, c, e) is w[32 s + 2 i + e, 64 p +
// 16 t + c] and rows past K are zeros. Decode steps then stream the weights as stored, with no repacking.
bool MatmulPacked(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* packed, float* y, int64_t M,
                  int64_t K, int64_t N);

// As MatmulPacked, with the result in bfloat16: y[M, N] = bf16(x @ w + bias), rounded once from the float32
// sums; bias bf16 [N], or null for none. sums: float32 [M, N] for partial sums where the product is walked in
// blocks of K (over 64 rows; otherwise untouched).
bool MatmulPackedRounded(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* packed,
                         const uint16_t* bias, uint16_t* y, float* sums, int64_t M, int64_t K, int64_t N);

// y[M, N] = silu(x @ gate) * (x @ up) in bfloat16 (the gated MLP's first half), gate and up [K, N] packed as
// MatmulPacked's w; float32 sums and activation, rounded once. False: x's packed copy could not be allocated.
bool GatedMatmulPacked(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* gate, const uint16_t* up,
                       uint16_t* y, int64_t M, int64_t K, int64_t N);

// W8A8 with x quantized per row in the call (amx_int8.cc): y[M, N] = (codes(x) @ w) * x_scale[m] * w_scale[n]
// - (sum_k codes(x)[m, k] * x_scale[m]) * zero_offsets[n] + bias[n], exact int32 sums on AMX-INT8 tiles; or,
// with `up`, silu(that for `w`) * (that for `up`): the gated MLP's first half.
struct W8A8Weights {
  const int8_t* packed;        // w [K, N] packed at load: [N / 64][ceil(K / 64)][4][16][16][4] (amx_int8.cc)
  const float* w_scale;        // [N]
  const float* zero_offsets;   // [N], or null for none (symmetric weights)
  const float* bias;           // [N], or null
};
struct W8A8Call {
  const void* x;               // [M, K], float32 or (x_bf16) bfloat16
  bool x_bf16;
  W8A8Weights w;
  const W8A8Weights* up;       // null, or the up projection of a gated call
  void* y;                     // [M, N] (rows past M untouched), float32 or (y_bf16) bfloat16, rounded once
  bool y_bf16;
  int64_t M, K, N;             // N a multiple of 64
};

// False (y untouched): no AMX-INT8 in this build or process, or x's codes could not be allocated.
bool W8A8MatmulPacked(xla::ffi::ThreadPool& pool, const W8A8Call& call);

// Weight-only int8: y[M, N] = (x @ codes) * w_scale[n] - (sum_k x[m, k]) * zero_offsets[n] + bias[n], x
// bfloat16 [M, K], the codes packed as W8A8's. Up to 16 rows, x as four int8 digits per element against the
// codes on AMX-INT8 tiles (float32 accuracy; amx_int8.cc); beyond, the codes widened to exact bfloat16 a panel at
// a time, float32 sums on AMX-BF16 tiles (amx_widened.cc). w.packed, w_scale, zero_offsets, bias, y, M, K, N as in W8A8Call.
struct Int8WeightsCall {
  const uint16_t* x;
  W8A8Weights w;
  const W8A8Weights* up;  // null, or the up projection of a gated call: silu(x @ w) * (x @ up)
  void* y;
  bool y_bf16;
  int64_t M, K, N;
};

// False (y untouched): no AMX (or no AVX-512 BF16) in this build or process, or x's copy could not be allocated.
bool Int8WeightsMatmulPacked(xla::ffi::ThreadPool& pool, const Int8WeightsCall& call);

// Its prompt-sized path (amx_widened.cc), any M: the codes widened to bfloat16 a panel at a time.
bool Int8WeightsWidenedMatmulPacked(xla::ffi::ThreadPool& pool, const Int8WeightsCall& call);

// Weight-only int4 (amx_int4.cc): y[M, N] = x @ ((u - 8) * scales[g, n] - offsets[g, n]) + bias[n], u the 4-bit
// codes (0..15) of the group g = k / (K / groups), x bfloat16 [M, K]: up to 4 rows as int8 digits on AMX-INT8
// tiles, 5 to 64 against the codes as exact bfloat16 values on AMX-BF16 tiles (both float32 accuracy), each
// group's sums meeting its scales in float32. Groups: 1, or K / groups a multiple of 64.
struct Int4Weights {
  const uint8_t* packed;  // [N / 64][ceil(K / 64)][2048] (pallas_kernels/cpu: pack_int4_for_amx)
  const float* scales;    // [groups, N]
  const float* offsets;   // [groups, N], or null for none
  const float* bias;      // [N], or null
  int64_t groups;
};
struct Int4Call {
  const uint16_t* x;
  Int4Weights w;
  const Int4Weights* up;  // null, or the up projection of a gated call: silu(x @ w) * (x @ up)
  void* y;                // [M, N] float32 or (y_bf16) bfloat16, rounded once
  bool y_bf16;
  int64_t M, K, N;
};

// False (y untouched): no AMX-INT8 (or no AVX-512 BF16) in this build or process, or x's copy could not be
// allocated. Over 64 rows it is Int4WidenedMatmulPacked's.
bool Int4MatmulPacked(xla::ffi::ThreadPool& pool, const Int4Call& call);

// The same product for prompt-sized calls (amx_widened.cc): each panel dequantized once, (u - 8) * scale - offset
// rounded to bfloat16, into bf16 tiles that every 32-row block of x runs against on AMX-BF16, float32 sums.
bool Int4WidenedMatmulPacked(xla::ffi::ThreadPool& pool, const Int4Call& call);

// y[M, N] = x[M, K] @ w[N, K]^T, w row-major as stored (the tied LM head's embedding table), y float32, every
// element written. False (y untouched): K is not a multiple of 32, or no AMX.
bool MatmulTransposed(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* w, float* y, int64_t M,
                      int64_t K, int64_t N);

// tokens[m] = the first index of the maximum of row m of x @ w^T (a NaN counting as +inf), for m < M, without
// writing the [M, N] products: the greedy LM head. As MatmulTransposed otherwise.
bool MatmulTransposedArgmax(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* w, int32_t* tokens,
                            int64_t M, int64_t K, int64_t N);

// One KV head's attention for a run of tokens of one sequence (a prompt chunk), bfloat16 in and out, float32
// scores, softmax and accumulation; probabilities are rounded to bfloat16 for the PV product. Pages of 16 keys.
struct PromptRun {
  const uint16_t* q;         // row (i, g), query head g of the group for token i: q + i * token_stride + g * head_dim
  uint16_t* out;             // the output rows, laid out as q's
  int64_t token_stride;      // elements from one token's rows to the next (query heads x head_dim)
  int64_t tokens, group;     // tokens in the run; query heads per KV head
  int64_t head_dim;          // a multiple of 32, at most kMaxHeadDim
  const int32_t* positions;  // [tokens]: token i sees keys [max(0, positions[i] + 1 - window), positions[i] + 1)
  int32_t window;            // <= 0: no window
  float scale;
  const uint16_t* k_head;    // this layer's and KV head's pages: page b's 16 keys [16, head_dim] at k_head + b * 16 * head_dim
  const uint16_t* v_head;    // the values, laid out as k_head
  const int32_t* pages;      // the sequence's page ids
};
constexpr int64_t kMaxHeadDim = 256;

// Writes run.out's rows. Call only when Available() and AttendsPrompts(). Not thread-safe across one run;
// separate runs may go on separate threads.
void AttendPrompt(const PromptRun& run);

// Whether this build has the AMX attention (it also needs AVX-512 BF16).
bool AttendsPrompts();

}  // namespace paged::amx
