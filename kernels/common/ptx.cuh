// Inline-PTX wrappers for sm_90a: mbarriers, the bulk tensor copy engine (TMA), wgmma, register
// reconfiguration and scoped loads/stores. Raw `asm` lives only in kernels/common; stage code calls these.
//
// Memory-order vocabulary at call sites: `*_acquire_gpu` / `*_release_gpu` pair handoffs between SMs of
// one GPU; `*_sys` variants pair handoffs across GPUs (NVLink peers) or with the host.
#pragma once

#include <cstdint>

namespace pounce::kernels::ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---------------------------------------------------------------------------------------------------
// mbarrier (shared::cta). A phase completes when `count` arrivals and all expected tx bytes arrived.
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Makes barrier initialisation visible to the async proxy (TMA) and to the other threads after a barrier.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Orders this thread's generic-proxy shared-memory accesses before later async-proxy (TMA, wgmma) ones.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// The same for global memory: generic-proxy stores (another CTA's epilogue or a copy warp) published by a
// release/acquire pair, then read by this thread's TMA loads (the fused kernels' cross-SM handoffs).
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `count` threads, a multiple of 32.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// One arrival plus `bytes` of transaction count that the copy engine will complete.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

// True when the phase with parity `parity` has completed (a fresh barrier counts parity 1 as completed). The
// *_at forms take the barrier's shared-space byte address: a mainloop that computes its stage addresses once,
// instead of converting a generic pointer on every K block (the FP8 GEMM issues a K block every ~130 cycles).
__device__ __forceinline__ bool mbarrier_try_wait_parity_at(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      "  selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity) {
  return mbarrier_try_wait_parity_at(smem_addr(bar), parity);
}

// Bounded wait: spins until the phase completes or `timeout_ns` of wall time passed. Returns false on
// timeout so the caller can record an error code and leave instead of hanging the process.
__device__ __forceinline__ bool mbarrier_wait_parity_bounded_at(uint32_t bar, uint32_t parity,
                                                                uint64_t timeout_ns) {
  if (mbarrier_try_wait_parity_at(bar, parity)) return true;
  const uint64_t start = global_timer_ns();
  while (!mbarrier_try_wait_parity_at(bar, parity)) {
    if (global_timer_ns() - start > timeout_ns) return false;
  }
  return true;
}
__device__ __forceinline__ bool mbarrier_wait_parity_bounded(uint64_t* bar, uint32_t parity,
                                                             uint64_t timeout_ns) {
  return mbarrier_wait_parity_bounded_at(smem_addr(bar), parity, timeout_ns);
}

__device__ __forceinline__ void mbarrier_arrive_at(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float2 ld_shared_f32x2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

// ---------------------------------------------------------------------------------------------------
// Bulk tensor copies (TMA), global -> shared, completing on an mbarrier. `tensor_map` is the generic
// address of a CUtensorMap kernel parameter (__grid_constant__) or of one in global memory.
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(tensor_map)) : "memory");
}

__device__ __forceinline__ void tma_load_2d(void* smem_dst, const void* tensor_map, uint64_t* bar, int32_t c0,
                                            int32_t c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(void* smem_dst, const void* tensor_map, uint64_t* bar, int32_t c0,
                                            int32_t c1, int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
      : "memory");
}

// ---------------------------------------------------------------------------------------------------
// TMA stores: shared -> global through a tensor map, tracked per issuing thread in bulk async-groups.
// Out-of-bounds elements of the box are not written. Generic-proxy writes to the source must be ordered
// before the store with fence_proxy_async_shared.
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ void tma_store_2d(const void* tensor_map, uint32_t smem_src, int32_t c0,
                                             int32_t c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(tensor_map)),
               "r"(smem_src), "r"(c0), "r"(c1)
               : "memory");
}
__device__ __forceinline__ void bulk_commit_group() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Until at most kMaxPending of this thread's newest bulk groups are still reading their shared memory.
template <int kMaxPending>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kMaxPending) : "memory");
}
// Until at most kMaxPending of them are incomplete: the others' global writes are visible to this thread.
template <int kMaxPending>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kMaxPending) : "memory");
}
__device__ __forceinline__ void st_shared_b32(uint32_t smem_byte_addr, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_byte_addr), "r"(value) : "memory");
}

