// The GPU backend's host side (src/gpu_backend.h): devices, NCCL groups, symmetric workspaces, entry points.
//
// Group of R > 1 ranks: ncclCommInitRank -> ncclDevCommCreate (device API check, lsaMultimem off) ->
// per workspace ncclMemAlloc + ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC) -> every peer's symmetric
// base read once with ncclGetLsaPointer into the workspace's peer map. NVLink multicast is never used.
// A group of one rank uses no NCCL at all (plain cudaMalloc). Only the CUDA runtime is linked (no libcuda).
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <sstream>
#include <thread>

#include "kernels/sched/macrobatch_plan.cuh"     // kMaxMacrobatches
#include "kernels/gemm/grouped_gemm_kernel.cuh"  // WaitError: the fused kernels' stage-ring failures
#include "src/gpu/gpu_state.h"
#include "src/validation.h"

namespace pounce::gpu {

void cuda_check(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  detail::fail("CUDA call failed: ", what, ": ", cudaGetErrorName(status), " (", cudaGetErrorString(status),
               ")");
}

namespace {

void nccl_check(ncclResult_t status, const char* what, const char* fix) {
  if (status == ncclSuccess) return;
  detail::fail("NCCL call failed: ", what, ": ", ncclGetErrorString(status), " (", ncclGetLastError(nullptr),
               "); ", fix);
}

// NVLink SHARP (multicast) is never used (docs/design.md §3): NCCL must not set it up behind our back.
void require_nvls_disabled() {
  const char* value = std::getenv("NCCL_NVLS_ENABLE");
  if (value == nullptr) {
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    return;
  }
  POUNCE_CHECK(std::strcmp(value, "0") == 0, "environment NCCL_NVLS_ENABLE = '", value,
               "': Pounce never uses NVLink multicast; unset it or set NCCL_NVLS_ENABLE=0");
}

__global__ void read_peer_bases_kernel(ncclWindow_t window, int num_ranks, uint64_t* peer_base) {
  for (int peer = static_cast<int>(threadIdx.x); peer < num_ranks; peer += blockDim.x) {
    peer_base[peer] = reinterpret_cast<uint64_t>(ncclGetLsaPointer(window, 0, peer));
  }
}

}  // namespace

DeviceGuard::DeviceGuard(int device) {
  POUNCE_CUDA(cudaGetDevice(&previous_));
  if (previous_ != device) POUNCE_CUDA(cudaSetDevice(device));
}
DeviceGuard::~DeviceGuard() {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
}

CommOwner::~CommOwner() {
  std::vector<std::thread> threads;
  for (Member& member : members) {
    threads.emplace_back([&member] {
      if (cudaSetDevice(member.device) != cudaSuccess) return;
      if (member.has_dev_comm) ncclDevCommDestroy(member.comm, &member.dev_comm);
      if (member.comm != nullptr) ncclCommDestroy(member.comm);
    });
  }
  for (std::thread& thread : threads) thread.join();
}

ncclComm_t GpuGroup::comm() const {
  return owner ? owner->members[owner->members.size() == 1 ? 0 : rank].comm : nullptr;
}
const ncclDevComm* GpuGroup::dev_comm() const {
  return owner ? &owner->members[owner->members.size() == 1 ? 0 : rank].dev_comm : nullptr;
}

// ---- devices ----

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return count;
}

std::string describe_devices() {
  std::ostringstream out;
  const int count = device_count();
  for (int device = 0; device < count; ++device) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) continue;
    out << "cuda:" << device << " " << prop.name << ", cc " << prop.major << "." << prop.minor << ", "
        << prop.multiProcessorCount << " SMs, " << (prop.totalGlobalMem >> 20) << " MiB, "
        << (prop.sharedMemPerBlockOptin >> 10) << " KiB smem/block";
    for (int peer = 0; peer < count; ++peer) {
      int access = 0;
      if (peer != device && cudaDeviceCanAccessPeer(&access, device, peer) == cudaSuccess && access) {
        out << ", peer cuda:" << peer;
      }
    }
    out << "\n";
  }
  return out.str();
}

std::string nccl_runtime_version() {
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess || version <= 0) return "";
  std::ostringstream out;
  out << version / 10000 << "." << (version / 100) % 100 << "." << version % 100;
  return out.str();
}

// ---- groups ----

std::vector<uint8_t> new_unique_id() {
  ncclUniqueId id;
  nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId", "check that NCCL can open a bootstrap socket");
  return std::vector<uint8_t>(id.internal, id.internal + NCCL_UNIQUE_ID_BYTES);
}

