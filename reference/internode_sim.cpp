// The discrete-event simulation of reference/internode_sim.h. Four phases in time order, each resource a
// FIFO calendar of busy spans, so a later phase's transfers fill the gaps an earlier one left on a shared
// link (the NIC carries dispatch puts and combine partials in both directions at once).
#include "reference/internode_sim.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <queue>
#include <sstream>
#include <tuple>

#include "pounce/error.h"

namespace pounce::reference {
namespace {

constexpr double kNever = std::numeric_limits<double>::infinity();
constexpr size_t kMaxErrors = 10;

// Busy spans of one resource: start -> end, disjoint, merged where they touch. Spans are only ever added,
// so a gap too short for a duration stays too short: each duration remembers the range [lo, hi) it is known
// not to fit in, and later searches from inside that range start at its end (else a nearly full link's many
// small gaps make every search walk them all).
class Calendar {
 public:
  // The earliest t >= ready with [t, t + duration) free.
  double earliest(double ready, double duration) {
    NoFit& known = no_fit_[duration];
    const bool inside = known.lo <= ready && ready < known.hi;
    double t = inside ? known.hi : ready;
    auto it = busy_.upper_bound(t);
    if (it != busy_.begin()) {
      auto prev = std::prev(it);
      if (prev->second > t) t = prev->second;
    }
    while (it != busy_.end() && it->first < t + duration) {
      t = std::max(t, it->second);
      ++it;
    }
    // No fit starts in [ready, t): extend the known range where it meets, else keep the newer one.
    if (inside) {
      known.hi = t;
    } else if (ready < known.lo && t >= known.lo) {
      known.lo = ready;
      known.hi = std::max(known.hi, t);
    } else {
      known.lo = ready;
      known.hi = t;
    }
    return t;
  }
  // Takes [t, t + duration), a span earliest() returned: nothing of that duration fits there any more.
  void take(double t, double duration) {
    insert(t, t + duration);
    NoFit& known = no_fit_[duration];
    if (known.lo <= t && t <= known.hi) known.hi = std::max(known.hi, t + duration);
  }
  void insert(double start, double end) {
    if (end <= start) return;
    auto it = busy_.lower_bound(start);
    if (it != busy_.begin()) {
      auto prev = std::prev(it);
      if (prev->second >= start) {
        start = prev->first;
        end = std::max(end, prev->second);
        busy_.erase(prev);
      }
    }
    while (it != busy_.end() && it->first <= end) {
      end = std::max(end, it->second);
      it = busy_.erase(it);
    }
    busy_[start] = end;
  }
  double reserve(double ready, double duration) {
    const double t = earliest(ready, duration);
    take(t, duration);
    return t;
  }

 private:
  struct NoFit {
    double lo = 0, hi = 0;
  };
  std::map<double, double> busy_;
  std::map<double, NoFit> no_fit_;  // per duration
};

// A span free on both calendars (a NIC put: the sender's out and the receiver's in).
double reserve_both(Calendar& a, Calendar& b, double ready, double duration) {
  double t = ready;
  for (;;) {
    const double ta = a.earliest(t, duration);
    const double tb = b.earliest(ta, duration);
    if (tb == ta) {
      a.take(ta, duration);
      b.take(ta, duration);
      return ta;
    }
    t = tb;
  }
}

double transfer_us(double bytes, double gbps) {
  return gbps > 0 ? bytes / (gbps * 1e3) : 0.0;
}

struct Sim {
  const Problem& problem;
  const std::vector<RankInputs>& inputs;
  const SimConfig& config;
  int64_t R, G, N, El, k;
  SimResult result;

  Sim(const Problem& p, const std::vector<RankInputs>& in, const SimConfig& c)
      : problem(p),
        inputs(in),
        config(c),
        R(p.num_ranks),
        G(c.gpus_per_node),
        N(0),
        El(p.num_local_experts()),
        k(p.num_topk) {
    N = (R + G - 1) / G;
  }

