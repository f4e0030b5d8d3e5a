// The tied LM head on AVX-512 BF16 (transposed.cc): x @ w^T against the embedding table as stored, for CPUs
// without AMX tiles (amx.h has the tile version, which the calls prefer where the CPU has it).
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace paged::avx512bf16 {

// Whether this build has the kernels below (compiled for AVX-512 BF16); without it they return false.
bool Available();

// y[M, N] = x[M, K] @ w[N, K]^T, bfloat16 operands (w row-major as stored), y float32, every element written.
// False (y untouched): K is not a multiple of 32, or the build has no AVX-512 BF16.
bool MatmulTransposed(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* w, float* y, int64_t M,
                      int64_t K, int64_t N);

// tokens[m] = the first index of the maximum of row m of x @ w^T (a NaN counting as +inf), without writing the
// products: the greedy LM head. As MatmulTransposed otherwise.
bool MatmulTransposedArgmax(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* w, int32_t* tokens,
                            int64_t M, int64_t K, int64_t N);

// tokens[m] = the first maximum of row m's sums over the table rows `rows` (count of them, ascending: rows
// that hold every maximum of every row), each sum MatmulTransposedArgmax's own, bit for bit: the screened head's
// last step (head_screen.cc). As MatmulTransposed otherwise.
bool ArgmaxAmong(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* w, int64_t M, int64_t K,
                 const int32_t* rows, int64_t count, int32_t* tokens);

}  // namespace paged::avx512bf16
