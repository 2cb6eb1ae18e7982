#include "tools/cli/telemetry.h"

#include <dlfcn.h>

#include <algorithm>
#include <string>

#ifdef POUNCE_HAS_CUDA
#include <cuda_runtime.h>
#endif

namespace pounce::cli {
namespace {

// The few NVML entry points used, declared by their C signatures (nvml.h is not needed to build): every one
// returns 0 (NVML_SUCCESS) on success; a device is an opaque handle.
using NvmlDevice = void*;
using NvmlInit = int (*)();
using NvmlHandleByPciBusId = int (*)(const char*, NvmlDevice*);
using NvmlHandleByIndex = int (*)(unsigned int, NvmlDevice*);
using NvmlClockInfo = int (*)(NvmlDevice, int, unsigned int*);
using NvmlPowerUsage = int (*)(NvmlDevice, unsigned int*);
using NvmlTemperature = int (*)(NvmlDevice, int, unsigned int*);
constexpr int kNvmlClockSm = 1;         // NVML_CLOCK_SM
constexpr int kNvmlTemperatureGpu = 0;  // NVML_TEMPERATURE_GPU

struct Nvml {
  NvmlClockInfo clock_info = nullptr;
  NvmlPowerUsage power_usage = nullptr;
  NvmlTemperature temperature = nullptr;
  NvmlHandleByPciBusId by_pci_bus_id = nullptr;
  NvmlHandleByIndex by_index = nullptr;
  bool ready = false;
};

// Opened and initialised once per process; never closed (the library stays loaded until exit).
const Nvml& nvml() {
  static const Nvml loaded = [] {
    Nvml n;
    void* library = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) return n;
    auto init = reinterpret_cast<NvmlInit>(dlsym(library, "nvmlInit_v2"));
    n.clock_info = reinterpret_cast<NvmlClockInfo>(dlsym(library, "nvmlDeviceGetClockInfo"));
    n.power_usage = reinterpret_cast<NvmlPowerUsage>(dlsym(library, "nvmlDeviceGetPowerUsage"));
    n.temperature = reinterpret_cast<NvmlTemperature>(dlsym(library, "nvmlDeviceGetTemperature"));
    n.by_pci_bus_id =
        reinterpret_cast<NvmlHandleByPciBusId>(dlsym(library, "nvmlDeviceGetHandleByPciBusId_v2"));
    n.by_index = reinterpret_cast<NvmlHandleByIndex>(dlsym(library, "nvmlDeviceGetHandleByIndex_v2"));
    n.ready = init != nullptr && n.clock_info != nullptr && n.power_usage != nullptr &&
              n.temperature != nullptr && n.by_index != nullptr && init() == 0;
    return n;
  }();
  return loaded;
}

// The NVML handle of CUDA device `device`: found by PCI bus id (CUDA_VISIBLE_DEVICES renumbers CUDA's
// devices, not NVML's), else by the same index.
NvmlDevice device_handle(const Nvml& n, int device) {
  NvmlDevice handle = nullptr;
#ifdef POUNCE_HAS_CUDA
  char bus_id[32] = {};
  if (n.by_pci_bus_id != nullptr && cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device) == cudaSuccess &&
      n.by_pci_bus_id(bus_id, &handle) == 0)
    return handle;
#endif
  if (n.by_index(static_cast<unsigned int>(device), &handle) == 0) return handle;
  return nullptr;
}

}  // namespace

TelemetrySummary summarize(const std::vector<TelemetrySample>& samples) {
  TelemetrySummary summary;
  summary.samples = static_cast<int>(samples.size());
  double peak_w = 0.0;
  for (const TelemetrySample& s : samples) {
    peak_w = std::max(peak_w, s.power_w);
    summary.temperature_c = std::max(summary.temperature_c, s.temperature_c);
  }
  for (const TelemetrySample& s : samples) {
    if (s.power_w < 0.5 * peak_w) continue;
    summary.sm_clock_mhz += s.sm_clock_mhz;
    summary.power_w += s.power_w;
    ++summary.busy_samples;
  }
  if (summary.busy_samples > 0) {
    summary.sm_clock_mhz /= summary.busy_samples;
    summary.power_w /= summary.busy_samples;
  }
  return summary;
}

void add_telemetry(nlohmann::json& record, const TelemetrySummary& summary) {
  const bool sampled = summary.samples > 0;
  auto value = [sampled](double v) { return sampled ? nlohmann::json(v) : nlohmann::json(nullptr); };
  record["sm_clock_mhz"] = value(summary.sm_clock_mhz);
  record["power_w"] = value(summary.power_w);
  record["temperature_c"] = value(summary.temperature_c);
  record["telemetry_samples"] = {{"busy", summary.busy_samples}, {"all", summary.samples}};
}

GpuTelemetry::GpuTelemetry(int num_gpus, std::chrono::milliseconds period) {
  const Nvml& n = nvml();
  if (!n.ready) return;
  for (int device = 0; device < num_gpus; ++device) {
    if (NvmlDevice handle = device_handle(n, device)) devices_.push_back(handle);
  }
  if (!devices_.empty()) thread_ = std::thread([this, period] { sample_until_stopped(period); });
}

GpuTelemetry::~GpuTelemetry() {
  stop();
}

TelemetrySummary GpuTelemetry::stop() {
  stopping_ = true;
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  return summarize(samples_);
}

void GpuTelemetry::sample_until_stopped(std::chrono::milliseconds period) {
  const Nvml& n = nvml();
  while (!stopping_) {
    for (NvmlDevice device : devices_) {
      unsigned int clock = 0, milliwatts = 0, celsius = 0;
      if (n.clock_info(device, kNvmlClockSm, &clock) != 0 || n.power_usage(device, &milliwatts) != 0 ||
          n.temperature(device, kNvmlTemperatureGpu, &celsius) != 0)
        continue;
      std::lock_guard<std::mutex> lock(mutex_);
      samples_.push_back({static_cast<double>(clock), milliwatts / 1000.0, static_cast<double>(celsius)});
    }
    std::this_thread::sleep_for(period);
  }
}

}  // namespace pounce::cli