  int64_t node_of_rank(int64_t r) const { return r / G; }
  int64_t node_of_expert(int64_t e) const { return node_of_rank(e / El); }
  int64_t relay(int64_t node, int64_t src) const { return node * G + src % G; }

  template <typename... Parts>
  void error(const Parts&... parts) {
    result.ok = false;
    if (result.errors.size() >= kMaxErrors) return;
    std::ostringstream out;
    (out << ... << parts);
    result.errors.push_back(out.str());
  }
};

}  // namespace

SimResult simulate_pass(const Problem& problem, const std::vector<RankInputs>& inputs,
                        const SimConfig& config) {
  POUNCE_CHECK(config.gpus_per_node >= 1, "SimConfig::gpus_per_node = ", config.gpus_per_node,
               " must be >= 1");
  POUNCE_CHECK(problem.num_ranks <= config.gpus_per_node || problem.num_ranks % config.gpus_per_node == 0,
               "num_ranks = ", problem.num_ranks,
               " must be a multiple of gpus_per_node = ", config.gpus_per_node);
  POUNCE_CHECK(config.compute_sms >= 1 && config.comm_sms >= 1, "SimConfig needs compute and comm SMs");
  POUNCE_CHECK(config.minibatch_m_blocks >= 1, "SimConfig::minibatch_m_blocks must be >= 1");
  POUNCE_CHECK(static_cast<int64_t>(inputs.size()) == problem.num_ranks, "inputs hold ", inputs.size(),
               " ranks, the problem ", problem.num_ranks);
  Sim sim(problem, inputs, config);
  const int64_t R = sim.R, N = sim.N, k = sim.k;
  SimResult& result = sim.result;
  result.ranks.assign(R, {});

  // ---- 1. counts: schedules, need order, expected puts -------------------------------------------------
  std::vector<RankSchedule> schedules(R);
  for (int64_t d = 0; d < R; ++d) schedules[d] = build_schedule(problem, inputs, d);

  // need[s][B][t]: the earliest schedule row (as a share of its rank's rows) where node B needs token t of
  // source s; kNever where it needs none. pair_seen counts each (s, t, j) over every schedule.
  std::vector<std::vector<std::vector<double>>> need(R);
  std::vector<std::vector<int32_t>> pair_seen(R);
  std::vector<std::vector<std::vector<int32_t>>> node_pairs(R);  // [s][B][t]: pairs of t on node B
  for (int64_t s = 0; s < R; ++s) {
    need[s].assign(N, std::vector<double>(inputs[s].num_tokens, kNever));
    node_pairs[s].assign(N, std::vector<int32_t>(inputs[s].num_tokens, 0));
    pair_seen[s].assign(inputs[s].num_tokens * k, 0);
  }
  for (int64_t d = 0; d < R; ++d) {
    const std::vector<ScheduleRow>& rows = schedules[d].rows;
    result.ranks[d].schedule_rows = static_cast<int64_t>(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      const ScheduleRow& row = rows[i];
      if (row.is_padding()) continue;
      pair_seen[row.src_rank][row.src_token * k + row.slot] += 1;
      const int64_t B = sim.node_of_rank(d);
      node_pairs[row.src_rank][B][row.src_token] += 1;
      if (B != sim.node_of_rank(row.src_rank)) {
        double& key = need[row.src_rank][B][row.src_token];
        key = std::min(key, static_cast<double>(i) / rows.size());
      }
    }
  }
  // Every routed pair in exactly one schedule; the distinct tokens per (source, node) from the routing alone.
  std::vector<std::vector<int64_t>> expected_puts(R, std::vector<int64_t>(N, 0));
  for (int64_t s = 0; s < R; ++s) {
    for (int64_t t = 0; t < inputs[s].num_tokens; ++t) {
      std::vector<bool> hit(N, false);
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = inputs[s].topk_idx[t * k + j];
        const int32_t seen = pair_seen[s][t * k + j];
        if (e < 0) {
          if (seen != 0)
            sim.error("rank ", s, " token ", t, " slot ", j, ": an unused slot is in a schedule");
          continue;
        }
        ++result.pairs;
        if (seen != 1) sim.error("rank ", s, " token ", t, " slot ", j, " is in ", seen, " schedules, not 1");
        const int64_t B = sim.node_of_expert(e);
        if (B != sim.node_of_rank(s)) {
          hit[B] = true;
          ++result.nic_pairs_without_dedup;
        }
      }
      for (int64_t B = 0; B < N; ++B) expected_puts[s][B] += hit[B] ? 1 : 0;
    }
  }

