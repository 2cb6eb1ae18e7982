// A deterministic parallel loop for the CPU reference.
//
// Tasks are handed out by an atomic ticket; the caller makes every task write outputs no other task
// writes, with a fixed order inside the task, so results never depend on the thread count or on which
// thread ran which task.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace pounce::reference {

inline int resolve_num_threads(int num_threads) {
  if (num_threads > 0) return num_threads;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

// Calls fn(task) once for every task in [0, num_tasks) on up to num_threads threads (0 = hardware
// concurrency). The first exception thrown by a task is rethrown on the calling thread.
template <typename Fn>
void parallel_for(int64_t num_tasks, int num_threads, const Fn& fn) {
  const int64_t num_workers = std::min<int64_t>(num_tasks, resolve_num_threads(num_threads));
  if (num_workers <= 1) {
    for (int64_t task = 0; task < num_tasks; ++task) fn(task);
    return;
  }
  std::atomic<int64_t> next_task{0};
  std::exception_ptr first_error;
  std::mutex error_mutex;
  auto worker = [&] {
    try {
      for (int64_t task = next_task.fetch_add(1); task < num_tasks; task = next_task.fetch_add(1)) fn(task);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!first_error) first_error = std::current_exception();
      next_task.store(num_tasks);  // the others finish their current task and stop
    }
  };
  std::vector<std::thread> threads;
  for (int64_t w = 1; w < num_workers; ++w) threads.emplace_back(worker);
  worker();
  for (std::thread& thread : threads) thread.join();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace pounce::reference
