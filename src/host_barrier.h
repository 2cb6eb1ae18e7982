// Rounds of an exchange among the R threads of a CPU group, by value, with bounded waits (docs/design.md §4):
// in each round every rank posts one value, and once all R have posted each rank reads the round's posts.
//
// The exchange counts ranks, not arrivals: a rank arriving twice in one round (one rank driven from two
// threads), a rank out of range, or ranks arriving at rounds of different phases (a thread one step ahead of
// its peers) break the exchange with an error on every thread involved instead of pairing the wrong threads.
// A wait that times out breaks it too, naming the ranks that never arrived. A broken exchange fails every
// later round at once (the group must be recreated): a rank that stopped and comes back cannot resume.
// A rank whose call failed on its own may leave() its post without waiting: the peers read it when the
// round completes, and the rank's next arrival first waits for that round.
//
// The posts of round n stay readable until every rank has read them: the open round's posts go to other
// slots, and round n + 1 cannot complete before all R ranks took round n (a rank cannot arrive at round
// n + 1 before leaving round n, so the only way is a second thread posing as a rank, which breaks it).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace pounce {

// The rank bookkeeping of HostExchange, whatever it carries. Every method runs with `mutex` held.
class HostRounds {
 public:
  explicit HostRounds(int num_ranks);
  int num_ranks() const { return num_ranks_; }
  uint64_t open_round() const { return completed_ + 1; }  // rounds count from 1, the same on every rank

  // Accepts `rank`'s arrival at the open round (a round of `phase`); true when it completes the round, after
  // which the caller moves the round's posts aside and calls complete(). Throws, breaking the rounds when
  // the arrival itself is the fault, on a rank out of range, a second arrival of one rank, a phase other
  // than the round's, and when the rounds were broken before. A rank that left the open round (leave())
  // and arrives again first waits, within `timeout`, for that round to complete: it is the rank's next call.
  bool arrive(std::unique_lock<std::mutex>& lock, int rank, const char* phase, const std::string& what,
              std::chrono::milliseconds timeout, bool leaving);
  // The last arrival closes the round; throws (breaking) if a rank has not yet taken the previous round.
  void check_previous_taken(int rank, const std::string& what);
  void complete();
  // Waits until `round` completed; throws naming the missing ranks after `timeout`, or when broken.
  void wait(std::unique_lock<std::mutex>& lock, uint64_t round, int rank, const std::string& what,
            std::chrono::milliseconds timeout);
  void taken() { --takers_left_; }

  std::mutex mutex;
  std::condition_variable changed;

 private:
  [[noreturn]] void break_and_fail(const std::string& reason);

  const int num_ranks_;
  uint64_t completed_ = 0;     // rounds completed
  std::vector<bool> arrived_;  // [R] in the open round
  std::vector<bool> left_;     // [R] arrived in the open round without waiting for it (leave())
  int num_arrived_ = 0;        // of the open round
  int num_left_ = 0;           // of the open round
  std::string phase_;          // of the open round, set by its first arrival
  int takers_left_ = 0;        // ranks that have not yet read the last completed round
  std::string broken_;         // why the rounds are broken ("" = usable)
};

template <typename Post>
class HostExchange {
 public:
  explicit HostExchange(int num_ranks) : rounds_(num_ranks), open_(num_ranks), closed_(num_ranks) {}

  // Posts `post` as `rank`'s value in the open round (named `phase`: every rank must be at the same phase),
  // waits until every rank posted, then runs take(posts) with the round's R posts (take may move out of
  // its own rank's share and read the others'; it runs under the exchange's lock, so keep it to copies).
  // Returns the round's number, the same on every rank. `what` names the wait in errors.
  template <typename Take>
  uint64_t exchange(int rank, const char* phase, const std::string& what, std::chrono::milliseconds timeout,
                    Post post, Take&& take) {
    std::unique_lock lock(rounds_.mutex);
    const uint64_t round = post_locked(lock, rank, phase, what, timeout, std::move(post), false);
    if (rounds_.open_round() == round) rounds_.wait(lock, round, rank, what, timeout);
    take(closed_);
    rounds_.taken();
    return round;
  }

  // Posts `post` without waiting for the round: a rank whose call already failed on its own tells its
  // peers why (they read the post when the round completes) and returns at once.
  void leave(int rank, const char* phase, const std::string& what, std::chrono::milliseconds timeout,
             Post post) {
    std::unique_lock lock(rounds_.mutex);
    post_locked(lock, rank, phase, what, timeout, std::move(post), true);
  }

 private:
  uint64_t post_locked(std::unique_lock<std::mutex>& lock, int rank, const char* phase,
                       const std::string& what, std::chrono::milliseconds timeout, Post post, bool leaving) {
    const bool last = rounds_.arrive(lock, rank, phase, what, timeout, leaving);
    const uint64_t round = rounds_.open_round();
    open_[rank] = std::move(post);
    if (last) {
      rounds_.check_previous_taken(rank, what);
      closed_.swap(open_);
      for (Post& stale : open_) stale = Post{};
      rounds_.complete();
    }
    return round;
  }

  HostRounds rounds_;
  std::vector<Post> open_;    // [R] posts of the open round
  std::vector<Post> closed_;  // [R] posts of the last completed round
};

}  // namespace pounce
