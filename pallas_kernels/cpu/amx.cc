// bfloat16 matmul on Intel AMX tiles: y[M, N] = x[M, K] @ w[K, N], float32 accumulation and result.
//
// Why: on a CPU with AMX, one tile instruction (TDPBF16PS) multiplies a 16 x 32 bf16 tile by a 32 x 16 one
// into 16 x 16 float32 sums: 16,384 FLOPs per 16 cycles, about 3.3 TFLOP/s per core on the benchmark CPU,
// against about 0.1 for the AVX-512 BF16 dot products (matmul.cc) and 0.5 for XLA's bf16 dot there.
//
// Layout. A tile row is 64 bytes: for x (the A operand) 32 consecutive k of one row; for w (the B operand)
// 16 pairs (w[k, n], w[k + 1, n]) of 16 consecutive n ("VNNI" order). The weights are packed so that every
// tile is 1 KB contiguous, which the tile loads read at L1 speed:
//   x -> A tiles read in place where K is a multiple of 32 (a tile row is 32 k of one row of x, 64 bytes at a
//        stride of 2K); otherwise, and for a last block of fewer than 32 rows, packed per call into
//        [blocks][K / 32][32 rows][32 k], zero-padded in M and K
//   w -> wb [panel][K block / 32][4][16 pairs][16 n][2]   per block of weight rows and a pass of 64-column
//        panels (Plan, below); each weight row's piece of the pass is read contiguously
// so weights given [K, N] (Matmul) are read from memory once per call. MatmulPacked takes them already in
// that order for the whole of K, packed once at load (the engine's bf16 kernels), and reads the tiles in place.
//
// Tiles: 0-3 accumulate a 32 x 32 block of y (2 x 2 tiles of 16 x 16), 4-5 hold two A tiles (rows 0-15 and
// 16-31), 6-7 two B tiles: each loaded tile serves two products. Blocks of 16 rows or fewer use one A tile
// and four accumulators across the panel's 64 columns instead. Partial sums wait in y between weight blocks;
// the last block of rows (M not a multiple of 32) goes through a buffer, so y past row M is never touched.

#include "amx.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "amx_head.h"
#include "amx_tiles.h"
#include "bf16.h"
#include "lane_argmax.h"
#include "parallel.h"
#include "vector_math.h"

#if defined(PAGED_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace paged::amx {