std::shared_ptr<GpuGroup> create_group(int rank, int num_ranks, const std::vector<uint8_t>& unique_id) {
  POUNCE_CHECK(num_ranks >= 1, "num_ranks = ", num_ranks, " must be at least 1");
  POUNCE_CHECK(rank >= 0 && rank < num_ranks, "rank = ", rank, " is out of range [0, num_ranks = ", num_ranks,
               ")");
  POUNCE_CHECK(device_count() > 0, "no CUDA GPU is visible: a GPU group needs one GPU per rank");
  auto group = std::make_shared<GpuGroup>();
  group->rank = rank;
  group->num_ranks = num_ranks;
  POUNCE_CUDA(cudaGetDevice(&group->device));
  if (num_ranks == 1) return group;  // EP = 1: no communicator, no NCCL call at all

  POUNCE_CHECK(unique_id.size() == NCCL_UNIQUE_ID_BYTES, "unique_id has ", unique_id.size(),
               " bytes; pass the ", NCCL_UNIQUE_ID_BYTES, " bytes of Group::new_unique_id() from rank 0");
  require_nvls_disabled();
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), NCCL_UNIQUE_ID_BYTES);

  auto owner = std::make_shared<CommOwner>();
  owner->members.resize(1);
  CommOwner::Member& member = owner->members[0];
  member.device = group->device;
  nccl_check(ncclCommInitRank(&member.comm, num_ranks, id, rank), "ncclCommInitRank",
             "every rank must call Group::create_nccl with the same unique_id and num_ranks");
  group->owner = owner;

  ncclDevCommRequirements requirements{};
  requirements.lsaMultimem = false;  // no NVLink multicast
  requirements.lsaBarrierCount = 1;
  const ncclResult_t status = ncclDevCommCreate(member.comm, &requirements, &member.dev_comm);
  POUNCE_CHECK(status == ncclSuccess, "ncclDevCommCreate failed (", ncclGetErrorString(status), ": ",
               ncclGetLastError(member.comm),
               "): this NCCL or this system does not offer the symmetric-memory device API that Pounce needs "
               "(NCCL >= 2.28 with GPUs joined by NVLink, load/store reachable)");
  member.has_dev_comm = true;
  POUNCE_CHECK(member.dev_comm.lsaSize == num_ranks && member.dev_comm.lsaRank == rank, "NCCL reports ",
               member.dev_comm.lsaSize, " of ", num_ranks, " ranks load/store reachable from rank ", rank,
               ": Pounce needs every rank of the group inside one NVLink domain for now (multi-node is a "
               "later transport)");
  return group;
}

std::vector<std::shared_ptr<GpuGroup>> create_local_groups(int num_ranks) {
  const int count = device_count();
  POUNCE_CHECK(num_ranks >= 1 && num_ranks <= count, "num_ranks = ", num_ranks, " but this process sees ",
               count, " CUDA GPU(s): one rank per GPU, so ask for at most ", count,
               " (CUDA_VISIBLE_DEVICES selects them)");
  std::vector<std::shared_ptr<GpuGroup>> groups(num_ranks);
  if (num_ranks == 1) {
    DeviceGuard guard(0);
    groups[0] = create_group(0, 1, {});
    return groups;
  }
  require_nvls_disabled();
  const std::vector<uint8_t> unique_id = new_unique_id();
  std::vector<std::exception_ptr> errors(num_ranks);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < num_ranks; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        POUNCE_CUDA(cudaSetDevice(rank));
        groups[rank] = create_group(rank, num_ranks, unique_id);
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const std::exception_ptr& error : errors) {
    if (error) std::rethrow_exception(error);
  }
  // One owner for all communicators: whichever thread drops the last group releases them together.
  auto owner = std::make_shared<CommOwner>();
  for (auto& group : groups) {
    owner->members.push_back(group->owner->members[0]);
    group->owner->members.clear();
  }
  for (auto& group : groups) group->owner = owner;
  return groups;
}

// ---- workspace ----

