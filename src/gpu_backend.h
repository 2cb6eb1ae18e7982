// The seam between the host API and the GPU backend (src/gpu/). Built only with CUDA; without it
// src/no_gpu/ provides the same functions, each failing with a message that says how to get a GPU build.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pounce/layer.h"

namespace pounce::gpu {

struct GpuGroup;      // NCCL communicator + device communicator (src/gpu/)
struct GpuWorkspace;  // symmetric + local device buffers, forward context (src/gpu/)

int device_count();  // 0 when no driver or no GPU (never throws)
std::string describe_devices();  // one line per GPU for `pounce info`; "" when none
std::string nccl_runtime_version();  // "" when unknown

std::vector<uint8_t> new_unique_id();
std::shared_ptr<GpuGroup> create_group(int rank, int num_ranks, const std::vector<uint8_t>& unique_id);
std::vector<std::shared_ptr<GpuGroup>> create_local_groups(int num_ranks);

// Owning handle; the deleter frees device memory (collective deregistration on GPUs).
using GpuWorkspacePtr = std::unique_ptr<GpuWorkspace, void (*)(GpuWorkspace*)>;
GpuWorkspacePtr create_workspace(std::shared_ptr<GpuGroup> group, int rank, const Shape& shape,
                                 const Config& config);
WorkspaceBytes workspace_bytes(const Shape& shape, const Config& config);

void forward(GpuWorkspace& workspace, const ForwardArgs& args, void* stream);
void backward(GpuWorkspace& workspace, const BackwardArgs& args, void* stream);
void recompute_forward_context(GpuWorkspace& workspace, const ForwardArgs& args, void* stream);
// Throws pounce::Error when a kernel of this workspace recorded a timed-out wait or bad routing.
void check_device_errors(GpuWorkspace& workspace);

}  // namespace pounce::gpu