#if defined(PAGED_AMX)
namespace {

constexpr int64_t kRows = 32;    // x rows per block: two A tiles
constexpr int64_t kDepth = 32;   // k per tile step
constexpr int64_t kPanel = 64;   // y columns per panel: four B tiles
// How the weights are walked: blocks of `block_k` rows of a pass of `panels_per_pass` panels, packed into a
// 512 KB buffer (L2) either way. Large products are compute-bound: 512-row blocks of 8 panels leave each
// panel's 64 KB slice near L1 for all row blocks and halve how often y's partial sums are reloaded. Small ones
// (decode steps) are bound by reading the weights: 64-row blocks of 64 panels read each weight row's piece of
// the pass, 8 KB, in one run, which the memory system streams faster than 1 KB pieces. Measured on the 0.5B
// shape's products (`paged bench matmul`, two threads), small plan against large: 8 rows 128 against 119
// GFLOP/s, 16: 245 / 190, 32: 446 / 415, 64: 670 / 597; 128 rows: 865 / 881.
struct Plan {
  int64_t block_k, panels_per_pass;
};
constexpr Plan kSmallPlan{64, 64}, kLargePlan{512, 8};
constexpr int64_t kPackedWords = 512 * 8 * 64;  // block_k x panels_per_pass x 64 columns, either plan
static_assert(kSmallPlan.block_k * kSmallPlan.panels_per_pass * 64 <= kPackedWords &&
              kLargePlan.block_k * kLargePlan.panels_per_pass * 64 <= kPackedWords);

// Rows [k0, k0 + kc) (kc even) of panels [p0, p0 + np) of w (row stride N) into wb; pairs past kc up to the
// tile step are zeros.
void pack_weights(const uint16_t* w, int64_t N, int64_t k0, int64_t kc, int64_t p0, int64_t np, uint16_t* wb) {
  const __m512i low = _mm512_load_si512(kPairLow), high = _mm512_load_si512(kPairHigh);
  const int64_t steps = (kc + kDepth - 1) / kDepth;
  for (int64_t pair = 0; pair < steps * kDepth / 2; ++pair) {
    const int64_t step = pair / 16, row = pair % 16;
    const bool real = 2 * pair < kc;  // kc is even: both rows of a pair exist, or neither
    const uint16_t* r0 = w + (real ? (k0 + 2 * pair) * N : 0) + p0 * kPanel;
    const uint16_t* r1 = r0 + (real ? N : 0);
    for (int64_t p = 0; p < np; ++p) {
      uint16_t* out = wb + (p * steps + step) * 4 * kTileWords + row * 32;
      for (int half = 0; half < 2; ++half) {
        const __m512i a = real ? _mm512_loadu_si512(r0 + p * kPanel + 32 * half) : _mm512_setzero_si512();
        const __m512i b = real ? _mm512_loadu_si512(r1 + p * kPanel + 32 * half) : _mm512_setzero_si512();
        _mm512_storeu_si512(out + 2 * half * kTileWords, _mm512_permutex2var_epi16(a, low, b));
        _mm512_storeu_si512(out + (2 * half + 1) * kTileWords, _mm512_permutex2var_epi16(a, high, b));
      }
    }
  }
}

// Rows [m0, m0 + 32) of x (those past M zeros) into xa's block: [K / 32][32 rows][32 k], k past K zeros.
void pack_rows(const uint16_t* x, int64_t M, int64_t K, int64_t m0, uint16_t* block) {
  const int64_t steps = (K + kDepth - 1) / kDepth;
  for (int64_t r = 0; r < kRows; ++r) {
    uint16_t* out = block + r * kDepth;
    const bool real = m0 + r < M;
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t k = s * kDepth, valid = real ? std::min<int64_t>(kDepth, K - k) : 0;
      const __mmask32 lanes = valid >= kDepth ? ~0u : (1u << valid) - 1;  // none for rows past M
      _mm512_storeu_si512(out + s * kRows * kDepth, _mm512_maskz_loadu_epi16(lanes, x + (real ? (m0 + r) * K + k : 0)));
    }
  }
}

// 32 rows of x as A tiles: step s's rows 0-15 at data + s * step and rows 16-31 at + half, rows `stride`
// bytes apart.
struct RowTiles {
  const uint16_t* data;
  int64_t step, half, stride;
  RowTiles from_step(int64_t s) const { return {data + s * step, step, half, stride}; }
};

// x's row blocks as A tiles: the first `in_place` blocks read from x itself, the rest from `packed`.
struct XTiles {
  const uint16_t* x;
  int64_t K, in_place;
  const uint16_t* packed;
  RowTiles block(int64_t mb) const {
    if (mb < in_place) return {x + mb * kRows * K, kDepth, 16 * K, K * 2};
    const int64_t steps = (K + kDepth - 1) / kDepth;
    return {packed + (mb - in_place) * steps * 2 * kTileWords, 2 * kTileWords, kTileWords, 64};
  }
};

// Streaming weights from memory, the L2 hardware prefetcher stops at the end of each 4 KB page and starts on
// the next only when a read there misses. Requesting a page's first lines a little before the tile loads
// reach it starts that early (a step is 4 KB, so a new page every step). Four lines at the first page
// boundary at or after `p`, into L2. Measured in a C++ loop over the 0.5B shape's 24 layers, 32 rows, two
// threads, median of 7: gate/up 790 -> 745 us a layer, down 402 -> 375. The whole of the step ahead (64
// lines) was no faster than none, and the gain held only with the page boundary found from the address:
// the step's own start, 1 or 2 KB into a page, lost it.
inline void start_page_stream(const void* p) {
  const char* page = reinterpret_cast<const char*>((reinterpret_cast<uintptr_t>(p) + 4095) & ~uintptr_t(4095));
  for (int line = 0; line < 4; ++line) _mm_prefetch(page + 64 * line, _MM_HINT_T1);
}

