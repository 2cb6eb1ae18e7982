// HostExchange (src/host_barrier.h), the CPU group's rendezvous: posts travel by value and every rank reads
// all of them; it counts ranks, not arrivals; every wait is bounded; once broken it stays broken.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "pounce/error.h"
#include "src/host_barrier.h"

namespace pounce {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// Runs body(thread) on `n` threads; returns each one's error ("" = none).
std::vector<std::string> on_threads(int n, const std::function<void(int)>& body) {
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t)
    threads.emplace_back([&, t] {
      try {
        body(t);
      } catch (const std::exception& error) {
        errors[t] = error.what();
      }
    });
  for (auto& thread : threads) thread.join();
  return errors;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Posts are `rank * 1000 + step`: every rank reads every rank's post of the same step, and all agree on the
// round's number, over many rounds of alternating phases.
TEST(HostExchange, EveryRankReadsEveryPostOfTheRound) {
  const int R = 4, kSteps = 200;
  HostExchange<int> exchange(R);
  std::vector<std::vector<uint64_t>> rounds(R);
  auto errors = on_threads(R, [&](int rank) {
    for (int step = 0; step < kSteps; ++step) {
      std::vector<int> seen;
      rounds[rank].push_back(exchange.exchange(rank, step % 2 ? "odd" : "even", "step", milliseconds(5000),
                                               rank * 1000 + step,
                                               [&](std::vector<int>& posts) { seen = posts; }));
      for (int peer = 0; peer < R; ++peer) ASSERT_EQ(seen[peer], peer * 1000 + step) << "rank " << rank;
    }
  });
  for (const auto& error : errors) EXPECT_EQ(error, "");
  for (int rank = 1; rank < R; ++rank) EXPECT_EQ(rounds[rank], rounds[0]);
  EXPECT_EQ(rounds[0].front(), 1u);
  EXPECT_EQ(rounds[0].back(), static_cast<uint64_t>(kSteps));
}

TEST(HostExchange, RankArrivingTwiceBreaksTheRoundForEveryone) {
  HostExchange<int> exchange(2);
  const auto start = Clock::now();
  auto errors =
      on_threads(2, [&](int) { exchange.exchange(0, "p", "step", milliseconds(10'000), 0, [](auto&) {}); });
  EXPECT_LT(seconds_since(start), 2.0) << "the duplicate must fail at once, not at the timeout";
  int twice = 0;
  for (const auto& error : errors) {
    EXPECT_NE(error, "");
    twice += error.find("rank 0 arrived twice at 'step': one rank is driven from two threads") !=
             std::string::npos;
  }
  EXPECT_EQ(twice, 2) << errors[0] << "\n" << errors[1];
  // Broken for good: the next round fails at once, saying why.
  try {
    exchange.exchange(1, "p", "later", milliseconds(10'000), 0, [](auto&) {});
    FAIL() << "a broken exchange accepted a round";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("unusable since rank 0 arrived twice"), std::string::npos)
        << error.what();
  }
}

TEST(HostExchange, RankOutOfRangeIsAnError) {
  HostExchange<int> exchange(2);
  EXPECT_THROW(exchange.exchange(2, "p", "step", milliseconds(100), 0, [](auto&) {}), Error);
  EXPECT_THROW(exchange.exchange(-1, "p", "step", milliseconds(100), 0, [](auto&) {}), Error);
}

TEST(HostExchange, RanksAtDifferentPhasesFailTogether) {
  HostExchange<int> exchange(2);
  auto errors = on_threads(2, [&](int rank) {
    if (rank == 1) std::this_thread::sleep_for(milliseconds(50));  // rank 0 opens the round
    exchange.exchange(rank, rank == 0 ? "arguments" : "results",
                      rank == 0 ? "forward: arguments" : "forward: results", milliseconds(10'000), rank,
                      [](auto&) {});
  });
  EXPECT_NE(errors[1].find(
                "rank 1 arrived at 'forward: results' while rank(s) 0 wait at a step of phase 'arguments'"),
            std::string::npos)
      << errors[1];
  EXPECT_NE(errors[0].find("rank 1 arrived at 'forward: results'"), std::string::npos) << errors[0];
}

// A peer that never arrives: the waiting rank fails after the timeout (not much later), naming the wait and
// the missing ranks; then the exchange is broken and a late arrival fails at once.
TEST(HostExchange, MissingPeerTimesOutNamingItThenTheExchangeStaysBroken) {
  HostExchange<int> exchange(3);
  const auto start = Clock::now();
  auto errors = on_threads(2, [&](int rank) {
    exchange.exchange(rank, "p", "backward: arguments", milliseconds(300), 0, [](auto&) {});
  });
  const double waited = seconds_since(start);
  EXPECT_GE(waited, 0.29);
  EXPECT_LT(waited, 1.3);
  bool named = false;
  for (const auto& error : errors) {
    EXPECT_NE(error, "");
    named |= error.find("waited 300 ms at 'backward: arguments' but rank(s) 2 of 3 never arrived") !=
             std::string::npos;
  }
  EXPECT_TRUE(named) << errors[0] << "\n" << errors[1];
  const auto late = Clock::now();
  EXPECT_THROW(exchange.exchange(2, "p", "forward: arguments", milliseconds(10'000), 0, [](auto&) {}), Error);
  EXPECT_LT(seconds_since(late), 0.1);
}

// A rank whose call failed on its own leaves its post and returns at once; the peer reads it when it
// arrives; the leaving rank's next call waits for that round and meets the peer's next call.
TEST(HostExchange, LeavingRankIsReadByItsPeerAndJoinsTheNextRound) {
  HostExchange<int> exchange(2);
  std::vector<int> seen_by_0, seen_by_1;
  auto errors = on_threads(2, [&](int rank) {
    if (rank == 1) {
      const auto start = Clock::now();
      exchange.leave(1, "p", "first", milliseconds(5000), 41);
      EXPECT_LT(seconds_since(start), 0.05) << "leave must not wait";
      exchange.exchange(1, "p", "second", milliseconds(5000), 42,
                        [&](std::vector<int>& posts) { seen_by_1 = posts; });
      return;
    }
    std::this_thread::sleep_for(milliseconds(100));  // rank 1 left and is waiting with its next call
    std::vector<int> first;
    EXPECT_EQ(exchange.exchange(0, "p", "first", milliseconds(5000), 10,
                                [&](std::vector<int>& posts) { first = posts; }),
              1u);
    EXPECT_EQ(first, (std::vector<int>{10, 41}));
    EXPECT_EQ(exchange.exchange(0, "p", "second", milliseconds(5000), 20,
                                [&](std::vector<int>& posts) { seen_by_0 = posts; }),
              2u);
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_EQ(seen_by_0, (std::vector<int>{20, 42}));
  EXPECT_EQ(seen_by_1, (std::vector<int>{20, 42}));
}

// The leaving rank calls again but its peer never comes: the wait for the earlier round is bounded too.
TEST(HostExchange, LeavingRankWhosePeerNeverComesTimesOut) {
  HostExchange<int> exchange(2);
  exchange.leave(1, "p", "first", milliseconds(200), 1);
  const auto start = Clock::now();
  EXPECT_THROW(exchange.exchange(1, "p", "second", milliseconds(200), 2, [](auto&) {}), Error);
  EXPECT_LT(seconds_since(start), 1.0);
}

// POUNCE_PEER_TIMEOUT_S = 1e12 must not overflow the clock into an immediate timeout.
TEST(HostExchange, HugeTimeoutWaitsForTheLatePeer) {
  HostExchange<int> exchange(2);
  auto errors = on_threads(2, [&](int rank) {
    if (rank == 1) std::this_thread::sleep_for(milliseconds(100));
    exchange.exchange(rank, "p", "step", milliseconds::max(), rank, [](auto&) {});
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

}  // namespace
}  // namespace pounce