  // ---- 2. dispatch over the NIC ------------------------------------------------------------------------
  std::vector<Calendar> nic_out(R), nic_in(R);
  // land[s][B][t]: when relay (B, s % G) sees token t of s landed (its signal covers the put); kNever: not
  // put.
  std::vector<std::vector<std::vector<double>>> land(R);
  for (int64_t s = 0; s < R; ++s) land[s].assign(N, std::vector<double>(inputs[s].num_tokens, kNever));
  struct Put {
    double key;
    int64_t s, B, t;
  };
  std::vector<Put> puts;
  for (int64_t s = 0; s < R; ++s)
    for (int64_t B = 0; B < N; ++B)
      for (int64_t t = 0; t < inputs[s].num_tokens; ++t)
        if (need[s][B][t] < kNever) {
          const double order =
              config.puts_in_token_order ? static_cast<double>(t) / inputs[s].num_tokens : need[s][B][t];
          puts.push_back({order, s, B, t});
        }
  std::sort(puts.begin(), puts.end(), [](const Put& a, const Put& b) {
    return std::tie(a.key, a.s, a.B, a.t) < std::tie(b.key, b.s, b.B, b.t);
  });
  if (!puts.empty() && config.fault == SimConfig::Fault::kDropPut) puts.erase(puts.begin());
  if (!puts.empty() && config.fault == SimConfig::Fault::kDuplicatePut) puts.push_back(puts.front());
  const double put_us = transfer_us(config.nic_in_row_bytes, config.nic_gbps);
  // Per (source, relay) the puts' arrivals in issue order; GIN makes a signal visible only after the payloads
  // of this put and every earlier one on the context to that peer have settled: a running maximum.
  std::vector<std::vector<double>> settled(R, std::vector<double>(N, 0.0));
  std::vector<std::vector<int64_t>> signal(R, std::vector<int64_t>(N, 0));
  for (const Put& put : puts) {
    const int64_t r = sim.relay(put.B, put.s);
    const double start = reserve_both(nic_out[put.s], nic_in[r], config.prologue_us, put_us);
    const double arrival = start + put_us + config.nic_latency_us;
    settled[put.s][put.B] = std::max(settled[put.s][put.B], arrival);
    signal[put.s][put.B] += 1;
    // The relay's forwarding warp waits for the signal, then releases its landed counter to the node.
    land[put.s][put.B][put.t] = settled[put.s][put.B] + config.nvlink_latency_us;
    result.ranks[put.s].nic_puts_sent += 1;
    result.ranks[r].nic_puts_received += 1;
    ++result.nic_puts;
  }
  for (int64_t s = 0; s < R; ++s)
    for (int64_t B = 0; B < N; ++B)
      if (signal[s][B] != expected_puts[s][B])
        sim.error("relay ", sim.relay(B, s), ": signal of source ", s, " ends at ", signal[s][B],
                  ", the counts say ", expected_puts[s][B]);