// y[32, 32] (+)= a's rows x b's two column tiles over `steps` tile steps. b: a panel's
// [steps][4 tiles][16][32], offset to the first of the two column tiles. other_half: the panel's other two
// column tiles, requested into L2 step by step while this pass reads its half from memory, so the weights
// stream a whole 4 KB step at a time instead of every other 2 KB (decode steps, 17-32 rows, 80 products of
// 8.7 MB streamed from memory: 17.1-18.7 -> 19.8-20.0 GB/s); the page two steps ahead is started too.
inline void tile_32x32(const RowTiles& a, const uint16_t* b, float* y, int64_t ldy, int64_t steps, bool first,
                       const uint16_t* other_half = nullptr) {
  const int64_t stride = ldy * sizeof(float);
  if (first) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  } else {
    _tile_loadd(0, y, stride); _tile_loadd(1, y + 16, stride);
    _tile_loadd(2, y + 16 * ldy, stride); _tile_loadd(3, y + 16 * ldy + 16, stride);
  }
  for (int64_t s = 0; s < steps; ++s) {
    if (other_half) {
      for (int line = 0; line < 32; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(other_half + s * 4 * kTileWords) + 64 * line, _MM_HINT_T1);
      start_page_stream(b + (s + 2) * 4 * kTileWords);
    }
    _tile_loadd(4, a.data + s * a.step, a.stride);
    _tile_loadd(5, a.data + s * a.step + a.half, a.stride);
    _tile_loadd(6, b + s * 4 * kTileWords, 64);
    _tile_loadd(7, b + (s * 4 + 1) * kTileWords, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, y, stride); _tile_stored(1, y + 16, stride);
  _tile_stored(2, y + 16 * ldy, stride); _tile_stored(3, y + 16 * ldy + 16, stride);
}

// y[16, 64] (+)= a's first 16 rows x b's four column tiles (b: the panel's [steps][4][16][32]).
inline void tile_16x64(const RowTiles& a, const uint16_t* b, float* y, int64_t ldy, int64_t steps, bool first) {
  const int64_t stride = ldy * sizeof(float);
  if (first) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  } else {
    _tile_loadd(0, y, stride); _tile_loadd(1, y + 16, stride); _tile_loadd(2, y + 32, stride);
    _tile_loadd(3, y + 48, stride);
  }
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, a.data + s * a.step, a.stride);
    _tile_loadd(6, b + s * 4 * kTileWords, 64);
    _tile_loadd(7, b + (s * 4 + 1) * kTileWords, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, b + (s * 4 + 2) * kTileWords, 64);
    _tile_loadd(7, b + (s * 4 + 3) * kTileWords, 64);
    _tile_dpbf16ps(2, 4, 6);
    _tile_dpbf16ps(3, 4, 7);
  }
  _tile_stored(0, y, stride); _tile_stored(1, y + 16, stride); _tile_stored(2, y + 32, stride);
  _tile_stored(3, y + 48, stride);
}

alignas(64) thread_local uint16_t packed_weights[kPackedWords];
thread_local TileVector<float> last_rows_buffer;  // y of a partial row block: [32, panels_per_pass * 64]

// The weights of a product: w [K, N] as loaded, packed per block here, or already packed at load
// (`prepacked`: [N / 64][K steps][4 tiles][16 pairs][16 n][2], the order pack_weights writes a block in, for
// the whole of K), whose tiles are read in place.
struct Weights {
  const uint16_t* data;
  bool prepacked;
};

// How a product walks its weights. Packed per call: the plans above. Prepacked at load, small products read
// one panel's whole K (a contiguous run: the thread's share of the weights streams in one pass, and no
// partial sums wait in y); large ones keep the large plan. Tried for those on the 0.5B shape's products at
// 128-2048 rows (`paged bench matmul`): whole K with 1, 2 or 4 panels a pass, 1024-row blocks of 2 or 4, 256
// of 8; none was ahead of 512 x 8 by more than the run-to-run spread (about 15%).
Plan plan_for(int64_t M, int64_t K, bool prepacked) {
  if (M > kSmallRows) return kLargePlan;
  return prepacked ? Plan{(K + kDepth - 1) / kDepth * kDepth, 1} : kSmallPlan;
}

