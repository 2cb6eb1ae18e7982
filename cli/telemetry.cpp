#include "cli/telemetry.h"

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
// nvmlFieldValue_t, for NVML_FI_DEV_POWER_INSTANT: nvmlDeviceGetPowerUsage averages over a second on this
// generation, longer than a timed run.
struct NvmlFieldValue {
  unsigned int field_id;
  unsigned int scope_id;
  long long timestamp;
  long long latency_us;
  int value_type;
  int nvml_return;
  union {
    double d;
    unsigned int ui;
    unsigned long ul;
    unsigned long long ull;
    long long sll;
    int si;
  } value;
};
static_assert(sizeof(NvmlFieldValue) == 40, "nvmlFieldValue_t is 40 bytes");
using NvmlFieldValues = int (*)(NvmlDevice, int, NvmlFieldValue*);
constexpr unsigned int kNvmlFieldPowerInstant = 186;  // NVML_FI_DEV_POWER_INSTANT, milliwatts
constexpr int kNvmlValueUnsignedInt = 1;              // NVML_VALUE_TYPE_UNSIGNED_INT

std::atomic<int> g_timed_work{0};

struct Nvml {
  NvmlClockInfo clock_info = nullptr;
  NvmlPowerUsage power_usage = nullptr;
  NvmlTemperature temperature = nullptr;
  NvmlFieldValues field_values = nullptr;  // optional: instantaneous power
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
    n.field_values = reinterpret_cast<NvmlFieldValues>(dlsym(library, "nvmlDeviceGetFieldValues"));
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

// Board power in watts: the instantaneous field where the driver has it, else NVML's averaged reading.
bool read_power_w(const Nvml& n, NvmlDevice device, double& watts) {
  if (n.field_values != nullptr) {
    NvmlFieldValue field{};
    field.field_id = kNvmlFieldPowerInstant;
    if (n.field_values(device, 1, &field) == 0 && field.nvml_return == 0 &&
        field.value_type == kNvmlValueUnsignedInt) {
      watts = field.value.ui / 1000.0;
      return true;
    }
  }
  unsigned int milliwatts = 0;
  if (n.power_usage(device, &milliwatts) != 0) return false;
  watts = milliwatts / 1000.0;
  return true;
}

}  // namespace

TimedWork::TimedWork(bool timed) : timed_(timed) {
  if (timed_) g_timed_work.fetch_add(1, std::memory_order_relaxed);
}

TimedWork::~TimedWork() {
  if (timed_) g_timed_work.fetch_sub(1, std::memory_order_relaxed);
}

TelemetrySummary summarize(const std::vector<TelemetrySample>& samples, double busy_fraction) {
  double highest_power = 0.0;
  for (const TelemetrySample& s : samples) highest_power = std::max(highest_power, s.power_w);
  TelemetrySummary summary;
  for (const TelemetrySample& s : samples) {
    if (s.power_w < busy_fraction * highest_power) continue;
    summary.sm_clock_mhz += s.sm_clock_mhz;
    summary.power_w += s.power_w;
    summary.temperature_c = std::max(summary.temperature_c, s.temperature_c);
    ++summary.samples;
  }
  if (summary.samples > 0) {
    summary.sm_clock_mhz /= summary.samples;
    summary.power_w /= summary.samples;
  }
  return summary;
}

TelemetrySummary summarize_window(const std::vector<TelemetrySample>& samples, double begin_s, double end_s) {
  std::vector<TelemetrySample> within;
  for (const TelemetrySample& s : samples)
    if (s.unix_s >= begin_s && s.unix_s <= end_s) within.push_back(s);
  return summarize(within);
}

void add_telemetry(nlohmann::json& record, const TelemetrySummary& summary) {
  const bool sampled = summary.samples > 0;
  auto value = [sampled](double v) { return sampled ? nlohmann::json(v) : nlohmann::json(nullptr); };
  record["sm_clock_mhz"] = value(summary.sm_clock_mhz);
  record["power_w"] = value(summary.power_w);
  record["temperature_c"] = value(summary.temperature_c);
  record["telemetry_samples"] = summary.samples;
}

GpuTelemetry::GpuTelemetry(int num_gpus, std::chrono::microseconds period) {
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

TelemetrySummary GpuTelemetry::stop(double busy_fraction) {
  stopping_ = true;
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  return summarize(samples_, busy_fraction);
}

std::vector<TelemetrySample> GpuTelemetry::samples() {
  std::lock_guard<std::mutex> lock(mutex_);
  return samples_;
}

void GpuTelemetry::sample_until_stopped(std::chrono::microseconds period) {
  const Nvml& n = nvml();
  while (!stopping_) {
    for (NvmlDevice device : devices_) {
      if (g_timed_work.load(std::memory_order_relaxed) == 0) break;
      unsigned int clock = 0, celsius = 0;
      double watts = 0.0;
      if (n.clock_info(device, kNvmlClockSm, &clock) != 0 || !read_power_w(n, device, watts) ||
          n.temperature(device, kNvmlTemperatureGpu, &celsius) != 0)
        continue;
      const double now_s =
          std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
      std::lock_guard<std::mutex> lock(mutex_);
      samples_.push_back({static_cast<double>(clock), watts, static_cast<double>(celsius), now_s});
    }
    std::this_thread::sleep_for(period);
  }
}

}  // namespace pounce::cli
