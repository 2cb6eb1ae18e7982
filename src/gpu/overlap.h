// Communication/compute overlap of the staged passes. Token transfers (dispatch pull, combine push and their
// backward mirrors) run on the workspace's comm stream with `comm_sms` blocks, one per SM; the GEMMs run on
// the caller's stream with their persistent grid capped at the remaining SMs. Local experts are cut into
// chunks: the GEMMs of chunk c start when its rows have arrived, and its outputs leave while chunk c + 1
// computes. Every handoff is a CUDA event, so a captured graph holds the same fork/join edges.
//
// Heuristic (docs/design.md, "Overlap"; the sweep: docs/experiments/002-staged-overlap-sweep.md): a routed
// row moves 2H bytes per 6HI flops, so transfers weigh ~1/I against the GEMMs. Comm-heavy shapes (I < 1024,
// e.g. qwen3: 768) get 20 communication SMs, the rest 12 (NVLink saturates with 16-32 SMs on H200; a
// GEMM-bound shape loses more to the SMs it gives up than it gains); one rank moves rows within HBM and
// gets 12. chunks = min(El, 8). config.forward/backward_comm_sms and minibatch_size (rows per chunk:
// chunks = ceil(max_tokens * k / minibatch_size), at most El and kMaxChunks) override.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "src/gpu/gpu_state.h"

namespace pounce::gpu {

inline constexpr int kCommHeavyCommSms = 20;
inline constexpr int kDefaultCommSms = 12;
inline constexpr int64_t kCommHeavyIntermediate = 1024;
inline constexpr int kDefaultChunks = 8;
inline constexpr int kMaxChunks = 16;      // 2 events per chunk and pass fit kOverlapEvents
inline constexpr int kCommThreads = 1024;  // one block per communication SM

class Overlap {
 public:
  Overlap(GpuWorkspace& workspace, cudaStream_t main, int configured_comm_sms)
      : workspace_(workspace), main_(main) {
    const int El = static_cast<int>(workspace.layout.num_local_experts);
    const bool comm_heavy =
        workspace.layout.num_ranks > 1 && workspace.layout.intermediate < kCommHeavyIntermediate;
    comm_sms_ = configured_comm_sms > 0 ? configured_comm_sms
                : comm_heavy            ? kCommHeavyCommSms
                                        : kDefaultCommSms;
    comm_sms_ = std::clamp(comm_sms_, 1, std::max(1, workspace.num_sms / 2));
    const int64_t minibatch = workspace.config.minibatch_size;
    const int64_t pairs = workspace.layout.max_tokens * workspace.layout.num_topk;
    num_chunks_ = minibatch > 0 ? static_cast<int>((pairs + minibatch - 1) / minibatch) : kDefaultChunks;
    num_chunks_ = std::clamp(num_chunks_, 1, std::clamp(El, 1, kMaxChunks));
  }

  cudaStream_t comm() const { return workspace_.comm_stream; }
  int comm_sms() const { return comm_sms_; }
  // GEMMs leave the communication SMs free only when there is a later transfer to overlap with.
  int gemm_ctas() const { return num_chunks_ > 1 ? workspace_.num_sms - comm_sms_ : workspace_.num_sms; }
  int num_chunks() const { return num_chunks_; }
  // Local experts [chunk_begin(c), chunk_begin(c + 1)) form chunk c.
  int chunk_begin(int c) const {
    return static_cast<int>(static_cast<int64_t>(workspace_.layout.num_local_experts) * c / num_chunks_);
  }

  // An event marking everything queued so far on `stream`.
  cudaEvent_t mark(cudaStream_t stream) {
    POUNCE_CHECK(next_event_ < static_cast<int>(workspace_.events.size()), "overlap needs more than ",
                 workspace_.events.size(), " events; raise kOverlapEvents");
    cudaEvent_t event = workspace_.events[next_event_++];
    POUNCE_CUDA(cudaEventRecord(event, stream));
    return event;
  }
  void wait(cudaStream_t stream, cudaEvent_t event) { POUNCE_CUDA(cudaStreamWaitEvent(stream, event, 0)); }
  void comm_after_main() { wait(comm(), mark(main_)); }
  void main_after_comm() { wait(main_, mark(comm())); }

 private:
  GpuWorkspace& workspace_;
  cudaStream_t main_;
  int comm_sms_ = kDefaultCommSms;
  int num_chunks_ = 1;
  int next_event_ = 0;
};

}  // namespace pounce::gpu