// A product's bfloat16 result: out[M, N] = bf16(x @ w + bias), bias bf16 [N] or none. Each 32 x 64 block is
// rounded as soon as its last sums are in (from L1), so no separate pass reads the float32 sums back.
struct Rounded {
  uint16_t* out = nullptr;
  const uint16_t* bias = nullptr;
};

// out's rows [0, rows) and 64 columns from float32 sums s (row stride lds) plus bias's 64 columns.
void round_block(const float* s, int64_t lds, int64_t rows, const uint16_t* bias, uint16_t* out, int64_t ldo) {
  __m512 b[4];
  for (int c = 0; c < 4; ++c) b[c] = bias ? load_bf16x16(bias + 16 * c) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < 4; ++c)
      store_product_bf16x16(out + r * ldo + 16 * c, _mm512_add_ps(_mm512_loadu_ps(s + r * lds + 16 * c), b[c]));
}

// Panels [p_begin, p_end) of y from x's tiles, a pass of the plan's panels at a time. With `rounded.out`, the
// result goes there instead, and y (float32 [M, N]) holds only partial sums between blocks of weight rows:
// a product whose plan takes the whole of K in one block never touches it.
void panels(const XTiles& xt, Weights w, float* y, int64_t M, int64_t K, int64_t N, int64_t p_begin,
            int64_t p_end, Rounded rounded = {}) {
  configure_tiles();
  const Plan plan = plan_for(M, K, w.prepacked);
  const int64_t block_k = plan.block_k, panels_per_pass = plan.panels_per_pass;
  last_rows_buffer.resize(kRows * panels_per_pass * kPanel);
  float* last_rows = last_rows_buffer.data();
  alignas(64) float block_sums[kRows * kPanel];
  const int64_t k_steps = (K + kDepth - 1) / kDepth;
  const int64_t row_blocks = (M + kRows - 1) / kRows;
  const int64_t last_block_rows = M - (row_blocks - 1) * kRows;
  for (int64_t p0 = p_begin; p0 < p_end; p0 += panels_per_pass) {
    const int64_t np = std::min(panels_per_pass, p_end - p0);
    for (int64_t k0 = 0; k0 < K; k0 += block_k) {
      const int64_t kc = std::min(block_k, K - k0), steps = (kc + kDepth - 1) / kDepth;
      // The pass's first panel at this block, and the words from one panel to the next.
      const uint16_t* b_block = packed_weights;
      int64_t panel_words = steps * 4 * kTileWords;
      if (w.prepacked) {
        panel_words = k_steps * 4 * kTileWords;
        b_block = w.data + p0 * panel_words + k0 / kDepth * 4 * kTileWords;
      } else {
        pack_weights(w.data, N, k0, kc, p0, np, packed_weights);
      }
      const bool first = k0 == 0, last = k0 + block_k >= K;
      // Row block by row block: its A tiles stay in L1 across the pass's panels.
      for (int64_t mb = 0; mb < row_blocks; ++mb) {
        const RowTiles a = xt.block(mb).from_step(k0 / kDepth);
        const bool partial = mb == row_blocks - 1 && last_block_rows < kRows;
        const bool in_block = rounded.out && first && last;  // the sums need not outlive the block
        const int64_t ldy = in_block ? kPanel : partial ? panels_per_pass * kPanel : N;
        for (int64_t p = 0; p < np; ++p) {
          const uint16_t* b = b_block + p * panel_words;
          float* yb = in_block  ? block_sums
                      : partial ? last_rows + p * kPanel
                                : y + mb * kRows * N + (p0 + p) * kPanel;
          if (partial && last_block_rows <= 16) {
            tile_16x64(a, b, yb, ldy, steps, first);
          } else {
            tile_32x32(a, b, yb, ldy, steps, first, w.prepacked && mb == 0 ? b + 2 * kTileWords : nullptr);
            tile_32x32(a, b + 2 * kTileWords, yb + 32, ldy, steps, first);
          }
          if (rounded.out && last) {
            const int64_t col = (p0 + p) * kPanel;
            round_block(yb, ldy, partial ? last_block_rows : kRows, rounded.bias ? rounded.bias + col : nullptr,
                        rounded.out + mb * kRows * N + col, N);
          }
        }
      }
    }
    if (last_block_rows < kRows && !rounded.out)
      for (int64_t r = 0; r < last_block_rows; ++r)
        std::memcpy(y + ((row_blocks - 1) * kRows + r) * N + p0 * kPanel, last_rows + r * panels_per_pass * kPanel,
                    np * kPanel * sizeof(float));
  }
  _tile_release();
}

