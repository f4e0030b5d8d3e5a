// The last step of the fused greedy LM heads (amx.cc, transposed.cc): each thread kept, per row of x and per
// lane, the best value its run of the table gave (a NaN counted as +inf) and the first table row that gave it.
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

namespace paged {

// tokens[m] = the least index among the lanes that hold row m's greatest value, over `parts` threads' records
// of `lanes` lanes a row: best(part, m, l) and index(part, m, l). An index of INT32_MAX marks a lane that never
// saw a value (it takes no part).
template <typename Best, typename Index>
void first_maximum_of_lanes(int64_t parts, int64_t M, int64_t lanes, const Best& best, const Index& index,
                            int32_t* tokens) {
  for (int64_t m = 0; m < M; ++m) {
    float top = -INFINITY;
    for (int64_t part = 0; part < parts; ++part)
      for (int64_t l = 0; l < lanes; ++l)
        if (index(part, m, l) != INT32_MAX) top = std::max(top, best(part, m, l));
    int32_t first = INT32_MAX;
    for (int64_t part = 0; part < parts; ++part)
      for (int64_t l = 0; l < lanes; ++l)
        if (index(part, m, l) != INT32_MAX && best(part, m, l) == top) first = std::min(first, index(part, m, l));
    tokens[m] = first;
  }
}

}  // namespace paged
