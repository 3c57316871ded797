// The int4 contract's group sums of x (kvboost_kernels.h), one plain function for every ISA path, so that
// they cannot differ between paths: compiled without an ISA target, like the scalar path.
#include <algorithm>

#include "kvboost_kernels.h"

void kvb_group_sums(const float* x, int64_t m, int64_t k, int64_t group, float* xs) {
  // x is [m, k] contiguous and group divides k, so span s (row s / groups, group s % groups) is x[s * group ..]
  const int64_t spans = m * (k / group);
  int64_t s = 0;
  for (; s + 8 <= spans; s += 8) {  // eight independent in-order chains at once: the same sums, sooner
    float t[8] = {};
    for (int64_t i = 0; i < group; ++i)
      for (int j = 0; j < 8; ++j) t[j] = t[j] + x[(s + j) * group + i];
    std::copy(t, t + 8, xs + s);
  }
  for (; s < spans; ++s) {
    float t = 0.0f;
    for (int64_t i = 0; i < group; ++i) t = t + x[s * group + i];
    xs[s] = t;
  }
}
