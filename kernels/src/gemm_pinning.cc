// The order in which a loaded Bf16Gemm tries its loaded algorithms for a call: host arithmetic,
// built with and without CUDA.
#include <algorithm>
#include <numeric>

#include "ulysses/kernels/gemm.h"

namespace ulysses::kernels {

std::vector<size_t> PinnedTryOrder(const std::vector<int64_t>& loaded_rows, int64_t m) {
  std::vector<size_t> order(loaded_rows.size());
  std::iota(order.begin(), order.end(), size_t{0});
  // Not below m first, fewest rows first; then below m, most rows first. Stable: equal row
  // counts keep their load order.
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const int64_t ra = loaded_rows[a], rb = loaded_rows[b];
    const bool a_up = ra >= m, b_up = rb >= m;
    if (a_up != b_up) return a_up;
    return a_up ? ra < rb : ra > rb;
  });
  return order;
}

}  // namespace ulysses::kernels
