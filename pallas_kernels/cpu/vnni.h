// vpdpbusd for the native CPU kernels (int8_matmul.cc, head_screen.cc), as an asm statement.
//
// Why not the intrinsic: GCC 12 keeps _mm512_dpbusd_epi32's accumulators badly in register-blocked loops. In
// the integer matmul's 6 x 4 tile it sent them to the stack and back around every instruction (58 stack moves
// for 24 products a step), and the tile ran at 170 of the instruction's ~400 GOPS a core on the EPYC machine.
// Written as an asm statement with the accumulator an in-out register operand, every accumulator stays in its
// register and the same tile runs at 386.
#pragma once

#if defined(__AVX512VNNI__)
#include <immintrin.h>

namespace paged {

// acc + in each 32-bit lane the four products of `u`'s bytes (unsigned) and `s`'s (signed) in that lane.
inline __m512i dot_bytes(__m512i acc, __m512i u, __m512i s) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}

}  // namespace paged

#endif