// ---------------------------------------------------------------------------------------------------
// wgmma (warpgroup MMA). Issued by all 128 threads of a warpgroup.
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kMaxPending>
__device__ __forceinline__ void wgmma_wait_group() {
  static_assert(kMaxPending >= 0 && kMaxPending <= 7, "wgmma.wait_group takes 0..7 pending groups");
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kMaxPending) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across wgmma issue and wait points.
__device__ __forceinline__ void fence_operand(float& reg) {
  asm volatile("" : "+f"(reg)::"memory");
}

// Shared-memory matrix descriptor for a K-major bf16 tile whose rows are 128 bytes (64 elements) and
// were written by TMA with 128-byte swizzle: 8-row core groups are 1024 bytes apart (stride byte offset),
// the leading byte offset is unused for swizzled K-major layouts, swizzle mode 1 = 128B (bits 62-63).
// The tile base must be 1024-byte aligned; stepping K by 16 elements adds 32 bytes to the start address.
__device__ __forceinline__ uint64_t make_smem_desc_k_major_sw128(uint32_t smem_byte_addr) {
  constexpr uint64_t kStrideBytes = 1024;
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_byte_addr & 0x3FFFF) >> 4);  // bits 0-13: start address >> 4
  desc |= static_cast<uint64_t>(1) << 16;                          // bits 16-29: leading byte offset (unused)
  desc |= (kStrideBytes >> 4) << 32;                               // bits 32-45: stride byte offset >> 4
  desc |= static_cast<uint64_t>(1) << 62;                          // bits 62-63: 128-byte swizzle
  return desc;
}

// Descriptor for an MN-major bf16 tile (the transposed operand: M or N contiguous) written by TMA in boxes of
// 64 MN elements (one 128-byte swizzled row) x K rows. Along K, 8-row core groups are 1024 bytes apart
// (stride byte offset); along MN, the next 64-element box starts `mn_box_bytes` later (leading byte
// offset). Stepping K by 16 elements adds 16 rows = 2048 bytes to the start address.
__device__ __forceinline__ uint64_t make_smem_desc_mn_major_sw128(uint32_t smem_byte_addr,
                                                                  uint32_t mn_box_bytes) {
  constexpr uint64_t kStrideBytes = 1024;
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_byte_addr & 0x3FFFF) >> 4);      // bits 0-13: start address >> 4
  desc |= static_cast<uint64_t>((mn_box_bytes & 0x3FFFF) >> 4) << 16;  // bits 16-29: MN box stride >> 4
  desc |= (kStrideBytes >> 4) << 32;                                   // bits 32-45: K group stride >> 4
  desc |= static_cast<uint64_t>(1) << 62;                              // bits 62-63: 128-byte swizzle
  return desc;
}

// D[64 x 256] (+)= A[64 x 16] * B[256 x 16]^T, bf16 inputs from shared memory, fp32 D in
// registers laid out as the wgmma m64nNk16 fragment: d[4*j + 2*h + c] holds row (warp%4)*16 + lane/4 + 8*h,
// column 8*j + 2*(lane%4) + c. `accumulate` false overwrites D (first K step of a tile). kMnMajorA/B select
// the transposed (M- or N-contiguous) shared-memory layout of an operand.
template <bool kMnMajorA = false, bool kMnMajorB = false>
__device__ __forceinline__ void wgmma_m64n256k16_bf16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                      bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, %131, %132;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
        "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),
        "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]),
        "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]),
        "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]),
        "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]),
        "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]),
        "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]),
        "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]),
        "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]),
        "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]),
        "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<uint32_t>(accumulate)), "n"(kMnMajorA ? 1 : 0),
        "n"(kMnMajorB ? 1 : 0));
}