// ---- y = silu(x @ gate) * (x @ up), bfloat16: the gated MLP's first half ----------------------------------
//
// Both kernels packed at load (MatmulPacked's layout). Each 32-row block of a panel computes the gate's and
// the up projection's 32 x 64 sums over the whole of K into two small buffers, and the epilogue writes the
// block's bfloat16 product: the two [M, N] float32 results never reach memory, and no separate pass reads
// them back to apply the activation.

// y's rows [0, rows) and 64 columns from the gate's and up's float32 sums g, u ([32][64]).
void silu_times(const float* g, const float* u, int64_t rows, uint16_t* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < kPanel; c += 16) {
      const __m512 gate = _mm512_loadu_ps(g + r * kPanel + c), up = _mm512_loadu_ps(u + r * kPanel + c);
      const __m512 out = _mm512_mul_ps(silu512(gate), up);
      store_product_bf16x16(y + r * ldy + c, out);
    }
  }
}

// A finished block's activation, run a few rows at a time between the next block's tile calls. Each call
// ends in tile stores, and tile loads after a store wait for it to drain (~270 ns a call in tile loops on
// this CPU); vector work placed there runs in that wait instead of after it. The 0.5B shape's gate/up at 512
// rows, 24 layers from memory, two alternating builds each: one thread 7,850-8,100 -> 7,580-7,620 us a layer,
// two threads 3,950-4,060 -> 3,710-3,860; at 32 rows within noise.
struct PendingActivation {
  const float *g = nullptr, *u = nullptr;
  uint16_t* y = nullptr;
  int64_t ldy = 0, done = 0, rows = 0;
  void advance(int64_t count) {
    const int64_t end = std::min(rows, done + count);
    if (end > done) silu_times(g + done * kPanel, u + done * kPanel, end - done, y + done * ldy, ldy);
    done = end;
  }
};

// Panels [p_begin, p_end) of y.
void gated_panels(const XTiles& xt, const uint16_t* gate, const uint16_t* up, uint16_t* y, int64_t M, int64_t K,
                  int64_t N, int64_t p_begin, int64_t p_end) {
  configure_tiles();
  const int64_t steps = (K + kDepth - 1) / kDepth, panel_words = steps * 4 * kTileWords;
  const int64_t chunk = M > kSmallRows ? kGatedChunkSteps : steps;
  // Sums of the block being computed and of the one whose activation is pending, in turn.
  alignas(64) float g[2][kRows * kPanel], u[2][kRows * kPanel];
  const int64_t calls = (steps + chunk - 1) / chunk * 4, rows_per_call = (kRows + calls - 1) / calls;
  PendingActivation pending;
  int buffer = 0;
  for (int64_t p = p_begin; p < p_end; ++p) {
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int64_t rows = std::min(kRows, M - m0);
      float *gs = g[buffer], *us = u[buffer];
      for (int64_t s0 = 0; s0 < steps; s0 += chunk) {
        const RowTiles a = xt.block(m0 / kRows).from_step(s0);
        const uint16_t* gb = gate + p * panel_words + s0 * 4 * kTileWords;
        const uint16_t* ub = up + p * panel_words + s0 * 4 * kTileWords;
        const int64_t n = std::min(chunk, steps - s0);
        const bool first = s0 == 0, stream = m0 == 0 && chunk == steps;
        if (rows <= 16) {
          tile_16x64(a, gb, gs, kPanel, n, first);
          pending.advance(2 * rows_per_call);
          tile_16x64(a, ub, us, kPanel, n, first);
          pending.advance(2 * rows_per_call);
        } else {
          tile_32x32(a, gb, gs, kPanel, n, first, stream ? gb + 2 * kTileWords : nullptr);
          pending.advance(rows_per_call);
          tile_32x32(a, gb + 2 * kTileWords, gs + 32, kPanel, n, first);
          pending.advance(rows_per_call);
          tile_32x32(a, ub, us, kPanel, n, first, stream ? ub + 2 * kTileWords : nullptr);
          pending.advance(rows_per_call);
          tile_32x32(a, ub + 2 * kTileWords, us + 32, kPanel, n, first);
          pending.advance(rows_per_call);
        }
      }
      pending.advance(kRows);  // whatever is left of the previous block
      pending = {gs, us, y + m0 * N + p * kPanel, N, 0, rows};
      buffer ^= 1;
    }
  }
  pending.advance(kRows);
  _tile_release();
}

}  // namespace

