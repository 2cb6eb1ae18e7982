// `pounce info`: the build, the devices and NCCL this process sees, and which backend `run` would use.
// Works without a GPU (and without a CUDA build).
#include <iostream>
#include <sstream>

#include "pounce/version.h"
#include "src/gpu_backend.h"
#include "cli/commands.h"
#include "cli/report.h"

namespace pounce::cli {

int info_command(const InfoOptions& options) {
  const BuildInfo& info = build_info();
  const Machine machine = probe_machine();
  const std::string devices = machine.cuda_compiled ? gpu::describe_devices() : "";
  const std::string nccl_runtime = machine.cuda_compiled ? gpu::nccl_runtime_version() : "";
  const BackendChoice choice = choose_backend("auto", machine);
  std::ostream& out = options.json == "-" ? std::cerr : std::cout;

  out << "pounce " << info.version << " (commit " << info.commit << ")\n";
  out << "build:    CUDA device code " << (info.cuda ? "compiled in (sm_90a)" : "not compiled in")
      << "; CUDA headers " << info.cuda_version << "; NCCL headers " << info.nccl_version << "\n";
  out << "devices:  ";
  if (devices.empty()) {
    out << (machine.cuda_compiled ? "no CUDA GPU visible\n" : "unknown (this build cannot query GPUs)\n");
  } else {
    std::istringstream lines(devices);
    std::string line;
    bool first = true;
    while (std::getline(lines, line)) {
      out << (first ? "" : "          ") << line << "\n";
      first = false;
    }
  }
  out << "NCCL:     runtime " << (nccl_runtime.empty() ? "unknown" : nccl_runtime) << "\n";
  out << "run:      would use the " << to_string(choice.backend) << " backend: " << choice.reason << "\n";
  if (choice.backend == Backend::kCpu) {
    const Shape& s = kCpuDefaultShape;
    out << "          default problem: H " << s.hidden << ", I " << s.intermediate << ", E " << s.num_experts
        << ", top-" << s.num_topk << ", shared " << s.shared_intermediate << ", " << s.max_tokens
        << " tokens per rank x " << s.num_ranks << " ranks\n";
  } else {
    out << "          default problem: preset " << kGpuDefaultPreset << ", " << kGpuDefaultTokens
        << " tokens per rank on every visible GPU\n";
  }
  out << std::flush;

  if (!options.json.empty()) {
    nlohmann::json value = {{"command", "info"},
                            {"build", build_info_json()},
                            {"num_gpus", machine.num_gpus},
                            {"devices", devices},
                            {"nccl_runtime", nccl_runtime},
                            {"run_backend", to_string(choice.backend)},
                            {"run_backend_reason", choice.reason}};
    write_json(value, options.json);
  }
  return 0;
}

}  // namespace pounce::cli