kernels::layout::WorkspacePointers GpuWorkspace::pointers() const {
  const kernels::layout::WorkspaceLayout& l = layout;
  char* loc = static_cast<char*>(local);
  auto at = [loc](int64_t offset) { return static_cast<void*>(loc + offset); };
  kernels::layout::WorkspacePointers p{};
  p.rank = rank;
  p.num_ranks = static_cast<int32_t>(l.num_ranks);
  p.num_local_experts = static_cast<int32_t>(l.num_local_experts);
  p.num_experts = static_cast<int32_t>(l.num_experts);
  p.num_topk = static_cast<int32_t>(l.num_topk);
  p.hidden = l.hidden;
  p.intermediate = l.intermediate;
  p.shared_intermediate = l.shared_intermediate;
  p.max_tokens = l.max_tokens;
  p.rows_capacity = l.rows_capacity;
  p.token_capacity = l.token_capacity;
  p.routing_stride = l.routing_stride;
  p.max_chunks = l.max_chunks;
  p.timeout_ns = timeout_ns;
  p.profile_tiles = profile_stages ? 1 : 0;
  p.injected_wait = injected_wait;
  p.symmetric = static_cast<char*>(symmetric);
  p.peer_base = static_cast<const uint64_t*>(at(l.loc_peer_base));
  p.sym_barrier_inbox = l.sym_barrier_inbox;
  p.sym_routing_tokens = l.sym_routing_tokens;
  p.sym_routing_idx = l.sym_routing_idx;
  p.sym_x = l.sym_x;
  p.sym_y_slots = l.sym_y_slots;
  p.sym_d_out = l.sym_d_out;
  p.sym_topk_weights = l.sym_topk_weights;
  p.sym_dx_slots = l.sym_dx_slots;
  p.barrier_epoch = static_cast<uint32_t*>(at(l.loc_barrier_epoch));
  p.error_claim = static_cast<int32_t*>(at(l.loc_error_claim));
  p.error = error_device;
  p.chunk_counts = static_cast<int32_t*>(at(l.loc_chunk_counts));
  p.expert_src_count = static_cast<int32_t*>(at(l.loc_expert_src_count));
  p.group_row_offset = static_cast<int32_t*>(at(l.loc_group_row_offset));
  p.group_rows = static_cast<int32_t*>(at(l.loc_group_rows));
  p.shared_row_offset = static_cast<int32_t*>(at(l.loc_shared_row_offset));
  p.schedule = static_cast<kernels::layout::ScheduleEntry*>(at(l.loc_schedule));
  p.ring_rows = l.ring_rows;
  p.max_macrobatches = static_cast<int32_t>(l.max_macrobatches);
  const bool ring = l.ring_rows < l.rows_capacity;
  p.macrobatch_plan = ring ? static_cast<int32_t*>(at(l.loc_macrobatch_plan)) : nullptr;
  p.macrobatch_offsets = ring ? static_cast<int32_t*>(at(l.loc_macrobatch_offsets)) : nullptr;
  p.macrobatch_owned = ring ? static_cast<int32_t*>(at(l.loc_macrobatch_owned)) : nullptr;
  p.macrobatch_schedule =
      ring ? static_cast<kernels::layout::ScheduleEntry*>(at(l.loc_macrobatch_schedule)) : nullptr;
  p.x_rows = at(l.loc_x_rows);
  p.g_rows = at(l.loc_g_rows);
  p.u_rows = at(l.loc_u_rows);
  p.act_rows = at(l.loc_act_rows);
  p.y_rows = at(l.loc_y_rows);
  p.shared_g = at(l.loc_shared_g);
  p.shared_u = at(l.loc_shared_u);
  p.shared_act = at(l.loc_shared_act);
  p.shared_y = at(l.loc_shared_y);
  p.fused_counters = static_cast<uint32_t*>(at(l.loc_fused_counters));
  p.dy_rows = at(l.loc_dy_rows);
  p.d_gu_rows = at(l.loc_d_gu_rows);
  p.dx_rows = at(l.loc_dx_rows);
  p.shared_d_gu = at(l.loc_shared_d_gu);
  p.shared_dx = at(l.loc_shared_dx);
  if (l.fp8) {
    auto bytes = [&](int64_t offset) { return static_cast<uint8_t*>(at(offset)); };
    auto floats = [&](int64_t offset) { return static_cast<float*>(at(offset)); };
    p.sym_x_q = l.sym_x_q;
    p.sym_x_scale = l.sym_x_scale;
    p.fp8_x_rows = bytes(l.loc_fp8_x_rows);
    p.fp8_x_scale = floats(l.loc_fp8_x_scale);
    p.fp8_act_rows = bytes(l.loc_fp8_act_rows);
    p.fp8_act_scale = floats(l.loc_fp8_act_scale);
    p.fp8_dy_rows = bytes(l.loc_fp8_dy_rows);
    p.fp8_dy_scale = floats(l.loc_fp8_dy_scale);
    p.fp8_d_a = at(l.loc_fp8_d_a);
    p.fp8_dg_rows = bytes(l.loc_fp8_dg_rows);
    p.fp8_dg_scale = floats(l.loc_fp8_dg_scale);
    p.fp8_du_rows = bytes(l.loc_fp8_du_rows);
    p.fp8_du_scale = floats(l.loc_fp8_du_scale);
    p.fp8_x_t = bytes(l.loc_fp8_x_t);
    p.fp8_x_t_scale = floats(l.loc_fp8_x_t_scale);
    p.fp8_act_t = bytes(l.loc_fp8_act_t);
    p.fp8_act_t_scale = floats(l.loc_fp8_act_t_scale);
    p.fp8_dy_t = bytes(l.loc_fp8_dy_t);
    p.fp8_dy_t_scale = floats(l.loc_fp8_dy_t_scale);
    p.fp8_dgu_t = bytes(l.loc_fp8_dgu_t);
    p.fp8_dgu_t_scale = floats(l.loc_fp8_dgu_t_scale);
  }
  return p;
}