bool Available() {
  constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
  static const bool granted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return granted;
}

namespace {

// x's A tiles: whole row blocks in place when K is a multiple of 32, the rest packed (per calling thread, kept
// from call to call: a fresh allocation of a prompt step's x, megabytes, came from new pages every call, and
// faulting them in cost more than packing into them). False if the packed blocks could not be allocated.
bool x_tiles(xla::ffi::ThreadPool& pool, const uint16_t* x, int64_t M, int64_t K, XTiles& xt) {
  const int64_t k_steps = (K + kDepth - 1) / kDepth, row_blocks = (M + kRows - 1) / kRows;
  const int64_t in_place = K % kDepth == 0 ? M / kRows : 0, packed_blocks = row_blocks - in_place;
  const int64_t block_words = k_steps * kRows * kDepth;
  thread_local TileVector<uint16_t> packed_x;
  try {
    if (packed_x.size() < static_cast<size_t>(packed_blocks * block_words)) packed_x.resize(packed_blocks * block_words);
  } catch (const std::bad_alloc&) {
    return false;
  }
  uint16_t* xa = packed_x.data();
  xt = XTiles{x, K, in_place, xa};
  run_parallel(&pool, packed_blocks, 1, packed_blocks - 1,
               [&](int64_t b) { pack_rows(x, M, K, (in_place + b) * kRows, xa + b * block_words); });
  return true;
}

// fn(p_begin, p_end) on each thread's contiguous range of y's N / 64 panels: each thread streams one run of
// the weights (finer parts were slower, docs/kernels.md).
template <typename Fn>
void split_panels(xla::ffi::ThreadPool& pool, int64_t N, const Fn& fn) {
  const int64_t num_panels = N / kPanel, parts = std::min(num_panels, std::max<int64_t>(1, pool.num_threads()));
  run_parallel(&pool, parts, 1, parts - 1,
               [&](int64_t part) { fn(part * num_panels / parts, (part + 1) * num_panels / parts); });
}

// x's tiles, then each thread's range of panels.
bool run_matmul(xla::ffi::ThreadPool& pool, const uint16_t* x, Weights w, float* y, int64_t M, int64_t K,
                int64_t N, Rounded rounded = {}) {
  XTiles xt;
  if (!x_tiles(pool, x, M, K, xt)) return false;
  split_panels(pool, N, [&](int64_t begin, int64_t end) { panels(xt, w, y, M, K, N, begin, end, rounded); });
  return true;
}

}  // namespace

bool Matmul(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* w, float* y, int64_t M, int64_t K,
            int64_t N) {
  return run_matmul(pool, x, Weights{w, false}, y, M, K, N);
}

bool MatmulPacked(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* packed, float* y, int64_t M,
                  int64_t K, int64_t N) {
  return run_matmul(pool, x, Weights{packed, true}, y, M, K, N);
}

bool MatmulPackedRounded(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* packed,
                         const uint16_t* bias, uint16_t* y, float* sums, int64_t M, int64_t K, int64_t N) {
  return run_matmul(pool, x, Weights{packed, true}, sums, M, K, N, Rounded{y, bias});
}

