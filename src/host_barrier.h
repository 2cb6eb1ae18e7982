// A reusable barrier for the R threads of a CPU group whose wait is bounded: a peer that never arrives
// ends the call with an error naming the wait instead of hanging the process (docs/design.md §4).
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>

namespace pounce {

class HostBarrier {
 public:
  explicit HostBarrier(int num_threads) : num_threads_(num_threads) {}

  // Returns when all threads arrived; throws pounce::Error naming `what` after `timeout`. Once a wait
  // timed out the barrier stays broken: every later wait fails at once (the group must be recreated).
  void arrive_and_wait(const std::string& what, int rank, std::chrono::milliseconds timeout);

 private:
  std::mutex mutex_;
  std::condition_variable arrived_;
  const int num_threads_;
  int num_waiting_ = 0;
  unsigned generation_ = 0;
  bool broken_ = false;
};

}  // namespace pounce