namespace {

void destroy_workspace(GpuWorkspace* workspace) {
  if (workspace == nullptr) return;
  if (cudaSetDevice(workspace->device) == cudaSuccess) {
    cudaDeviceSynchronize();  // peers may still read or write this rank's symmetric memory: see below
    if (workspace->window != nullptr) {
      // Collective: returns once every rank deregistered, i.e. after every rank's work finished.
      ncclCommWindowDeregister(workspace->group->comm(), workspace->window);
      ncclMemFree(workspace->symmetric);
    } else if (workspace->symmetric != nullptr) {
      cudaFree(workspace->symmetric);
    }
    if (workspace->local != nullptr) cudaFree(workspace->local);
    if (workspace->error_host != nullptr) cudaFreeHost(workspace->error_host);
    if (workspace->side_stream != nullptr) cudaStreamDestroy(workspace->side_stream);
    if (workspace->comm_stream != nullptr) cudaStreamDestroy(workspace->comm_stream);
    for (cudaEvent_t event : workspace->events) cudaEventDestroy(event);
  }
  delete workspace;
}

void validate_workspace_shape(const GpuGroup& group, int rank, const Shape& shape, const Config& config,
                              const kernels::layout::WorkspaceLayout& l) {
  POUNCE_CHECK(shape.num_ranks == group.num_ranks, "shape.num_ranks = ", shape.num_ranks,
               " but the group has ", group.num_ranks, " ranks; set shape.num_ranks to the group size");
  POUNCE_CHECK(rank == group.rank, "rank = ", rank, " but the group is rank ", group.rank);
  POUNCE_CHECK(shape.hidden % 64 == 0, "shape.hidden = ", shape.hidden,
               " must be a multiple of 64 for the GPU GEMMs; pad the model dimension");
  POUNCE_CHECK(shape.intermediate % 64 == 0, "shape.intermediate = ", shape.intermediate,
               " must be a multiple of 64 for the GPU GEMMs");
  // Row indices and GEMM tile counters are 32-bit on the device: reject shapes beyond them here, before any
  // call can queue work that a launcher would refuse halfway.
  POUNCE_CHECK(
      l.rows_capacity < (int64_t{1} << 31) && l.rows_capacity / kernels::layout::kBlockM < (int64_t{1} << 24),
      "the dropless worst case needs ", l.rows_capacity,
      " expert rows per rank, beyond the 32-bit row indices of the GPU kernels; lower max_tokens or "
      "num_topk per rank");
  POUNCE_CHECK(shape.shared_intermediate % 64 == 0, "shape.shared_intermediate = ", shape.shared_intermediate,
               " must be 0 or a multiple of 64 for the GPU GEMMs");
  POUNCE_CHECK(l.rows_capacity < (int64_t{1} << 31) && shape.max_tokens * shape.num_topk < (int64_t{1} << 31),
               "the worst-case receive schedule (", l.rows_capacity,
               " rows for max_tokens = ", shape.max_tokens,
               ") does not fit 32-bit row indices; lower max_tokens");
  POUNCE_CHECK(l.max_macrobatches <= kernels::sched::kMaxMacrobatches,
               "config.macrobatch_size = ", config.macrobatch_size, " cuts the worst case of ",
               l.rows_capacity, " rows into up to ", l.max_macrobatches, " macrobatches, more than ",
               kernels::sched::kMaxMacrobatches, "; raise macrobatch_size");
}

}  // namespace