  // ---- 3. per rank: pulls, tiles, the combine's first hop ----------------------------------------------
  const double nvlink_pull_gbps =
      std::min(config.nvlink_gbps, config.comm_sms * config.nvlink_per_comm_sm_gbps);
  const double local_gbps = config.comm_sms * config.local_per_comm_sm_gbps;
  const int64_t unit_rows = config.minibatch_m_blocks * problem.block_m;
  // Combine arrivals: at the owner per pair, at the relay per (source, node, token) the latest of its pairs.
  std::vector<std::vector<double>> pair_arrival(R);
  std::vector<std::vector<int32_t>> pair_delivered(R);
  std::vector<std::vector<std::vector<double>>> relay_ready(R);
  std::vector<std::vector<std::vector<int32_t>>> relay_count(R);
  for (int64_t s = 0; s < R; ++s) {
    pair_arrival[s].assign(inputs[s].num_tokens * k, 0.0);
    pair_delivered[s].assign(inputs[s].num_tokens * k, 0);
    relay_ready[s].assign(N, std::vector<double>(inputs[s].num_tokens, 0.0));
    relay_count[s].assign(N, std::vector<int32_t>(inputs[s].num_tokens, 0));
  }
  std::vector<double> last_tile(R, config.prologue_us);
  std::vector<Calendar> reducer(R);

