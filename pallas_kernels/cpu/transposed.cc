// The tied LM head x @ w^T on AVX-512 BF16, for CPUs without AMX: w is the embedding table [N, K] as stored.
//
// Why: without it the head went to XLA's dot, which at one or two rows read the 0.5B shape's 272 MB table at
// about 19 GB/s of the machine's 33 (docs/kernels.md). Here each row of w meets x as it is: vdpbf16ps of 32
// bfloat16 of a table row against the same 32 of x adds 16 pairs into 16 float32 lanes, so a block of 16
// table rows keeps 16 accumulators for one row of x, and one transpose-and-add tree turns them into the 16
// dot products of the block, lane j the table row j. A block (16 x K bfloat16: 28 KB at K = 896) stays in
// L1 while every row of x passes over it; the next block is requested into L2 during the first row's pass,
// as the matmuls do theirs (matmul.cc).

#include "transposed.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "lane_argmax.h"
#include "parallel.h"

namespace paged::avx512bf16 {

#if defined(__AVX512BF16__)

namespace {

constexpr int64_t kBlock = 16;  // table rows per block: one output vector

// Lane j of the result: the sum of the 16 lanes of a[j].
inline __m512 sum_lanes(__m512 a[16]) {
  __m512 pairs[8], quads[4], octets[2];
  for (int j = 0; j < 8; ++j)  // each 128-bit lane: (a0[0]+a0[2], a1[0]+a1[2], a0[1]+a0[3], a1[1]+a1[3])
    pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j)  // each 128-bit lane: partial sums of rows 4j .. 4j + 3, in order
    quads[j] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int j = 0; j < 2; ++j)  // 128-bit lanes (rows 8j..8j+3 in two halves, rows 8j+4..8j+7 in two halves)
    octets[j] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(octets[0], octets[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(octets[0], octets[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Lanes [0, 8) of the result: lane j the sum of the 16 lanes of a[j] (lanes [8, 16): the same again).
inline __m512 sum_lanes8(__m512 a[8]) {
  __m512 pairs[4], quads[2];
  for (int j = 0; j < 4; ++j)
    pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 2; ++j)
    quads[j] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // 128-bit lanes (rows 0-3 half A, rows 0-3 half B, rows 4-7 half A, rows 4-7 half B), then the halves added.
  const __m512 octet = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 whole = _mm512_add_ps(octet, _mm512_shuffle_f32x4(octet, octet, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_shuffle_f32x4(whole, whole, _MM_SHUFFLE(2, 0, 2, 0));
}

// The dot products of row `xm` of x with table rows [0, rows) of `block` (lanes past rows: 0). With `next`,
// the block after is requested into L2, one line per line read.
template <bool Full>
inline __m512 block_dots(const uint16_t* xm, const uint16_t* block, int64_t K, int64_t rows, const uint16_t* next) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(xm + k);
    for (int j = 0; j < 16; ++j) {
      if (!Full && j >= rows) break;
      if (next) _mm_prefetch(reinterpret_cast<const char*>(next + j * K + k), _MM_HINT_T1);
      acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(block + j * K + k), xv);
    }
  }
  return sum_lanes(acc);
}

// Two rows of x (at xm and xm + K) against half a block, table rows [8 * half, 8 * half + 8): each table
// load serves both rows. Lanes [0, 8) of out[r] are row r's products; the block is full.
inline void half_block_dots_2(const uint16_t* xm, const uint16_t* block, int64_t K, int64_t half, __m512 out[2]) {
  __m512 acc[2][8];
  for (int r = 0; r < 2; ++r)
    for (int j = 0; j < 8; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint16_t* rows = block + 8 * half * K;
  for (int64_t k = 0; k < K; k += 32) {
    const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xm + k), x1 = (__m512bh)_mm512_loadu_si512(xm + K + k);
    for (int j = 0; j < 8; ++j) {
      const __m512bh t = (__m512bh)_mm512_loadu_si512(rows + j * K + k);
      acc[0][j] = _mm512_dpbf16_ps(acc[0][j], t, x0);
      acc[1][j] = _mm512_dpbf16_ps(acc[1][j], t, x1);
    }
  }
  out[0] = sum_lanes8(acc[0]);
  out[1] = sum_lanes8(acc[1]);
}

// sink(part, m, n0, rows, dots) for every block of 16 table rows (n0 its first, rows <= 16 of them) and every
// row m < M of x, the table split into one contiguous run of blocks per thread.
template <typename Sink>
int64_t for_blocks(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* w, int64_t M, int64_t K,
                   int64_t N, const Sink& sink) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  const int64_t parts = std::min<int64_t>(blocks, std::max<int64_t>(1, pool.num_threads()));
  run_parallel(&pool, parts, 1, parts - 1, [&](int64_t part) {
    const int64_t end = (part + 1) * blocks / parts;
    for (int64_t b = part * blocks / parts; b < end; ++b) {
      const int64_t n0 = b * kBlock, rows = std::min(kBlock, N - n0);
      const uint16_t* block = w + n0 * K;
      const uint16_t* next = b + 1 < end && N - n0 - kBlock >= kBlock ? block + kBlock * K : nullptr;
      // Row 0 alone (it requests the next block), then pairs of rows where the block is full.
      for (int64_t m = 0; m < M;) {
        if (m == 0 || m + 1 == M || rows < kBlock) {
          const __m512 dots = rows == kBlock ? block_dots<true>(x + m * K, block, K, rows, m == 0 ? next : nullptr)
                                             : block_dots<false>(x + m * K, block, K, rows, m == 0 ? next : nullptr);
          sink(part, m, n0, rows, dots);
          ++m;
          continue;
        }
        __m512 low[2], high[2];
        half_block_dots_2(x + m * K, block, K, 0, low);
        half_block_dots_2(x + m * K, block, K, 1, high);
        for (int r = 0; r < 2; ++r)  // lanes [0, 8) of low and of high, as one vector of the block's 16
          sink(part, m + r, n0, rows, _mm512_shuffle_f32x4(low[r], high[r], _MM_SHUFFLE(1, 0, 1, 0)));
        m += 2;
      }
    }
  });
  return parts;
}

inline __mmask16 first_lanes(int64_t rows) { return static_cast<__mmask16>((1u << rows) - 1); }

}  // namespace

bool Available() { return true; }

bool MatmulTransposed(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* w, float* y, int64_t M,
                      int64_t K, int64_t N) {
  if (K % 32) return false;
  for_blocks(pool, x, w, M, K, N, [&](int64_t, int64_t m, int64_t n0, int64_t rows, __m512 dots) {
    _mm512_mask_storeu_ps(y + m * N + n0, first_lanes(rows), dots);
  });
  return true;
}

bool MatmulTransposedArgmax(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* w, int32_t* tokens,
                            int64_t M, int64_t K, int64_t N) {
  if (K % 32) return false;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // Per thread, row of x and lane: the best value over the thread's blocks (a NaN counting as +inf, as
  // first_argmax) and the first table row that reached it; lanes compare vertically, block after block. A lane
  // that never beats -inf keeps its thread's first row: that matters only when a row's maximum is -inf, and
  // then row 0, thread 0's, is the first.
  std::vector<std::vector<float>> best(threads, std::vector<float>(M * kBlock, -INFINITY));
  std::vector<std::vector<int32_t>> index(threads);
  const int64_t parts = for_blocks(pool, x, w, M, K, N, [&](int64_t part, int64_t m, int64_t n0, int64_t rows,
                                                             __m512 dots) {
    if (index[part].empty()) index[part].assign(M * kBlock, static_cast<int32_t>(n0));  // the thread's first row
    keep_lane_best(best[part].data() + m * kBlock, index[part].data() + m * kBlock, dots, first_lanes(rows),
                   static_cast<int32_t>(n0));
  });
  first_maximum_of_lanes(
      parts, M, kBlock, [&](int64_t part, int64_t m, int64_t l) { return best[part][m * kBlock + l]; },
      [&](int64_t part, int64_t m, int64_t l) { return index[part][m * kBlock + l]; }, tokens);
  return true;
}

bool ArgmaxAmong(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* w, int64_t M, int64_t K,
                 const int32_t* rows, int64_t count, int32_t* tokens) {
  if (K % 32 || count < 1) return false;
  // The rows gathered 16 at a time into a block (zeros past count), each summed by block_dots: a lane's sum
  // depends only on its own table row, so it is the full walk's (whose row pairs reduce in the same order).
  const int64_t groups = (count + kBlock - 1) / kBlock;
  const int64_t parts = std::min(groups, std::max<int64_t>(1, pool.num_threads()));
  std::vector<std::vector<float>> best(parts, std::vector<float>(M, -INFINITY));
  std::vector<std::vector<int32_t>> first(parts, std::vector<int32_t>(M, rows[0]));
  run_parallel(&pool, parts, 1, parts - 1, [&](int64_t part) {
    std::vector<uint16_t> gathered(kBlock * K);
    alignas(64) float dots[kBlock];
    for (int64_t g = part * groups / parts; g < (part + 1) * groups / parts; ++g) {
      const int64_t in_group = std::min(kBlock, count - g * kBlock);
      for (int64_t j = 0; j < kBlock; ++j)
        if (j < in_group) std::copy(w + rows[g * kBlock + j] * K, w + (rows[g * kBlock + j] + 1) * K, &gathered[j * K]);
        else std::fill(gathered.begin() + j * K, gathered.begin() + (j + 1) * K, 0);
      for (int64_t m = 0; m < M; ++m) {
        _mm512_store_ps(dots, block_dots<true>(x + m * K, gathered.data(), K, kBlock, nullptr));
        for (int64_t j = 0; j < in_group; ++j) {
          const float v = std::isnan(dots[j]) ? INFINITY : dots[j];  // as first_argmax
          if (v > best[part][m]) best[part][m] = v, first[part][m] = rows[g * kBlock + j];
        }
      }
    }
  });
  first_of_parts(best, first, M, tokens);
  return true;
}

#else

bool Available() { return false; }

bool MatmulTransposed(xla::ffi::ThreadPool&, const uint16_t*, const uint16_t*, float*, int64_t, int64_t, int64_t) {
  return false;
}

bool MatmulTransposedArgmax(xla::ffi::ThreadPool&, const uint16_t*, const uint16_t*, int32_t*, int64_t, int64_t,
                            int64_t) {
  return false;
}

bool ArgmaxAmong(xla::ffi::ThreadPool&, const uint16_t*, const uint16_t*, int64_t, int64_t, const int32_t*, int64_t,
                 int32_t*) {
  return false;
}

#endif

}  // namespace paged::avx512bf16
