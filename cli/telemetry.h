// What the GPUs ran at while `pounce bench` timed them: SM clock, board power and temperature, sampled
// through NVML (the driver's libnvidia-ml.so.1, opened at run time, so the build needs no NVML and a machine
// without it records nothing). Readings are taken only while some rank's timed run is on its GPU
// (TimedWork), so the setup and the checks between runs do not dilute them. The layer's GEMMs run at the
// power limit (docs/design.md "Power"): a time means little without the clock it was taken at, and the
// baseline runs at its own.
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
  double unix_s = 0.0;  // when it was read (wall clock, seconds since 1970): matches a process's timed window
};

struct TelemetrySummary {
  int samples = 0;             // readings summarized (timed runs, all GPUs); 0 = none
  double sm_clock_mhz = 0.0;   // mean over the readings
  double power_w = 0.0;        // mean over the readings: per GPU
  double temperature_c = 0.0;  // the highest reading
};

// Means of clock and power, the highest temperature; all zero for no samples. `busy_fraction` > 0 keeps only
// the readings at no less than that fraction of the highest power (a window that also holds idle or setup
// readings: the baseline's process).
TelemetrySummary summarize(const std::vector<TelemetrySample>& samples, double busy_fraction = 0.0);

// summarize() of the readings taken within [begin_s, end_s] (unix_s), e.g. one timed pass of the baseline's
// process, which reports its passes' windows (bench/baselines/torch_moe.py, timed_window_unix_s).
TelemetrySummary summarize_window(const std::vector<TelemetrySample>& samples, double begin_s, double end_s);

// Adds sm_clock_mhz, power_w and temperature_c to a bench record (null without samples), and
// telemetry_samples.
void add_telemetry(nlohmann::json& record, const TelemetrySummary& summary);

// Marks a timed run in flight on this thread's GPU for its lifetime (`timed` false: marks nothing). The
// process-wide count gates GpuTelemetry's readings; a whole baseline process counts as one.
class TimedWork {
 public:
  explicit TimedWork(bool timed);
  ~TimedWork();
  TimedWork(const TimedWork&) = delete;
  TimedWork& operator=(const TimedWork&) = delete;

 private:
  bool timed_;
};

// Samples the first `num_gpus` CUDA devices every `period` on a thread of its own while some TimedWork is
// alive, from construction until stop() (or destruction). Without NVML or GPUs it samples nothing and stop()
// returns an empty summary.
class GpuTelemetry {
 public:
  explicit GpuTelemetry(int num_gpus, std::chrono::microseconds period = std::chrono::microseconds(2000));
  ~GpuTelemetry();
  GpuTelemetry(const GpuTelemetry&) = delete;
  GpuTelemetry& operator=(const GpuTelemetry&) = delete;

  TelemetrySummary stop(double busy_fraction = 0.0);  // summarize's busy_fraction
  std::vector<TelemetrySample> samples();             // every reading so far (all of them after stop())

 private:
  void sample_until_stopped(std::chrono::microseconds period);

  std::vector<void*> devices_;  // NVML device handles
  std::vector<TelemetrySample> samples_;
  std::mutex mutex_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace pounce::cli
