// The seam between the host API and the GPU backend (src/gpu/). Built only with CUDA; without it
// src/no_gpu/ provides the same functions, each failing with a message that says how to get a GPU build.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pounce/layer.h"
#include "src/environment.h"

namespace pounce::gpu {

struct GpuGroup;      // NCCL communicator + device communicator (src/gpu/)
struct GpuWorkspace;  // symmetric + local device buffers, forward context (src/gpu/)

int device_count();                  // 0 when no driver or no GPU (never throws)
std::string describe_devices();      // one line per GPU for `pounce info`; "" when none
std::string nccl_runtime_version();  // "" when unknown

std::vector<uint8_t> new_unique_id();
std::shared_ptr<GpuGroup> create_group(int rank, int num_ranks, const std::vector<uint8_t>& unique_id);
std::vector<std::shared_ptr<GpuGroup>> create_local_groups(int num_ranks);
// torchrun / mpirun environment: sets the device to LOCAL_RANK; returns the rank and group size too.
std::shared_ptr<GpuGroup> create_group_from_env(int* rank, int* num_ranks);

// Owning handle; the deleter frees device memory (collective deregistration on GPUs).
using GpuWorkspacePtr = std::unique_ptr<GpuWorkspace, void (*)(GpuWorkspace*)>;
GpuWorkspacePtr create_workspace(std::shared_ptr<GpuGroup> group, int rank, const Shape& shape,
                                 const Config& config, const Environment& environment);

int device_of(const GpuWorkspace& workspace);  // the CUDA device index its memory and kernels are on

void forward(GpuWorkspace& workspace, const ForwardArgs& args, void* stream);
void backward(GpuWorkspace& workspace, const BackwardArgs& args, void* stream);
void recompute_forward_context(GpuWorkspace& workspace, const ForwardArgs& args, void* stream);

// Kernels record their failures (a bounded wait on a peer timed out, a topk_idx value out of range, more
// schedule rows than the worst case) in a host-mapped record instead of trapping. This reads it without
// synchronising: when set, it clears it and throws pounce::Error describing the first failure. Call it
// after synchronising a stream to check that work; forward/backward call it on entry, so a failure of
// earlier work surfaces at the next call at the latest. pounce::check_errors is its public face.
void check_device_errors(GpuWorkspace& workspace);
// Waits for `stream`'s work on the workspace's device (pounce::check_errors(..., synchronize = true));
// throws pounce::Error when `stream` is being captured into a CUDA graph.
void synchronize(GpuWorkspace& workspace, void* stream);

// Device pointers into the forward context, for tests and debugging (read after synchronising).
struct ForwardContextView {
  const int32_t* schedule = nullptr;          // [rows_capacity][4]: src_rank, src_token, slot, -1
  const int32_t* group_row_offset = nullptr;  // [El + 1], padded segment offsets
  const int32_t* group_rows = nullptr;        // [El], rows of each segment holding data
  const int32_t* expert_src_count = nullptr;  // [El][R], pairs per (local expert, source rank)
  const void* x_rows = nullptr;               // bf16 [rows_capacity][H]
  const void* act_rows = nullptr;             // bf16 [rows_capacity][I]
  const void* y_rows =
      nullptr;  // bf16 [rows_capacity][H]; staged path only (the fused kernel stores y into the slots)
  const void* y_slots = nullptr;   // bf16 [max_tokens][k][H], this rank's tokens
  const void* shared_y = nullptr;  // bf16 [round_up(max_tokens, 128)][H]; null when Is = 0
  int64_t rows_capacity = 0;
  int64_t ring_rows = 0;  // rows of x_rows, act_rows, y_rows: rows_capacity, or the macrobatch ring's (the
                          // last macrobatch's rows, ring-relative)
};
ForwardContextView forward_context(const GpuWorkspace& workspace);
// Tests' fault injection: the next forward, recompute_forward_context or backward on `workspace` fails wait
// `wait_id` (a kernels::layout::WaitId, 1 to 16) wherever it uses it, at once, as if the wait's bound had run
// out; the record, the error raised and the NaN outputs are those of a real timeout. The call after it runs
// clean. Meant for eager calls: a CUDA graph captured by that call keeps the failure in every replay.
void inject_wait_failure(GpuWorkspace& workspace, int32_t wait_id);
// Switches the forward path of an existing workspace (tests compare fused and staged on one workspace).
void set_kernel_path(GpuWorkspace& workspace, KernelPath path);

}  // namespace pounce::gpu
