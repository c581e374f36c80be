// Thread-block cluster helpers (sm_90+): the cluster barrier and loads from another block's
// shared memory. On older devices they trap: their callers only run when the launch asked for
// a cluster, which the launcher refuses there.

// Every thread of every block of the cluster arrives (release), then waits for all (acquire):
// shared-memory writes before it are visible to the cluster's blocks after it.
__device__ __forceinline__ void cg_cluster_sync() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __trap();
#endif
}

// A cluster barrier that orders nothing in memory: every block of the cluster waits until all
// have arrived (the last one keeps a block's shared memory alive until the cluster has read it;
// the reads are done, their values used, before a block arrives).
__device__ __forceinline__ void cg_cluster_sync_relaxed() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
#else
    __trap();
#endif
}

// The float at `p` (this block's shared memory) in the shared memory of the cluster's block `rank`.
__device__ __forceinline__ float cg_dsmem_load(const float* p, unsigned rank) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
    unsigned local = (unsigned)__cvta_generic_to_shared(p);
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
#else
    __trap();
    return 0.0f;
#endif
}