namespace {

// Every rank's shape and config (WorkspaceFields, the fields the CPU backend compares too), gathered before
// anything is checked or allocated: a rank created with another max_tokens, hidden or top-k would make its
// peers write at wrong offsets, another kernel path or comm SM count would leave them at different barriers.
// One all-gather over the group's communicator, so every rank reaches the same verdict and throws the same
// message naming the first field that differs. A rank that fails before it (an invalid shape of its own)
// never arrives: its peers wait in NCCL, unbounded until the communicators can be aborted.
void check_ranks_agree(const GpuGroup& group, int rank, const Shape& shape, const Config& config) {
  const int R = group.num_ranks;
  if (R == 1) return;
  constexpr int kCount = WorkspaceFields::kCount;
  const WorkspaceFields mine = WorkspaceFields::of(shape, config);
  std::vector<int64_t> all(static_cast<size_t>(R) * kCount);
  int64_t* gathered = nullptr;
  POUNCE_CUDA(cudaMalloc(&gathered, all.size() * sizeof(int64_t)));
  const auto release = [&] { cudaFree(gathered); };
  try {
    POUNCE_CUDA(cudaMemcpy(gathered + static_cast<size_t>(rank) * kCount, mine.values.data(),
                           kCount * sizeof(int64_t), cudaMemcpyHostToDevice));
    nccl_check(ncclAllGather(gathered + static_cast<size_t>(rank) * kCount, gathered, kCount, ncclInt64,
                             group.comm(), nullptr),
               "ncclAllGather (workspace agreement)", "every rank must create the workspace together");
    POUNCE_CUDA(cudaMemcpy(all.data(), gathered, all.size() * sizeof(int64_t), cudaMemcpyDeviceToHost));
  } catch (...) {
    release();
    throw;
  }
  release();
  std::vector<WorkspaceFields> ranks(R);
  for (int r = 0; r < R; ++r)
    std::copy_n(all.begin() + static_cast<ptrdiff_t>(r) * kCount, kCount, ranks[r].values.begin());
  const std::string disagreement = workspace_disagreement(ranks);
  POUNCE_CHECK(disagreement.empty(), disagreement);
}

}  // namespace

GpuWorkspacePtr create_workspace(std::shared_ptr<GpuGroup> group, int rank, const Shape& shape,
                                 const Config& config, const Environment& environment) {
  POUNCE_CHECK(group != nullptr, "create_workspace needs a GPU group");
  {
    DeviceGuard agreement_guard(group->device);
    check_ranks_agree(*group, group->rank, shape, config);
  }
  const kernels::layout::WorkspaceLayout l = kernels::layout::WorkspaceLayout::make(
      shape.max_tokens, shape.hidden, shape.intermediate, shape.shared_intermediate, shape.num_experts,
      shape.num_topk, shape.num_ranks, config.macrobatch_size, config.precision == Precision::kFP8);
  validate_workspace_shape(*group, rank, shape, config, l);
  DeviceGuard guard(group->device);

  GpuWorkspacePtr workspace(new GpuWorkspace, destroy_workspace);
  GpuWorkspace& ws = *workspace;
  ws.group = group;
  ws.rank = rank;
  ws.device = group->device;
  ws.shape = shape;
  ws.config = config;
  ws.layout = l;
  ws.timeout_ns = static_cast<uint64_t>(environment.peer_timeout.count()) * 1'000'000;
  ws.profile_stages = environment.profile_stages;
  POUNCE_CUDA(cudaDeviceGetAttribute(&ws.num_sms, cudaDevAttrMultiProcessorCount, ws.device));
  POUNCE_CUDA(cudaStreamCreateWithFlags(&ws.side_stream, cudaStreamNonBlocking));
  POUNCE_CUDA(cudaStreamCreateWithFlags(&ws.comm_stream, cudaStreamNonBlocking));
  ws.events.resize(kOverlapEvents);
  for (cudaEvent_t& event : ws.events) POUNCE_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  POUNCE_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&ws.error_host),
                            sizeof(kernels::layout::DeviceErrorRecord), cudaHostAllocMapped));
  std::memset(ws.error_host, 0, sizeof(kernels::layout::DeviceErrorRecord));
  POUNCE_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ws.error_device), ws.error_host, 0));

  POUNCE_CUDA(cudaMalloc(&ws.local, l.local_bytes));
  POUNCE_CUDA(cudaMemset(ws.local, 0, l.local_bytes));
  uint64_t* peer_base = reinterpret_cast<uint64_t*>(static_cast<char*>(ws.local) + l.loc_peer_base);
  if (group->num_ranks == 1) {
    POUNCE_CUDA(cudaMalloc(&ws.symmetric, l.symmetric_bytes));
    POUNCE_CUDA(cudaMemset(ws.symmetric, 0, l.symmetric_bytes));
    const uint64_t base = reinterpret_cast<uint64_t>(ws.symmetric);
    POUNCE_CUDA(cudaMemcpy(peer_base, &base, sizeof(base), cudaMemcpyHostToDevice));
  } else {
    nccl_check(ncclMemAlloc(&ws.symmetric, l.symmetric_bytes), "ncclMemAlloc",
               "free device memory or lower max_tokens (Workspace::bytes_required gives the size)");
    // Zeroed (barrier inboxes included) before the collective registration, which no rank leaves before
    // every rank entered it: no peer can arrive at a barrier of this workspace before it is zero.
    POUNCE_CUDA(cudaMemset(ws.symmetric, 0, l.symmetric_bytes));
    POUNCE_CUDA(cudaDeviceSynchronize());
    const ncclResult_t status = ncclCommWindowRegister(group->comm(), ws.symmetric, l.symmetric_bytes,
                                                       &ws.window, NCCL_WIN_COLL_SYMMETRIC);
    if (status != ncclSuccess) {
      ws.window = nullptr;
      detail::fail(
          "ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC) failed (", ncclGetErrorString(status), ": ",
          ncclGetLastError(group->comm()),
          "): symmetric memory registration is unavailable; Pounce needs NCCL >= 2.28 symmetric windows "
          "over NVLink (every rank must create the workspace with the same shape and config)");
    }
    read_peer_bases_kernel<<<1, 32>>>(ws.window, group->num_ranks, peer_base);
    POUNCE_CUDA(cudaGetLastError());
  }
  POUNCE_CUDA(cudaDeviceSynchronize());
  return workspace;
}

