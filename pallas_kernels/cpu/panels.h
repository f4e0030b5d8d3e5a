// The panel walk the native matmuls share (matmul.cc, int8_matmul.cc): y in 64-column panels, one contiguous
// run of panels per thread, and the live-row convention of their calls.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace paged {

constexpr int64_t kPanel = 64;  // columns per panel: four 16-float vectors

// Panels per pass of a walk (matmul.cc: panels()): y's partial sums for them (M x 1024 floats: 256 KB at 64
// rows) stay in L2 between weight blocks. Without the cap a wide product swept all of its y for every block:
// the LM head over a 152k vocabulary (39 MB of partial sums at 64 rows) ran at 5 GB/s of weights instead of 30.
constexpr int64_t kPanelsPerPass = 16;

// Runs fn(p_begin, p_end) over the panels: one contiguous range per thread (matmul.cc: panels()),
// kPanelsPerPass panels at a time.
template <typename Fn>
void over_panels(xla::ffi::ThreadPool& pool, int64_t num_panels, const Fn& fn) {
  const int64_t parts = std::min<int64_t>(num_panels, std::max<int64_t>(1, pool.num_threads()));
  run_parallel(&pool, parts, 1, parts - 1, [&](int64_t part) {
    const int64_t end = (part + 1) * num_panels / parts;
    for (int64_t p = part * num_panels / parts; p < end; p += kPanelsPerPass) fn(p, std::min(end, p + kPanelsPerPass));
  });
}

// The rows to compute, `live` clamped to [0, rows]; y's rows [live, rows) (of N columns) are zeroed: the step's
// padding, which nobody reads.
template <typename T>
int64_t zero_rows_past_live(xla::ffi::Buffer<xla::ffi::S32> live, int64_t rows, int64_t N, T* y) {
  const int64_t M = std::clamp<int64_t>(live.typed_data()[0], 0, rows);
  std::fill(y + M * N, y + rows * N, T{0});
  return M;
}

// tile(std::integral_constant<int, MR>{}, m0) over rows [0, M): tiles of 6 rows (the register blocking of the
// matmuls' tiles), then one of the M % 6 left.
template <typename Tile>
inline void over_row_tiles(int64_t M, const Tile& tile) {
  int64_t m0 = 0;
  for (; m0 + 6 <= M; m0 += 6) tile(std::integral_constant<int, 6>{}, m0);
  switch (M - m0) {
    case 1: tile(std::integral_constant<int, 1>{}, m0); break;
    case 2: tile(std::integral_constant<int, 2>{}, m0); break;
    case 3: tile(std::integral_constant<int, 3>{}, m0); break;
    case 4: tile(std::integral_constant<int, 4>{}, m0); break;
    case 5: tile(std::integral_constant<int, 5>{}, m0); break;
    default: break;
  }
}

}  // namespace paged
