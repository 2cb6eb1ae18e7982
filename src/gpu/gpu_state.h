// Definitions of the GPU backend's opaque group and workspace (src/gpu_backend.h), shared by src/gpu/*.cu.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "src/gpu/grouped_gemm.h"
#include "kernels/layout/workspace_layout.cuh"
#include "pounce/config.h"
#include "pounce/error.h"
#include "pounce/shape.h"
#include "src/gpu_backend.h"

namespace pounce::gpu {

// Throws pounce::Error naming the call when a CUDA runtime call fails.
void cuda_check(cudaError_t status, const char* what);
#define POUNCE_CUDA(call) ::pounce::gpu::cuda_check((call), #call)

// Sets the current device for the scope and restores the caller's afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// NCCL communicators destroyed together, one thread per communicator, so that ranks driven by one thread
// (Group::create_nccl_local) can be released from any thread without a collective deadlock.
struct CommOwner {
  struct Member {
    int device = 0;
    ncclComm_t comm = nullptr;
    ncclDevComm dev_comm{};
    bool has_dev_comm = false;
  };
  std::vector<Member> members;
  ~CommOwner();
};

struct GpuGroup {
  int rank = 0;
  int num_ranks = 1;
  int device = 0;
  std::shared_ptr<CommOwner> owner;  // null for a group of one rank (no NCCL)
  ncclComm_t comm() const;
  const ncclDevComm* dev_comm() const;
};

// Events per workspace for the overlap's fork/join edges: 2 per chunk and pass, plus the forks and joins.
inline constexpr int kOverlapEvents = 64;

struct GpuWorkspace {
  std::shared_ptr<GpuGroup> group;
  int rank = 0;
  int device = 0;
  int num_sms = 0;
  Shape shape;
  Config config;
  kernels::layout::WorkspaceLayout layout;
  void* symmetric = nullptr;                                 // ncclMemAlloc (R > 1) or cudaMalloc (R = 1)
  ncclWindow_t window = nullptr;                             // R > 1 only
  void* local = nullptr;                                     // cudaMalloc
  kernels::layout::DeviceErrorRecord* error_host = nullptr;  // cudaHostAlloc(mapped)
  kernels::layout::DeviceErrorRecord* error_device = nullptr;
  cudaStream_t side_stream = nullptr;  // clears the error claim flag; never captured
  // Overlap of the staged passes (src/gpu/overlap.h): transfers run on comm_stream, forked from and joined
  // back into the caller's stream with these events (captured into CUDA graphs as fork/join edges).
  cudaStream_t comm_stream = nullptr;
  std::vector<cudaEvent_t> events;
  // Tokens of the forward whose context the workspace holds (-1: none yet). Host-side, so it also holds for
  // calls recorded into a CUDA graph.
  int64_t context_tokens = -1;
  uint64_t timeout_ns = 0;      // POUNCE_PEER_TIMEOUT_S, read at creation (src/environment.h)
  bool profile_stages = false;  // POUNCE_PROFILE_STAGES, the same
  int32_t injected_wait = 0;    // tests: the WaitId the next call fails (inject_wait_failure)

