// `pounce plan`: the cost model of cli/plan.h for one configuration and over EP sizes 1-256, its validation
// against the measured records (--validate), and the discrete-event simulation of the hierarchical schedule
// (--simulate, reference/internode_sim.h). Needs no GPU.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "pounce/error.h"
#include "cli/bench.h"
#include "cli/commands.h"
#include "cli/plan.h"
#include "cli/report.h"

namespace pounce::cli {
namespace {

using nlohmann::json;

std::string thousands(double value) {
  return value >= 1e4 ? format("%.1fk", value / 1e3) : format("%.0f", value);
}

std::string comm_sms_text(const PassPrediction& chosen, int heuristic) {
  return chosen.comm_sms == heuristic ? format("%d", chosen.comm_sms)
                                      : format("%d (today %d)", chosen.comm_sms, heuristic);
}

void print_pass(std::ostream& out, const char* name, const PassPrediction& p, int heuristic) {
  const double exposed = p.prologue_ms + p.drain_ms + p.epilogue_ms;
  out << format("%-9s %8.3f %8.0f  %-13s %-14s %7.3f %7.3f %8.3f %7.3f %7.3f %8.3f\n", name, p.ms, p.tflops(),
                to_string(p.binding), comm_sms_text(p, heuristic).c_str(), p.tensor_ms, p.nvlink_ms,
                p.comm_sm_ms, p.nic_ms, p.hbm_ms, exposed);
}

// The headline passes: the given comm SMs, or the suggested ones.
const PassPrediction& headline(const LayerPlan& plan, bool backward) {
  const bool given = plan.problem.forward_comm_sms > 0;
  if (backward) return given ? plan.backward : plan.backward_suggested;
  return given ? plan.forward : plan.forward_suggested;
}

void print_plan(std::ostream& out, const PlanCommandOptions& options, const LayerPlan& plan) {
  const PlanProblem& p = plan.problem;
  const Shape& s = p.shape;
  const PlanTraffic& t = plan.traffic;
  out << format("pounce plan: %s (H %lld, I %lld, E %lld, top-%lld, shared %lld), %lld tokens per rank, %s\n",
                options.preset.c_str(), static_cast<long long>(s.hidden),
                static_cast<long long>(s.intermediate), static_cast<long long>(s.num_experts),
                static_cast<long long>(s.num_topk), static_cast<long long>(s.shared_intermediate),
                static_cast<long long>(s.max_tokens),
                p.precision == Precision::kFP8 ? "fp8 (unvalidated: no FP8 kernel is measured yet)" : "bf16");
  out << format("group:       EP%lld = %d node%s x %d GPUs; NVLink %.0f GB/s",
                static_cast<long long>(s.num_ranks), p.num_nodes(), p.num_nodes() > 1 ? "s" : "",
                p.node_size(), p.nvlink_gbps);
  if (p.num_nodes() > 1)
    out << format(", NIC %.0f GB/s (%.0f effective), combine partials %s", p.nic_gbps,
                  p.nic_gbps * kNicEfficiency, p.combine_partial_bytes == 4 ? "fp32" : "bf16");
  out << "\n";
  out << format("per rank:    %s pairs in, %s over NVLink, %s local",
                thousands(t.local_pairs + t.nvlink_pairs).c_str(), thousands(t.nvlink_pairs).c_str(),
                thousands(t.local_pairs).c_str());
  if (p.num_nodes() > 1)
    out << format("; %s tokens over the NIC each way (a put per pair would send %s: %.1fx)",
                  thousands(t.nic_tokens).c_str(), thousands(t.nic_pairs_without_dedup).c_str(),
                  t.pairs_per_remote_token);
  out << format("\n             %.0f rows per expert, padded to %.0f (+%.1f %%)\n\n", t.rows_per_expert,
                t.padded_rows_per_expert, 100 * (t.padded_rows_per_expert / t.rows_per_expert - 1));
  out << "pass            ms  TFLOP/s  binds         comm SMs        tensor  NVLink comm SMs     NIC     HBM "
         " exposed\n";
  print_pass(out, "forward", headline(plan, false), heuristic_comm_sms(p, false, PlanPath::kFused));
  print_pass(out, "backward", headline(plan, true), heuristic_comm_sms(p, true, PlanPath::kFused));
  out << format("%-9s %8.3f %8.0f\n", "both", headline(plan, false).ms + headline(plan, true).ms,
                (headline(plan, false).useful_flops + headline(plan, true).useful_flops) /
                    ((headline(plan, false).ms + headline(plan, true).ms) * 1e9));
  if (p.forward_comm_sms == 0)
    out << format("(with today's heuristic comm SMs: forward %.3f ms, backward %.3f ms)\n", plan.forward.ms,
                  plan.backward.ms);
  out << "terms in ms (tensor: the tiles after the first rows); the pass is the exposed terms + the longest "
         "of\n"
         "tensor, a link's or the comm SMs' traffic + the last minibatch's tiles, HBM (backward: + the "
         "weight-\n"
         "gradient tiles); docs/internode.md §7.\n";
}

void print_sweep(std::ostream& out, const std::vector<LayerPlan>& sweep, int gpus_per_node) {
  out << format(
      "\nEP sizes, tokens per rank held, %d GPUs per node (comm SMs: the suggested forward / backward):\n",
      gpus_per_node);
  out << "   EP nodes   El rows/expert  fwd ms  bwd ms fwd TF/s bwd TF/s  fwd binds     bwd binds     comm "
         "SMs  NIC MB\n";
  for (const LayerPlan& plan : sweep) {
    const PassPrediction& f = plan.forward_suggested;
    const PassPrediction& b = plan.backward_suggested;
    out << format("%5lld %5d %4lld %11.0f %7.3f %7.3f %8.0f %8.0f  %-13s %-13s %4d / %-3d %6.0f\n",
                  static_cast<long long>(plan.problem.shape.num_ranks), plan.problem.num_nodes(),
                  static_cast<long long>(plan.problem.shape.num_local_experts()),
                  plan.traffic.rows_per_expert, f.ms, b.ms, f.tflops(), b.tflops(), to_string(f.binding),
                  to_string(b.binding), plan.suggested_forward_comm_sms, plan.suggested_backward_comm_sms,
                  (f.nic_bytes + b.nic_bytes) / 1e6);
  }
}

int run_simulation(std::ostream& out, const PlanCommandOptions& options, const LayerPlan& plan) {
  const PlanProblem& p = plan.problem;
  POUNCE_CHECK(p.shape.num_ranks <= 64,
               "--simulate runs up to 64 ranks (the schedules of every rank are built in ",
               "this process); got --ep ", p.shape.num_ranks);
  const std::vector<reference::RankInputs> routing = plan_routing(p, options.seed);
  const reference::Problem problem = sim_problem(p);
  int status = 0;
  out << format("\nsimulation (reference/internode_sim.h, %s routing, seed %llu):\n",
                p.node_limit > 0 ? "node-limited" : "uniform", static_cast<unsigned long long>(options.seed));
  for (bool backward : {false, true}) {
    const PassPrediction& model = headline(plan, backward);
    const reference::SimResult sim =
        reference::simulate_pass(problem, routing, sim_config(p, backward, model.comm_sms));
    const double ms = sim.pass_us / 1e3;
    out << format(
        "  %-8s %8.3f ms against the model's %.3f (%+.1f %%); tiles busy %.3f ms; %lld pairs, %lld NIC "
        "puts (%lld pairs on other nodes), %lld partials: %s\n",
        backward ? "backward" : "forward", ms, model.ms, 100 * (ms / model.ms - 1),
        sim.max_compute_busy_us / 1e3, static_cast<long long>(sim.pairs),
        static_cast<long long>(sim.nic_puts), static_cast<long long>(sim.nic_pairs_without_dedup),
        static_cast<long long>(sim.partials), sim.ok ? "every check holds" : "CHECKS FAILED");
    for (const std::string& error : sim.errors) out << "    " << error << "\n";
    if (!sim.ok) status = 1;
    if (p.num_nodes() > 1) {  // the ablation of docs/internode.md §3: puts by token id, not by need
      reference::SimConfig config = sim_config(p, backward, model.comm_sms);
      config.puts_in_token_order = true;
      const reference::SimResult ablated = reference::simulate_pass(problem, routing, config);
      out << format(
          "           with the puts in token order instead of the node's need: %.3f ms (%+.1f %%)\n",
          ablated.pass_us / 1e3, 100 * (ablated.pass_us / sim.pass_us - 1));
    }
  }
  return status;
}

json sweep_json(const std::vector<LayerPlan>& sweep) {
  json list = json::array();
  for (const LayerPlan& plan : sweep) list.push_back(to_json(plan));
  return list;
}

}  // namespace

int plan_command(const PlanCommandOptions& options) {
  std::ostream& out = options.json == "-" ? std::cerr : std::cout;
  if (!options.validate.empty()) {
    const std::vector<ValidationRow> rows = validate_results_dir(options.validate);
    std::string command = "pounce plan --validate " + options.validate;
    if (!options.validate_out.empty()) command += " --validate-out " + options.validate_out;
    const std::string table = validation_markdown(rows, command);
    out << table;
    if (!options.validate_out.empty()) {
      std::ofstream file(options.validate_out);
      POUNCE_CHECK(file.good(), "cannot open '", options.validate_out, "' for writing");
      file << table;
    }
    if (!options.json.empty()) {
      json list = json::array();
      for (const ValidationRow& r : rows)
        list.push_back({{"impl", r.impl},
                        {"pass", r.pass},
                        {"preset", r.preset},
                        {"ranks", r.ranks},
                        {"tokens_per_rank", r.tokens_per_rank},
                        {"precision", r.precision},
                        {"measured_ms", r.measured_ms},
                        {"modelled", r.modelled},
                        {"reason", r.reason},
                        {"predicted_ms", r.predicted_ms},
                        {"error", r.error},
                        {"binding", r.binding}});
      write_json(list, options.json);
    }
    return 0;
  }

  const PlanProblem problem = plan_problem(options);
  const LayerPlan plan = plan_layer(problem);
  print_plan(out, options, plan);
  std::vector<LayerPlan> sweep;
  if (!options.no_sweep || !options.chart.empty()) {
    sweep = plan_sweep(problem, sweep_ep_sizes(problem.shape.num_experts));
    if (!options.no_sweep) print_sweep(out, sweep, problem.gpus_per_node);
  }
  int status = 0;
  if (options.simulate) status = run_simulation(out, options, plan);

  const json value = {
      {"command", "plan"}, {"preset", options.preset}, {"plan", to_json(plan)}, {"sweep", sweep_json(sweep)}};
  if (!options.json.empty()) write_json(value, options.json);
  if (!options.chart.empty()) {
    const std::string data = options.chart + ".json";
    write_json(value, data);
    const std::string command = shell_quote(options.python) + " " + shell_quote(options.plot_script) + " " +
                                shell_quote(data) + " -o " + shell_quote(options.chart);
    const int rc = std::filesystem::exists(options.plot_script) ? std::system(command.c_str()) : -1;
    if (rc != 0)
      std::cerr << "note: no chart written ("
                << (rc == -1 ? "plot script not found" : "the plot script failed") << "); the sweep is in "
                << data << "; to draw it: " << command << "\n";
  }
  return status;
}

}  // namespace pounce::cli