  for (int64_t d = 0; d < R; ++d) {
    SimRankStats& stats = result.ranks[d];
    const std::vector<ScheduleRow>& rows = schedules[d].rows;
    const int64_t B = sim.node_of_rank(d);
    Calendar comm, nvlink_out;
    const int64_t num_units = (static_cast<int64_t>(rows.size()) + unit_rows - 1) / unit_rows;
    std::vector<double> rows_ready(num_units, config.prologue_us);

    // Pulls in schedule order, each from where its row is once it is there.
    std::vector<int32_t> pulled(rows.size(), 0);
    bool skipped = false;
    for (size_t i = 0; i < rows.size(); ++i) {
      const ScheduleRow& row = rows[i];
      if (row.is_padding()) continue;
      if (d == 0 && !skipped && config.fault == SimConfig::Fault::kSkipPull) {
        skipped = true;
        continue;
      }
      const int64_t s = row.src_rank;
      double available = config.prologue_us, gbps = local_gbps;
      if (s == d) {
        ++stats.local_rows;
      } else if (sim.node_of_rank(s) == B) {
        gbps = nvlink_pull_gbps;
        ++stats.nvlink_rows;
      } else {
        const int64_t r = sim.relay(B, s);
        available = land[s][B][row.src_token];
        if (available == kNever) {
          sim.error("rank ", d, " row ", i, " needs token ", row.src_token, " of rank ", s,
                    ", which was never put to relay ", r);
          available = config.prologue_us;
        }
        ++stats.relayed_rows;
        if (r != d) {
          available += config.nvlink_latency_us;  // the relay's landed counter, acquired over NVLink
          gbps = nvlink_pull_gbps;
          ++stats.nvlink_rows;
        } else {
          ++stats.local_rows;
        }
      }
      const double duration = transfer_us(config.in_row_bytes, gbps);
      const double start = comm.reserve(available, duration);
      rows_ready[i / unit_rows] = std::max(rows_ready[i / unit_rows], start + duration);
      ++stats.pulled_rows;
      ++pulled[i];
    }
    for (size_t i = 0; i < rows.size(); ++i)
      if (pulled[i] != (rows[i].is_padding() ? 0 : 1))
        sim.error("rank ", d, " schedule row ", i, " was pulled ", pulled[i], " times");

    // Tiles by ticket: the first free SM takes the next task, then waits for its inputs.
    std::priority_queue<double, std::vector<double>, std::greater<double>> sms;
    for (int i = 0; i < config.compute_sms; ++i) sms.push(config.prologue_us);
    double busy = 0, first = kNever, last = config.prologue_us;
    const auto run = [&](double ready, double duration) {
      const double free = sms.top();
      sms.pop();
      const double start = std::max(free, ready);
      const double end = start + duration;
      sms.push(end);
      busy += duration;
      first = std::min(first, start);
      last = std::max(last, end);
      return end;
    };
    for (int64_t i = 0; i < config.shared_tiles; ++i) run(config.prologue_us, config.shared_tile_us);
    const int64_t m_blocks = static_cast<int64_t>(rows.size()) / problem.block_m;
    std::vector<double> in_done(num_units, config.prologue_us), m_block_done(m_blocks, config.prologue_us);
    const auto unit_m_blocks = [&](int64_t u) {
      return std::pair<int64_t, int64_t>(u * config.minibatch_m_blocks,
                                         std::min(m_blocks, (u + 1) * config.minibatch_m_blocks));
    };
    const auto in_tiles = [&](int64_t u) {
      const auto [begin, end] = unit_m_blocks(u);
      for (int64_t m = begin; m < end; ++m)
        for (int64_t n = 0; n < config.in_tiles; ++n)
          in_done[u] = std::max(in_done[u], run(rows_ready[u], config.in_tile_us));
    };
    const auto out_tiles = [&](int64_t u) {
      const auto [begin, end] = unit_m_blocks(u);
      for (int64_t m = begin; m < end; ++m)
        for (int64_t n = 0; n < config.out_tiles; ++n)
          m_block_done[m] = std::max(m_block_done[m], run(in_done[u], config.out_tile_us));
    };
    for (int64_t u = 0; u < num_units; ++u) {  // GU(0), GU(1), DN(0), GU(2), DN(1), ...
      in_tiles(u);
      if (u >= 1) out_tiles(u - 1);
    }
    if (num_units > 0) out_tiles(num_units - 1);
    double all_in_done = config.prologue_us;
    for (double t : in_done) all_in_done = std::max(all_in_done, t);
    for (int64_t i = 0; i < config.tail_tiles; ++i) run(all_in_done, config.tail_tile_us);
    stats.first_tile_us = first == kNever ? config.prologue_us : first;
    stats.last_tile_us = last;
    stats.compute_busy_us = busy / config.compute_sms;
    last_tile[d] = last;

    // The combine's first hop: each row to its owner (same node) or to its token's relay (another node), by
    // the tile epilogue's stores (scatter) or by the communication CTAs once the minibatch is done (push).
    std::vector<double> unit_done(num_units, config.prologue_us);
    for (int64_t m = 0; m < m_blocks; ++m) {
      const int64_t u = m / config.minibatch_m_blocks;
      unit_done[u] = std::max(unit_done[u], m_block_done[m]);
    }
    const double store_us = transfer_us(config.out_row_bytes, config.nvlink_gbps);
    const double push_us = transfer_us(config.out_row_bytes, nvlink_pull_gbps);
    for (size_t i = 0; i < rows.size(); ++i) {
      const ScheduleRow& row = rows[i];
      if (row.is_padding()) continue;
      const int64_t s = row.src_rank, t = row.src_token;
      const bool same_node = sim.node_of_rank(s) == B;
      const int64_t dest = same_node ? s : sim.relay(B, s);
      const int64_t m = static_cast<int64_t>(i) / problem.block_m;
      double arrival = m_block_done[m];
      if (dest != d) {
        if (config.push_combine) {
          arrival = comm.reserve(unit_done[m / config.minibatch_m_blocks], push_us) + push_us;
        } else {
          arrival = nvlink_out.reserve(m_block_done[m], store_us) + store_us;
        }
        arrival += config.nvlink_latency_us;
      }
      pair_delivered[s][t * k + row.slot] += 1;
      if (same_node) {
        pair_arrival[s][t * k + row.slot] = arrival;
      } else {
        relay_ready[s][B][t] = std::max(relay_ready[s][B][t], arrival);
        relay_count[s][B][t] += 1;
      }
    }
  }
  for (int64_t s = 0; s < R; ++s)
    for (int64_t t = 0; t < inputs[s].num_tokens; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const bool routed = inputs[s].topk_idx[t * k + j] >= 0;
        if (pair_delivered[s][t * k + j] != (routed ? 1 : 0))
          sim.error("rank ", s, " token ", t, " slot ", j, ": the combine delivered it ",
                    pair_delivered[s][t * k + j], " times");
      }