  kernels::layout::WorkspacePointers pointers() const;
};

// Shared by the staged passes (src/gpu/staged_forward.cu): the activation as the GEMM epilogues take it,
// and a phase barrier over the group (nothing for one rank; at most kBarrierThreads ranks).
inline constexpr int kBarrierThreads = 128;
inline constexpr int kCopyThreads = 256;  // blocks of the copy-style stage kernels (num_sms * 4 of them)
bool aligned_16(const void* pointer);
kernels::ActivationParams activation_params(const Activation& activation);
// Weights [El, a, b] (or a shared expert's [a, b]) from local expert `first_expert` on, at the view's strides
// (weights may be row-strided views, e.g. the halves of a fused gate_up tensor).
kernels::WeightRows expert_slice(const TensorView& weights, int64_t first_expert = 0);
// Throws naming `name` unless every non-null tensor of `weights` is 16-byte aligned (TMA needs it).
void check_weights_aligned(const ExpertWeights& weights, const char* name);
void launch_barrier(const kernels::layout::WorkspacePointers& p, kernels::layout::WaitId which,
                    cudaStream_t stream);
// The last launch of a forward (or recompute: write_out false) and of a backward: a staged GEMM's failure
// into the error record; once the record holds a failure, the call's outputs become NaN
// (src/gpu/finish_call.cu).
void launch_finish_forward(GpuWorkspace& workspace, const ForwardArgs& args, bool write_out,
                           cudaStream_t stream);
void launch_finish_backward(GpuWorkspace& workspace, const BackwardArgs& args, cudaStream_t stream);

// The parts of a forward both paths share (src/gpu/staged_forward.cu). The prologue checks every argument
// before it queues anything, then stages x, exchanges the routing (phase barrier) and builds the receive
// schedule; the epilogue waits at the combine barrier and writes out (unless `write_out` is false).
class StageTimer;
struct ForwardLaunch {
  int64_t num_tokens = 0;
  bool idx_int64 = false;
  kernels::ActivationParams activation;
};
// The prologue's argument checks alone (the fused forward runs the prologue's work inside its kernel).
ForwardLaunch check_forward_args(GpuWorkspace& workspace, const ForwardArgs& args, bool write_out);
ForwardLaunch launch_forward_prologue(GpuWorkspace& workspace, const ForwardArgs& args, bool write_out,
                                      StageTimer& timer, cudaStream_t stream);
void launch_forward_epilogue(GpuWorkspace& workspace, const ForwardArgs& args, const ForwardLaunch& launch,
                             bool write_out, StageTimer& timer, cudaStream_t stream);
// The epilogue's last kernel alone, out = shared y + sum_j w_j y_j (after the combine barrier).
void launch_weighted_sum(GpuWorkspace& workspace, const ForwardArgs& args, const ForwardLaunch& launch,
                         bool write_out, cudaStream_t stream);

// Launches the staged forward on `stream` (src/gpu/staged_forward.cu). `write_out` = false rebuilds the
// forward context only (recompute_forward_context).
void launch_staged_forward(GpuWorkspace& workspace, const ForwardArgs& args, cudaStream_t stream,
                           bool write_out);
// The same through the fused forward kernel (src/gpu/fused_forward.cu); bitwise the same results.
void launch_fused_forward(GpuWorkspace& workspace, const ForwardArgs& args, cudaStream_t stream,
                          bool write_out);

// The parts of a backward both paths share (src/gpu/staged_backward.cu). The prologue checks every argument
// before it queues anything, then stages d_out and the router weights, writes d_topk_weights and waits at
// the inputs barrier; the epilogue waits at the combine barrier and sums d_x.
struct BackwardLaunch {
  int64_t num_tokens = 0;
  kernels::ActivationParams activation;
};
BackwardLaunch launch_backward_prologue(GpuWorkspace& workspace, const BackwardArgs& args, StageTimer& timer,
                                        cudaStream_t stream);
void launch_backward_epilogue(GpuWorkspace& workspace, const BackwardArgs& args, const BackwardLaunch& launch,
                              StageTimer& timer, cudaStream_t stream);

// With a macrobatch ring: macrobatch b's x, g, u and act rows again (pull x, gate/up + activation), bitwise
// the forward's, on `replay` = pointers().macrobatch(b, MacrobatchRows::kReplay or kRestore), which shows
// rows only where that replay is due (src/gpu/staged_backward.cu: the staged backward's replay and both
// paths' restore; the fused backward replays inside its kernel).
void launch_forward_replay(GpuWorkspace& workspace, const BackwardArgs& args,
                           const kernels::ActivationParams& activation,
                           const kernels::layout::WorkspacePointers& replay, cudaStream_t stream);
// With a macrobatch ring, after the last macrobatch's backward: the resident last macrobatch's rows again, so
// the forward context is what the forward left (one replay when there are several macrobatches, else
// nothing).
void launch_context_restore(GpuWorkspace& workspace, const BackwardArgs& args,
                            const kernels::ActivationParams& activation, cudaStream_t stream);
// Launches the staged backward on `stream` (src/gpu/staged_backward.cu). Consumes the forward context the
// last forward (or recompute_forward_context) of this workspace left and leaves it as it was (with a ring,
// the resident macrobatch is replayed back at the end).
void launch_staged_backward(GpuWorkspace& workspace, const BackwardArgs& args, cudaStream_t stream);
// The same through the fused backward kernel (src/gpu/fused_backward.cu); bitwise the same gradients.
void launch_fused_backward(GpuWorkspace& workspace, const BackwardArgs& args, cudaStream_t stream);

// The opt-in dynamic shared-memory limit of `kKernel` (a persistent kernel holding the GEMM's stage ring),
// set once per device.
template <auto kKernel>
void set_shared_limit_once(int device, size_t bytes) {
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<bool>, kMaxDevices> ready{};
  POUNCE_CHECK(device >= 0 && device < kMaxDevices, "device index ", device, " beyond ", kMaxDevices);
  if (ready[device].load(std::memory_order_acquire)) return;
  POUNCE_CUDA(
      cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  ready[device].store(true, std::memory_order_release);
}

// Heuristics the fused kernels share (src/gpu/fused_forward.cu): whether the communication CTAs push the
// combine (else the second GEMM's epilogue scatters into the owners' slots), and how many there are.
enum class FusedPass { kForward, kBackward };
bool fused_push_combine(const GpuWorkspace& workspace);
int fused_comm_ctas(const GpuWorkspace& workspace, bool push_combine, int configured, FusedPass pass);
// Config::backward_kernel_path resolved (kAuto by shape: src/gpu/fused_backward.cu).
bool fused_backward_chosen(const GpuWorkspace& workspace);
int32_t fused_unit_blocks(const GpuWorkspace& workspace, bool push_combine);

}  // namespace pounce::gpu
