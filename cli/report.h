// Formatting shared by the subcommands: printf-style strings, JSON files, build facts.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace pounce::cli {

// printf into a std::string.
std::string format(const char* pattern, ...) __attribute__((format(printf, 1, 2)));

// Writes `value` (indented) to `path`, or to stdout when path is "-". Throws pounce::Error when the file
// cannot be written.
void write_json(const nlohmann::json& value, const std::string& path);

// pounce::build_info() as JSON.
nlohmann::json build_info_json();

// "2026-11-29T21:16:03Z"
std::string utc_now_iso();

// Facts about GPU 0 for benchmark records; empty strings when unknown or without CUDA.
struct GpuFacts {
  std::string name;
  std::string driver;  // kernel driver version, e.g. "570.86.15"
  std::string cuda;    // CUDA runtime version the tool runs with, e.g. "13.0"
};
GpuFacts gpu_facts();

}  // namespace pounce::cli