  // ---- 4. partials: the relays' per-node sums back over the NIC -----------------------------------------
  struct Partial {
    double ready;
    int64_t s, B, t;
  };
  std::vector<Partial> partials;
  const double reduce_gbps = config.comm_sms * config.local_per_comm_sm_gbps;
  for (int64_t s = 0; s < R; ++s)
    for (int64_t B = 0; B < N; ++B)
      for (int64_t t = 0; t < inputs[s].num_tokens; ++t) {
        const int32_t count = relay_count[s][B][t];
        if (B == sim.node_of_rank(s)) continue;
        if (count != node_pairs[s][B][t])
          sim.error("relay ", sim.relay(B, s), " holds ", count, " of the ", node_pairs[s][B][t],
                    " pairs of token ", t, " of rank ", s);
        if (count == 0) continue;
        if (land[s][B][t] == kNever)
          sim.error("token ", t, " of rank ", s, " has pairs on node ", B, " but no put");
        const int64_t r = sim.relay(B, s);
        const double reduce_us =
            transfer_us(count * config.out_row_bytes + config.partial_row_bytes, reduce_gbps);
        const double done = reducer[r].reserve(relay_ready[s][B][t], reduce_us) + reduce_us;
        partials.push_back({done, s, B, t});
      }
  std::sort(partials.begin(), partials.end(), [](const Partial& a, const Partial& b) {
    return std::tie(a.ready, a.s, a.B, a.t) < std::tie(b.ready, b.s, b.B, b.t);
  });
  if (!partials.empty() && config.fault == SimConfig::Fault::kDropPartial) partials.erase(partials.begin());
  const double partial_us = transfer_us(config.nic_out_row_bytes, config.nic_gbps);
  std::vector<std::vector<std::vector<int32_t>>> partial_seen(R);
  for (int64_t s = 0; s < R; ++s) partial_seen[s].assign(N, std::vector<int32_t>(inputs[s].num_tokens, 0));
  std::vector<double> done(R, 0.0);
  for (const Partial& p : partials) {
    const int64_t r = sim.relay(p.B, p.s);
    const double start = reserve_both(nic_out[r], nic_in[p.s], p.ready, partial_us);
    done[p.s] = std::max(done[p.s], start + partial_us + config.nic_latency_us);
    done[r] = std::max(done[r], start + partial_us);
    partial_seen[p.s][p.B][p.t] += 1;
    result.ranks[r].partials_sent += 1;
    result.ranks[p.s].partials_received += 1;
    ++result.partials;
  }
  for (int64_t s = 0; s < R; ++s)
    for (int64_t B = 0; B < N; ++B)
      for (int64_t t = 0; t < inputs[s].num_tokens; ++t) {
        const int32_t expected = B != sim.node_of_rank(s) && node_pairs[s][B][t] > 0 ? 1 : 0;
        if (partial_seen[s][B][t] != expected)
          sim.error("rank ", s, " token ", t, ": ", partial_seen[s][B][t], " partials from node ", B,
                    ", expected ", expected);
      }

  // ---- 5. the owners' ends, the combine barrier, the sum -----------------------------------------------
  double end = 0;
  for (int64_t s = 0; s < R; ++s) {
    done[s] = std::max(done[s], last_tile[s]);
    for (double t : pair_arrival[s]) done[s] = std::max(done[s], t);
    result.ranks[s].done_us = done[s];
    end = std::max(end, done[s]);
    result.max_compute_busy_us = std::max(result.max_compute_busy_us, result.ranks[s].compute_busy_us);
  }
  result.pass_us = end + config.combine_barrier_us + config.epilogue_us;
  return result;
}

}  // namespace pounce::reference