// ---- errors ----

namespace {
const char* wait_name(kernels::layout::WaitId id) {
  switch (id) {
    case kernels::layout::WaitId::kRoutingBarrier:
      return "forward routing";
    case kernels::layout::WaitId::kCombineBarrier:
      return "forward combine";
    case kernels::layout::WaitId::kBackwardInputsBarrier:
      return "backward inputs (d_out staged)";
    case kernels::layout::WaitId::kBackwardCombineBarrier:
      return "backward combine (d_x pushed)";
    case kernels::layout::WaitId::kFusedRowsReady:
      return "fused forward: minibatch rows pulled";
    case kernels::layout::WaitId::kFusedGateUpDone:
      return "fused forward: gate/up tiles of an m-block";
    case kernels::layout::WaitId::kFusedRowsDone:
      return "fused forward: down tiles of a minibatch, before its push";
    case kernels::layout::WaitId::kFusedTaskHandoff:
      return "fused kernel: task or stage handoff inside a CTA";
    case kernels::layout::WaitId::kFusedBackwardRowsReady:
      return "fused backward: minibatch dy rows pulled";
    case kernels::layout::WaitId::kFusedActGradDone:
      return "fused backward: d_a tiles of an m-block";
    case kernels::layout::WaitId::kFusedBackwardRowsDone:
      return "fused backward: d_x tiles of a minibatch, before its push";
    case kernels::layout::WaitId::kFusedGridStep:
      return "fused forward: a grid-wide step (index 0 routing, 1 schedule count, 2 schedule placed, 3 "
             "finished)";
    case kernels::layout::WaitId::kFusedReplayRowsReady:
      return "fused backward: minibatch x rows pulled again (macrobatch replay)";
    case kernels::layout::WaitId::kFusedReplayDone:
      return "fused backward: replayed gate/up tiles of an m-block";
    case kernels::layout::WaitId::kFusedRingFree:
      return "fused forward: the previous macrobatch's ring rows (down tiles stored, rows pushed)";
    case kernels::layout::WaitId::kStagedGemm:
      return "staged GEMM: its stage ring";
    case kernels::layout::WaitId::kNone:
      break;
  }
  return "unknown";
}
}  // namespace

