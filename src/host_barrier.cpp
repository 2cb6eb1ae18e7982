#include "src/host_barrier.h"

#include <algorithm>

#include "pounce/error.h"

namespace pounce {
namespace {

std::string rank_list(const std::vector<bool>& arrived, bool value) {
  std::string out;
  for (size_t rank = 0; rank < arrived.size(); ++rank)
    if (arrived[rank] == value) out += (out.empty() ? "" : ", ") + std::to_string(rank);
  return out;
}

// condition_variable::wait_for adds the timeout to the clock: a huge one (POUNCE_PEER_TIMEOUT_S = 1e12)
// would overflow into the past and time out at once.
constexpr std::chrono::milliseconds kLongestWait = std::chrono::hours(24 * 365 * 100);

}  // namespace

HostRounds::HostRounds(int num_ranks)
    : num_ranks_(num_ranks), arrived_(num_ranks, false), left_(num_ranks, false) {}

void HostRounds::break_and_fail(const std::string& reason) {
  broken_ = reason;
  changed.notify_all();
  throw Error(reason);
}

bool HostRounds::arrive(std::unique_lock<std::mutex>& lock, int rank, const char* phase,
                        const std::string& what, std::chrono::milliseconds timeout, bool leaving) {
  POUNCE_CHECK(broken_.empty(), "rank ", rank, " cannot start '", what, "': this group is unusable since ",
               broken_, " (create a new group and its workspaces)");
  if (rank < 0 || rank >= num_ranks_)
    break_and_fail("rank " + std::to_string(rank) + " arrived at '" + what + "' but the group has ranks 0.." +
                   std::to_string(num_ranks_ - 1));
  if (arrived_[rank] && left_[rank]) {
    wait(lock, open_round(), rank, what, timeout);  // the rank's previous call must first meet its peers
    POUNCE_CHECK(broken_.empty(), "rank ", rank, " cannot start '", what, "': this group is unusable since ",
                 broken_, " (create a new group and its workspaces)");
  }
  if (arrived_[rank])
    break_and_fail("rank " + std::to_string(rank) + " arrived twice at '" + what +
                   "': one rank is driven from two threads; call each rank from its own thread only");
  if (num_arrived_ > 0 && phase_ != phase)
    break_and_fail("rank " + std::to_string(rank) + " arrived at '" + what + "' while rank(s) " +
                   rank_list(arrived_, true) + " wait at a step of phase '" + phase_ +
                   "': the group's threads are out of step (a rank driven from two threads?)");
  if (num_arrived_ == 0) phase_ = phase;
  arrived_[rank] = true;
  left_[rank] = leaving;
  num_left_ += leaving;
  return ++num_arrived_ == num_ranks_;
}

void HostRounds::check_previous_taken(int rank, const std::string& what) {
  if (takers_left_ != 0)
    break_and_fail("rank " + std::to_string(rank) + " completed '" + what + "' while " +
                   std::to_string(takers_left_) +
                   " rank(s) had not left the previous step: one rank is driven from two threads");
}

void HostRounds::complete() {
  ++completed_;
  std::fill(arrived_.begin(), arrived_.end(), false);
  std::fill(left_.begin(), left_.end(), false);
  takers_left_ = num_ranks_ - num_left_;
  num_arrived_ = 0;
  num_left_ = 0;
  phase_.clear();
  changed.notify_all();
}

void HostRounds::wait(std::unique_lock<std::mutex>& lock, uint64_t round, int rank, const std::string& what,
                      std::chrono::milliseconds timeout) {
  const auto bounded = std::min(timeout, kLongestWait);
  if (!changed.wait_for(lock, bounded, [&] { return completed_ >= round || !broken_.empty(); }))
    break_and_fail("rank " + std::to_string(rank) + " waited " + std::to_string(timeout.count()) +
                   " ms at '" + what + "' but rank(s) " + rank_list(arrived_, false) + " of " +
                   std::to_string(num_ranks_) +
                   " never arrived: a peer never called (it stopped, crashed, or makes other calls); check "
                   "that every rank makes the same calls, or raise POUNCE_PEER_TIMEOUT_S");
  if (completed_ < round) detail::fail("rank ", rank, " left '", what, "' unfinished: ", broken_);
}

}  // namespace pounce
