// What the GPUs ran at while `pounce bench` measured: SM clock, board power and temperature, sampled through
// NVML (the driver's libnvidia-ml.so.1, opened at run time, so the build needs no NVML and a machine without
// it records nothing). The layer runs at the power limit (docs/design.md "Power"): a time means little
// without the clock it was taken at, and the baseline runs at its own.
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

namespace pounce::cli {

// One reading of one GPU.
struct TelemetrySample {
  double sm_clock_mhz = 0.0;
  double power_w = 0.0;
  double temperature_c = 0.0;
};

// The window holds setup and idle gaps as well as the timed runs, so clock and power are averaged over the
// busy readings only: those at no less than half the window's highest power.
struct TelemetrySummary {
  int samples = 0;             // readings taken (all GPUs); 0 = nothing sampled
  int busy_samples = 0;        // readings at >= half the highest power
  double sm_clock_mhz = 0.0;   // mean over the busy readings
  double power_w = 0.0;        // mean over the busy readings: per GPU
  double temperature_c = 0.0;  // the highest reading
};

// The summary of `samples`; all zero for none.
TelemetrySummary summarize(const std::vector<TelemetrySample>& samples);

// Adds sm_clock_mhz, power_w and temperature_c to a bench record (null without samples), and
// telemetry_samples (busy, of all).
void add_telemetry(nlohmann::json& record, const TelemetrySummary& summary);

// Samples the first `num_gpus` CUDA devices every `period` on a thread of its own, from construction until
// stop() (or destruction). Without NVML or GPUs it samples nothing and stop() returns an empty summary.
class GpuTelemetry {
 public:
  explicit GpuTelemetry(int num_gpus, std::chrono::milliseconds period = std::chrono::milliseconds(20));
  ~GpuTelemetry();
  GpuTelemetry(const GpuTelemetry&) = delete;
  GpuTelemetry& operator=(const GpuTelemetry&) = delete;

  TelemetrySummary stop();

 private:
  void sample_until_stopped(std::chrono::milliseconds period);

  std::vector<void*> devices_;  // NVML device handles
  std::vector<TelemetrySample> samples_;
  std::mutex mutex_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace pounce::cli
