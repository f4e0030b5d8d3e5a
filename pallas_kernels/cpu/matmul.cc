// Decode-sized float32 matmul y[M, N] = x[M, K] @ w[K, N] on the CPU, as an XLA FFI custom call.
//
// Why: XLA's CPU dot (YNNPACK) runs the decode steps' matmuls (M = 8-64 rows against the weights) at about
// 63% of its large-matmul rate whatever M is; in the CPU benchmark those matmuls are most of the step.
// This one computes y in 64-column panels: 6 rows x 64 columns of accumulators stay in registers while a
// block of KC rows of the panel, read once from memory, serves every row tile from L1. Each thread owns a
// contiguous range of panels and walks it block row by block row, so its reads of one weight row are one
// contiguous piece; while a block computes, its tiles prefetch the block that comes next.
//
// Contract:
//   x     [M, K]  float32 (row-major)
//   w     [K, N]  float32, N a multiple of 64
//   live  []      int32: rows [0, live) are computed, rows [live, M) of y are zeros. A step's products are
//                 padded to a bucket of rows; the padding is 8-12% of the rows of its compute-bound decode
//                 steps on the benchmark workload, and skipping it leaves every live row's result as it was
//                 (each row's sums run in the same order whatever the tile it falls in).
//   y     [M, N]  float32
// AVX-512 machines run the register-blocked path; elsewhere a plain loop keeps the call correct, and
// MatmulCpuIsVectorized() tells the model to keep XLA's dot.

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 64;       // columns per panel: four 16-float vectors
constexpr int64_t kBlockK = 128;     // panel rows per block: 32 KB, which stays in L1 across row tiles

#if defined(__AVX512F__)
// Rows [0, rows) of `next` (stride ldw) for a tile to prefetch: its share of the next block's weights, so
// they stream in while this block computes from L1. Prefetching only in the first tile (the row block that
// misses) ran the 48-row matmuls at 76% of the machine's matmul rate; spread over all tiles, 87%.
struct Ahead {
  const float* next = nullptr;
  int64_t rows = 0;
};

template <int MR>
inline void micro_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
                       int64_t kc, bool first, Ahead ahead) {
  // One row of `ahead` every `stride` steps, spread over the tile so the memory requests trickle out.
  const int64_t stride = ahead.rows ? std::max<int64_t>(1, kc / ahead.rows) : kc + 1;
  int64_t next_row = 0;
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * ldy + c * 16);
  for (int64_t k = 0; k < kc; ++k) {
    const float* wk = w + k * ldw;
    if (k % stride == 0 && next_row < ahead.rows) {
      const char* line0 = reinterpret_cast<const char*>(ahead.next + next_row++ * ldw);
      for (int line = 0; line < 4; ++line) _mm_prefetch(line0 + 64 * line, _MM_HINT_T0);
    }
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

// Panels [p_begin, p_end) of y, a block of kBlockK weight rows at a time: within a block a row's reads are
// contiguous across the panels (not one 256-byte piece per row and panel, which the hardware prefetcher
// and the TLB handle worse); partial sums wait in y between blocks.
void panels(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t p_begin,
            int64_t p_end) {
  const int64_t tiles = (M + 5) / 6;
  for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
    const int64_t kc = std::min(kBlockK, K - k0);
    const bool first = k0 == 0;
    for (int64_t p = p_begin; p < p_end; ++p) {
      const int64_t n0 = p * kPanel;
      const float* wp = w + k0 * N + n0;
      // The next panel's block, or after the last panel the first panel's next block.
      const float* next = nullptr;
      int64_t next_rows = 0;
      if (p + 1 < p_end) {
        next = wp + kPanel;
        next_rows = kc;
      } else if (k0 + kBlockK < K) {
        next = w + (k0 + kBlockK) * N + p_begin * kPanel;
        next_rows = std::min(kBlockK, K - k0 - kBlockK);
      }
      const int64_t per_tile = (next_rows + tiles - 1) / tiles;
      auto ahead = [&](int64_t tile) {
        const int64_t begin = std::min(next_rows, tile * per_tile);
        return Ahead{next + begin * N, std::min(next_rows, begin + per_tile) - begin};
      };
      int64_t m0 = 0;
      for (; m0 + 6 <= M; m0 += 6)
        micro_tile<6>(x + m0 * K + k0, K, wp, N, y + m0 * N + n0, N, kc, first, ahead(m0 / 6));
      const float* xr = x + m0 * K + k0;
      float* yr = y + m0 * N + n0;
      const Ahead last = ahead(m0 / 6);
      switch (M - m0) {
        case 1: micro_tile<1>(xr, K, wp, N, yr, N, kc, first, last); break;
        case 2: micro_tile<2>(xr, K, wp, N, yr, N, kc, first, last); break;
        case 3: micro_tile<3>(xr, K, wp, N, yr, N, kc, first, last); break;
        case 4: micro_tile<4>(xr, K, wp, N, yr, N, kc, first, last); break;
        case 5: micro_tile<5>(xr, K, wp, N, yr, N, kc, first, last); break;
        default: break;
      }
    }
  }
}
#else
void panels(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t p_begin,
            int64_t p_end) {
  for (int64_t n0 = p_begin * kPanel; n0 < p_end * kPanel; n0 += kPanel) {
    for (int64_t m = 0; m < M; ++m) {
      float acc[kPanel] = {};
      for (int64_t k = 0; k < K; ++k) {
        const float a = x[m * K + k];
        const float* wk = w + k * N + n0;
        for (int64_t c = 0; c < kPanel; ++c) acc[c] += a * wk[c];
      }
      std::copy(acc, acc + kPanel, y + m * N + n0);
    }
  }
}
#endif

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || wd[1] % kPanel)
    return ffi::Error::InvalidArgument("matmul_cpu: expected x [M, K] and w [K, N] with N a multiple of 64");
  if (live.element_count() != 1) return ffi::Error::InvalidArgument("matmul_cpu: expected a scalar live row count");
  const int64_t K = xd[1], N = wd[1];
  const int64_t M = std::clamp<int64_t>(live.typed_data()[0], 0, xd[0]);
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  std::fill(yp + M * N, yp + xd[0] * N, 0.0f);
  if (M == 0) return ffi::Error::Success();
  const int64_t num_panels = N / kPanel;
  // One contiguous range of panels per thread (see panels()).
  const int64_t parts = std::min<int64_t>(num_panels, std::max<int64_t>(1, pool.num_threads()));
  paged::run_parallel(&pool, parts, 1, parts - 1, [&](int64_t part) {
    panels(xp, wp, yp, M, K, N, part * num_panels / parts, (part + 1) * num_panels / parts);
  });
  return ffi::Error::Success();
}

}  // namespace

// Whether this build has the fast path; without it the model keeps XLA's dot (models/linear.py: native_cpu_matmul).
extern "C" int MatmulCpuIsVectorized() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulCpu, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