// The same for N = 128 into the first 64 accumulators of d (columns 0..127; the rest untouched).
template <bool kMnMajorA = false, bool kMnMajorB = false, int kAccs>
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float (&d)[kAccs], uint64_t desc_a, uint64_t desc_b,
                                                      bool accumulate) {
  static_assert(kAccs >= 64, "m64n128 writes 64 accumulators per thread");
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, %67, %68;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
        "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),
        "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]),
        "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<uint32_t>(accumulate)), "n"(kMnMajorA ? 1 : 0),
        "n"(kMnMajorB ? 1 : 0));
}

// The same for N = 64 into the first 32 accumulators of d (columns 0..63; the rest untouched), so one
// accumulator array serves every width.
template <bool kMnMajorA = false, bool kMnMajorB = false, int kAccs>
__device__ __forceinline__ void wgmma_m64n64k16_bf16(float (&d)[kAccs], uint64_t desc_a, uint64_t desc_b,
                                                     bool accumulate) {
  static_assert(kAccs >= 32, "m64n64 writes 32 accumulators per thread");
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, %35, %36;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<uint32_t>(accumulate)), "n"(kMnMajorA ? 1 : 0),
        "n"(kMnMajorB ? 1 : 0));
}

// D[64 x 128] (+)= A[64 x 32] * B[128 x 32]^T, e4m3 inputs from shared memory (both K-major: FP8 wgmma has
// no transposed form), fp32 D in the m64nNk32 fragment (the same layout as the bf16 m64nNk16 one above).
// `accumulate` false overwrites D.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                      bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
        "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),
        "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]),
        "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<uint32_t>(accumulate)));
}

// Two fp32 -> one register of two bf16 (round to nearest even); `lo` lands in the low 16 bits.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t packed;
  asm("cvt.rn.bf16x2.f32 %0, %2, %1;" : "=r"(packed) : "f"(lo), "f"(hi));
  return packed;
}

// ---------------------------------------------------------------------------------------------------
// FP8 E4M3 (fn) conversions (kernels/quant/). fp32 -> e4m3 rounds to nearest even and saturates to ±448
// (.satfinite: ±inf too), bitwise as reference/fp8.cpp's float_to_e4m3 (checked on every finite bf16 value);
// a NaN becomes 0x7f whatever its sign (the CPU keeps the sign: 0xff).
// ---------------------------------------------------------------------------------------------------
// Two fp32 -> two e4m3 in one 16-bit register; `lo` lands in the low 8 bits (the lower address).
__device__ __forceinline__ uint16_t cvt_e4m3x2(float lo, float hi) {
  uint16_t packed;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(packed) : "f"(lo), "f"(hi));
  return packed;
}

// Two e4m3 (low 8 bits first) -> two fp32, exactly (every e4m3 value is an f16 value).
__device__ __forceinline__ void cvt_e4m3x2_to_f32(uint16_t packed, float& lo, float& hi) {
  asm("{\n"
      "  .reg .b32 pair;\n"
      "  .reg .b16 l, h;\n"
      "  cvt.rn.f16x2.e4m3x2 pair, %2;\n"
      "  mov.b32 {l, h}, pair;\n"
      "  cvt.f32.f16 %0, l;\n"
      "  cvt.f32.f16 %1, h;\n"
      "}\n"
      : "=f"(lo), "=f"(hi)
      : "h"(packed));
}

// ---------------------------------------------------------------------------------------------------
// Register reconfiguration (needs a register cap at entry: __launch_bounds__(threads, 1)).
// ---------------------------------------------------------------------------------------------------
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg takes a multiple of 8 in 24..256");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg takes a multiple of 8 in 24..256");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// Scoped loads/stores for cross-SM and cross-GPU handoffs live in kernels/common/flags.cuh.

}  // namespace pounce::kernels::ptx