void check_device_errors(GpuWorkspace& workspace) {
  volatile kernels::layout::DeviceErrorRecord* record = workspace.error_host;
  const int32_t code = record->code;
  if (code == 0) return;
  std::atomic_thread_fence(std::memory_order_acquire);
  const kernels::layout::DeviceErrorRecord copy{code,          record->wait_id,  record->rank,
                                                record->peer,  record->expected, record->observed,
                                                record->token, record->slot};
  // Clear for the next call: host record first, then the device claim flag and the GEMM error word on a
  // private stream. A fused kernel's stage-ring failure leaves its GEMM WaitError in that word: read it for
  // the message (the kernel has ended: the record is written last by a failing CTA).
  record->code = 0;
  int32_t gemm_error = 0;
  {
    DeviceGuard guard(workspace.device);
    const auto p = workspace.pointers();
    if (copy.wait_id == static_cast<int32_t>(kernels::layout::WaitId::kFusedTaskHandoff)) {
      POUNCE_CUDA(cudaMemcpyAsync(&gemm_error, p.gemm_error(), sizeof(gemm_error), cudaMemcpyDeviceToHost,
                                  workspace.side_stream));
    }
    POUNCE_CUDA(cudaMemsetAsync(p.error_claim, 0, sizeof(int32_t), workspace.side_stream));
    POUNCE_CUDA(cudaMemsetAsync(p.gemm_error(), 0, sizeof(int32_t), workspace.side_stream));
    POUNCE_CUDA(cudaStreamSynchronize(workspace.side_stream));
  }
  std::ostringstream out;
  switch (static_cast<kernels::layout::DeviceErrorCode>(copy.code)) {
    case kernels::layout::DeviceErrorCode::kWaitTimeout: {
      const char* which = wait_name(static_cast<kernels::layout::WaitId>(copy.wait_id));
      if (copy.wait_id == static_cast<int32_t>(kernels::layout::WaitId::kStagedGemm)) {
        if (copy.observed == static_cast<int32_t>(kernels::gemm::WaitError::kRowsExceedCapacity)) {
          out << "a staged GEMM on rank " << copy.rank
              << " got more rows than the workspace holds (the excess "
              << "rows were skipped); a token names the same expert in several slots";
        } else {
          out << "GPU wait timed out inside a staged GEMM on rank " << copy.rank << ": "
              << (copy.observed == static_cast<int32_t>(kernels::gemm::WaitError::kFullStage)
                      ? "a consumer waited for a stage's TMA bytes"
                      : "the producer waited for a free stage")
              << " longer than POUNCE_PEER_TIMEOUT_S (another kernel holding SMs, or a fault of the GPU?)";
        }
        break;
      }
      if (copy.wait_id >= static_cast<int32_t>(kernels::layout::WaitId::kFusedRowsReady)) {
        out << "GPU wait timed out inside the fused kernel on rank " << copy.rank << ": " << which
            << " (index " << copy.peer << ", expected " << copy.expected << ", observed " << copy.observed;
        if (gemm_error == static_cast<int32_t>(kernels::gemm::WaitError::kFullStage)) {
          out << "; a consumer waited for a stage's TMA bytes";
        } else if (gemm_error == static_cast<int32_t>(kernels::gemm::WaitError::kEmptyStage)) {
          out << "; the producer waited for a free stage";
        }
        out << ") longer than POUNCE_PEER_TIMEOUT_S; a CTA of the kernel failed or never started (another "
               "kernel holding SMs?). Config.kernel_path (forward) or backward_kernel_path = "
               "KernelPath::kStaged "
               "runs the stage kernels "
               "instead";
        break;
      }
      out << "GPU wait timed out: rank " << copy.rank << " waited at the " << which << " barrier for rank "
          << copy.peer << " (expected epoch " << copy.expected << ", observed " << copy.observed
          << ") longer than POUNCE_PEER_TIMEOUT_S; every rank must call forward/backward with its workspace "
             "(is a rank stuck or dead?). The group's barrier state is now inconsistent: recreate the "
             "workspaces";
      break;
    }
    case kernels::layout::DeviceErrorCode::kExpertOutOfRange:
      out << "topk_idx value out of range: rank " << copy.rank << " found topk_idx[" << copy.token << ", "
          << copy.slot << "] = " << copy.observed << " of source rank " << copy.peer << ", outside [-1, "
          << copy.expected
          << "); expert ids must be global ids below num_experts, or -1 (that slot was skipped)";
      break;
    case kernels::layout::DeviceErrorCode::kScheduleOverflow:
      out << "receive schedule overflow on rank " << copy.rank << ": the routing needs " << copy.observed
          << " rows but the worst case (k rows per token, padded) is " << copy.expected
          << "; no routing can get there: a fault of the schedule (rows beyond the capacity were dropped)";
      break;
    case kernels::layout::DeviceErrorCode::kMacrobatchOverflow:
      out << "macrobatch overflow on rank " << copy.rank << ": local expert " << copy.token << " receives "
          << copy.observed << " rows (padded) but config.macrobatch_size is " << copy.expected
          << "; a token names the same expert in several slots. The routed experts computed nothing in this "
             "call; raise macrobatch_size (0 = the worst case) or give every token distinct experts";
      break;
    default:
      out << "unknown device error code " << copy.code << " on rank " << copy.rank;
  }
  throw Error(out.str());
}

void synchronize(GpuWorkspace& workspace, void* stream) {
  DeviceGuard guard(workspace.device);
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  POUNCE_CUDA(cudaStreamIsCapturing(cuda_stream, &capture));
  POUNCE_CHECK(
      capture == cudaStreamCaptureStatusNone,
      "check_errors(synchronize = true) on a stream that is capturing a CUDA graph (nothing captured "
      "has run yet); pass synchronize = false there, and check with synchronize = true after the "
      "graph's replay");
  POUNCE_CUDA(cudaStreamSynchronize(cuda_stream));
}

