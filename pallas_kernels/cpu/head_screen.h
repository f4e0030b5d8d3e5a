// The greedy tied LM head through an int8 screen of its table (head_screen.cc): the screen's layout, its
// builder, and the screened argmax, on AMX-INT8 tiles or, on CPUs without them, AVX-512 VNNI.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace paged::screen {

// The int8 screen of a tied LM head's table (built at load by pallas_kernels/cpu/screen.py: greedy_screen).
struct ScreenTable {
  const int8_t* codes;   // [padded_rows / 32][ceil(K / 64)][2][16][16][4]: byte (b, s, h, q, j, e) is the code
                         // of w[32 b + 16 h + j, 64 s + 4 q + e] (AMX-INT8's B tiles, and VNNI's lanes)
  const float* stats;    // [3][padded_rows]: sigma_n (codes * sigma_n ~ w_n), ||w^_n||, ||w_n - w^_n|| +
                         // gamma_K ||w_n|| (the last two rounded up); zeros past `rows`
  int64_t rows;          // N, the table's rows
  int64_t padded_rows;   // N rounded up to 32
  float norm_max;        // the largest ||w_n||, rounded up
  float peak;            // the largest |w|
};

// Whether ScreenedArgmax runs here: AMX-INT8 tiles the OS grants, or a build with AVX-512 VNNI and BF16.
bool Available();

// The screen of w [N, K] bfloat16 into codes (ScreenTable's order), stats and limits [2] (norm_max, peak), on
// any CPU. False: w is not finite (no screen bounds it; the outputs are then partly written).
bool BuildScreen(xla::ffi::ThreadPool& pool, const uint16_t* w, int64_t N, int64_t K, int8_t* codes, float* stats,
                 float* limits);

// The fused greedy head's tokens for w [table.rows, K] (amx.h or transposed.h: MatmulTransposedArgmax, whichever
// this CPU runs; the same first maximum of the same float32 sums), reading the int8 screen and then only the
// rows that could hold a maximum (or, where the screen cannot decide, the whole table). False: not Available(),
// or K is not a multiple of 32.
bool ScreenedArgmax(xla::ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* w, const ScreenTable& table,
                    int32_t* tokens, int64_t M, int64_t K);

}  // namespace paged::screen
