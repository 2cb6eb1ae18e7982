// Small host helpers of the CLI: a parallel loop over independent tasks and the median of timings.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace pounce::cli {

inline int default_num_threads() {
  return std::max(1u, std::thread::hardware_concurrency());
}

// Calls task(i) for every i in [0, num_tasks) on up to `num_threads` threads (0 = all cores). Tasks are
// handed out by an atomic ticket; the first exception stops the hand-out and is rethrown here.
template <typename Task>
void parallel_for(int64_t num_tasks, int num_threads, Task&& task) {
  if (num_threads <= 0) num_threads = default_num_threads();
  const int64_t workers = std::min<int64_t>(num_threads, num_tasks);
  if (workers <= 1) {
    for (int64_t i = 0; i < num_tasks; ++i) task(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto work = [&] {
    for (int64_t i = next.fetch_add(1); i < num_tasks; i = next.fetch_add(1)) {
      try {
        task(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        next.store(num_tasks);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int64_t w = 1; w < workers; ++w) threads.emplace_back(work);
  work();
  for (std::thread& thread : threads) thread.join();
  if (error) std::rethrow_exception(error);
}

// Median of `values` (mean of the two middle ones for an even count); 0 for none.
inline double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

// Median of the later half of `values` in run order (from index size / 2 on; all of one value): the speed a
// GPU settles at once the power limiter has pulled its clock down, which takes a few runs (docs/design.md,
// "Power"); 0 for none.
inline double late_half_median(const std::vector<double>& values) {
  return median(
      std::vector<double>(values.begin() + static_cast<std::ptrdiff_t>(values.size() / 2), values.end()));
}

}  // namespace pounce::cli
