#include "cli/report.h"

#include <cstdarg>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <sstream>

#include "pounce/error.h"
#include "pounce/version.h"

#ifdef POUNCE_HAS_CUDA
#include <cuda_runtime.h>
#endif

namespace pounce::cli {

std::string format(const char* pattern, ...) {
  va_list args;
  va_start(args, pattern);
  va_list copy;
  va_copy(copy, args);
  const int size = std::vsnprintf(nullptr, 0, pattern, copy);
  va_end(copy);
  std::string out(size > 0 ? size : 0, '\0');
  if (size > 0) std::vsnprintf(out.data(), out.size() + 1, pattern, args);
  va_end(args);
  return out;
}

void write_json(const nlohmann::json& value, const std::string& path) {
  const std::string text = value.dump(2) + "\n";
  if (path == "-") {
    std::cout << text << std::flush;
    return;
  }
  std::ofstream file(path);
  POUNCE_CHECK(file.good(), "cannot open '", path, "' for writing; check that its folder exists");
  file << text;
  file.close();
  POUNCE_CHECK(!file.fail(), "writing '", path, "' failed (disk full?)");
}

nlohmann::json build_info_json() {
  const BuildInfo& info = build_info();
  return {{"version", info.version},
          {"commit", info.commit},
          {"cuda", info.cuda},
          {"cuda_version", info.cuda_version},
          {"nccl_version", info.nccl_version}};
}

std::string utc_now_iso() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

GpuFacts gpu_facts() {
  GpuFacts facts;
  // The kernel module's version, as nvidia-smi reports it: the first dotted number of
  // "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ..."
  std::ifstream version("/proc/driver/nvidia/version");
  std::string line;
  if (std::getline(version, line)) {
    std::istringstream words(line);
    for (std::string word; words >> word;) {
      if (word.find('.') != std::string::npos && word.find_first_not_of("0123456789.") == std::string::npos) {
        facts.driver = word;
        break;
      }
    }
  }
#ifdef POUNCE_HAS_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) {
    cudaDeviceProp properties{};
    if (cudaGetDeviceProperties(&properties, 0) == cudaSuccess) facts.name = properties.name;
  }
  int runtime = 0;
  if (cudaRuntimeGetVersion(&runtime) == cudaSuccess)
    facts.cuda = std::to_string(runtime / 1000) + "." + std::to_string(runtime % 1000 / 10);
  if (facts.driver.empty()) {
    int driver = 0;
    if (cudaDriverGetVersion(&driver) == cudaSuccess)
      facts.driver = "CUDA " + std::to_string(driver / 1000) + "." + std::to_string(driver % 1000 / 10);
  }
#endif
  return facts;
}

}  // namespace pounce::cli
