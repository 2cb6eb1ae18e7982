#include "src/host_barrier.h"

#include "pounce/error.h"

namespace pounce {

void HostBarrier::arrive_and_wait(const std::string& what, int rank, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  POUNCE_CHECK(!broken_, "rank ", rank, " cannot wait at '", what,
               "': an earlier wait of this group timed out; create a new group");
  const unsigned my_generation = generation_;
  if (++num_waiting_ == num_threads_) {
    num_waiting_ = 0;
    ++generation_;
    arrived_.notify_all();
    return;
  }
  if (!arrived_.wait_for(lock, timeout, [&] { return generation_ != my_generation || broken_; })) {
    const int arrived = num_waiting_;
    broken_ = true;
    arrived_.notify_all();
    detail::fail("rank ", rank, " waited ", timeout.count(), " ms at '", what, "' but only ", arrived, " of ",
                 num_threads_, " ranks arrived: a peer never called (or crashed); check that every rank ",
                 "makes the same calls, or raise POUNCE_PEER_TIMEOUT_S");
  }
  POUNCE_CHECK(!broken_ || generation_ != my_generation, "rank ", rank, " left '", what,
               "': a peer timed out at this barrier; create a new group");
}

}  // namespace pounce
