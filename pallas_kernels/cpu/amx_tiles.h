// What the AMX kernels (amx.cc, amx_attention.cc) share: the tile configuration and the VNNI pair interleave.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace paged::amx {

// Memory for tile loads and stores starts on a cache line: malloc's 16-byte alignment splits every 64-byte
// tile row over two lines, and the prompt-sized matmul ran at a third of its speed (one thread, 512 rows of
// the 0.5B shape's q projection: 0.82 against 2.2 TFLOP/s in the tile loop).
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
template <typename T>
using TileVector = std::vector<T, LineAligned<T>>;

}  // namespace paged::amx

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
#define PAGED_AMX 1
#include <immintrin.h>

namespace paged::amx {

constexpr int64_t kTileWords = 512;  // one tile: 16 rows x 64 bytes (32 bf16 or 16 float32 a row)

// The bfloat16 walks (amx.cc, and amx_widened.cc's widened codes): calls over kSmallRows rows are prompt-sized,
// and their gated (gate/up) calls sum K in chunks of kGatedChunkSteps bf16 tile steps (256 k), so a chunk of
// a 32-row block of x (16 KB) stays in L1 while the column tiles pass over it; whole K (56 KB at the 0.5B
// shape) came from L2 each time (one thread, 512 rows, 896 x 4864 x 2: 1.21 -> 1.39 TFLOP/s).
constexpr int64_t kSmallRows = 64;
constexpr int64_t kGatedChunkSteps = 8;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes: partial blocks are zero-padded instead of reconfigured. Per thread.
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}

// Word i of the result: 2i from a (row k), 2i + 1 from b (row k + 1), for columns [0, 16) (kPairLow) and
// [16, 32) (kPairHigh) of 32-column pieces of the two rows: the B operand's row of pairs.
alignas(64) inline constexpr uint16_t kPairLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) inline constexpr uint16_t kPairHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                       24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

}  // namespace paged::amx

#endif