ForwardContextView forward_context(const GpuWorkspace& workspace) {
  const kernels::layout::WorkspacePointers p = workspace.pointers();
  ForwardContextView view;
  view.schedule = reinterpret_cast<const int32_t*>(p.schedule);
  view.group_row_offset = p.group_row_offset;
  view.group_rows = p.group_rows;
  view.expert_src_count = p.expert_src_count;
  view.x_rows = p.x_rows;
  view.act_rows = p.act_rows;
  view.y_rows = p.y_rows;
  view.y_slots = p.local_sym<const void>(p.sym_y_slots);
  view.shared_y = workspace.shape.shared_intermediate > 0 ? p.shared_y : nullptr;
  view.rows_capacity = p.rows_capacity;
  view.ring_rows = p.ring_rows;
  return view;
}

int device_of(const GpuWorkspace& workspace) {
  return workspace.device;
}

void inject_wait_failure(GpuWorkspace& workspace, int32_t wait_id) {
  POUNCE_CHECK(wait_id >= static_cast<int32_t>(kernels::layout::WaitId::kRoutingBarrier) &&
                   wait_id <= static_cast<int32_t>(kernels::layout::WaitId::kStagedGemm),
               "inject_wait_failure: wait_id = ", wait_id, " is not a kernels::layout::WaitId (1 to 16)");
  workspace.injected_wait = wait_id;
}

void set_kernel_path(GpuWorkspace& workspace, KernelPath path) {
  workspace.config.kernel_path = path;
}

// ---- passes ----

namespace {
void check_forward_supported(GpuWorkspace& workspace) {
  check_device_errors(workspace);
}

// FP8 runs the staged chain: the fused kernels are BF16 only so far.
bool fused_forward_chosen(const GpuWorkspace& workspace) {
  return workspace.config.kernel_path != KernelPath::kStaged &&
         workspace.config.precision == Precision::kBF16;
}

void launch_forward(GpuWorkspace& workspace, const ForwardArgs& args, cudaStream_t stream, bool write_out) {
  if (fused_forward_chosen(workspace)) {  // kAuto: the fused kernel
    launch_fused_forward(workspace, args, stream, write_out);
  } else {
    launch_staged_forward(workspace, args, stream, write_out);
  }
}

int64_t num_tokens_of(const ForwardArgs& args) {
  return args.x.shape.empty() ? 0 : args.x.shape[0];
}

// An injected wait failure (tests) applies to one call: the one this guard's scope holds.
struct InjectionSpent {
  GpuWorkspace& workspace;
  ~InjectionSpent() { workspace.injected_wait = 0; }
};
}  // namespace

void forward(GpuWorkspace& workspace, const ForwardArgs& args, void* stream) {
  check_forward_supported(workspace);
  const InjectionSpent spent{workspace};
  workspace.context_tokens = -1;  // a launch that throws halfway leaves no usable context behind
  launch_forward(workspace, args, static_cast<cudaStream_t>(stream), /*write_out=*/true);
  launch_finish_forward(workspace, args, /*write_out=*/true, static_cast<cudaStream_t>(stream));
  workspace.context_tokens = num_tokens_of(args);
}

void recompute_forward_context(GpuWorkspace& workspace, const ForwardArgs& args, void* stream) {
  check_forward_supported(workspace);
  const InjectionSpent spent{workspace};
  workspace.context_tokens = -1;
  launch_forward(workspace, args, static_cast<cudaStream_t>(stream), /*write_out=*/false);
  launch_finish_forward(workspace, args, /*write_out=*/false, static_cast<cudaStream_t>(stream));
  workspace.context_tokens = num_tokens_of(args);
}

void backward(GpuWorkspace& workspace, const BackwardArgs& args, void* stream) {
  check_forward_supported(workspace);
  const InjectionSpent spent{workspace};
  POUNCE_CHECK(workspace.context_tokens >= 0,
               "backward called before forward (or recompute_forward_context) on this workspace; run forward "
               "first");
  POUNCE_CHECK(workspace.context_tokens == num_tokens_of(args.inputs), "backward got ",
               num_tokens_of(args.inputs), " tokens but the forward context holds ", workspace.context_tokens,
               "; pass the inputs of the matching forward");
  if (fused_backward_chosen(workspace)) {
    launch_fused_backward(workspace, args, static_cast<cudaStream_t>(stream));
  } else {
    launch_staged_backward(workspace, args, static_cast<cudaStream_t>(stream));
  }
  launch_finish_backward(workspace, args, static_cast<cudaStream_t>(stream));
}

}  // namespace pounce::gpu