bool GatedMatmulPacked(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* gate, const uint16_t* up,
                       uint16_t* y, int64_t M, int64_t K, int64_t N) {
  XTiles xt;
  if (!x_tiles(pool, x, M, K, xt)) return false;
  split_panels(pool, N, [&](int64_t begin, int64_t end) { gated_panels(xt, gate, up, y, M, K, N, begin, end); });
  return true;
}

bool MatmulTransposed(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* w, float* y, int64_t M,
                      int64_t K, int64_t N) {
  if (K % kDepth) return false;
  using head::block_column, head::block_lanes, head::transposed_rows, head::TransposedBlock;
  split_table(pool, N, [&](int64_t, int64_t n_begin, int64_t n_end) {
    transposed_rows(x, w, M, K, n_begin, n_end,
                    [&](const TransposedBlock& block, int64_t n0, int64_t rows, int64_t m0, int64_t rows_m) {
                      for (int64_t m = 0; m < rows_m; ++m)
                        for (int64_t half = 0; half < 2 && 16 * half < rows; ++half)
                          _mm512_mask_storeu_ps(y + (m0 + m) * N + n0 + 16 * half, block_lanes(rows, half),
                                                block_column(block, m, half));
                    });
  });
  return true;
}

bool MatmulTransposedArgmax(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* w, int32_t* tokens,
                            int64_t M, int64_t K, int64_t N) {
  if (K % kDepth) return false;
  using head::block_column, head::block_lanes, head::transposed_rows, head::TransposedBlock;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // Per thread, row of x and lane (w rows n0 + 16 half + lane of each block): the lane's best value over the
  // thread's run of w (a NaN counting as +inf, as first_argmax) and the first w row that reached it. Lanes
  // compare vertically, block after block; the rows' horizontal reductions wait for the end.
  struct Lanes {
    TileVector<float> best;
    TileVector<int32_t> index;
  };
  std::vector<Lanes> lanes(threads);
  const int64_t parts = split_table(pool, N, [&](int64_t part, int64_t n_begin, int64_t n_end) {
    Lanes& own = lanes[part];
    own.best.assign(M * 32, -INFINITY);
    own.index.assign(M * 32, static_cast<int32_t>(n_begin));
    transposed_rows(x, w, M, K, n_begin, n_end,
                    [&](const TransposedBlock& block, int64_t n0, int64_t rows, int64_t m0, int64_t rows_m) {
                      for (int64_t m = 0; m < rows_m; ++m)
                        for (int64_t half = 0; half < 2 && 16 * half < rows; ++half) {
                          float* best = own.best.data() + (m0 + m) * 32 + 16 * half;
                          int32_t* index = own.index.data() + (m0 + m) * 32 + 16 * half;
                          keep_lane_best(best, index, block_column(block, m, half), block_lanes(rows, half),
                                         static_cast<int32_t>(n0 + 16 * half));
                        }
                    });
  });
  // (A lane that never beat -inf keeps its thread's first row; that matters only when the row's maximum is
  // -inf, and then row 0, thread 0's, is the first.)
  first_maximum_of_lanes(
      parts, M, 32, [&](int64_t part, int64_t m, int64_t l) { return lanes[part].best[m * 32 + l]; },
      [&](int64_t part, int64_t m, int64_t l) { return lanes[part].index[m * 32 + l]; }, tokens);
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

bool Matmul(xla::ffi::ThreadPool&, const uint16_t*, const uint16_t*, float*, int64_t, int64_t, int64_t) {
  return false;
}

bool MatmulPacked(xla::ffi::ThreadPool&, const uint16_t*, const uint16_t*, float*, int64_t, int64_t, int64_t) {
  return false;
}

bool GatedMatmulPacked(xla::ffi::ThreadPool&, const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t,
                       int64_t, int64_t) {
  return false;
}

bool MatmulPackedRounded(xla::ffi::ThreadPool&, const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, float*,
                         int64_t, int64_t, int64_t) {
  return false;
}

#endif

}  // namespace paged::amx
