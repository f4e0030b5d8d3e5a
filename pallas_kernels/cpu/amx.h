// bfloat16 matmul on Intel AMX tiles (amx.cc): y[M, N] = x[M, K] @ w[K, N], float32 accumulation and result.
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

// y[M, N] = x[M, K] @ w[N, K]^T, w row-major as stored (the tied LM head's embedding table), y float32, every
// element written. False (y untouched): K is not a multiple of 32, or no AMX.
bool MatmulTransposed(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* w, float* y, int64_t M,
                      int64_t K, int64_t N);

}  // namespace paged::amx
