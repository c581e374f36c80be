// The engine registry's timing helper, compiled as its own tiny NVRTC module (see igemm.rs).

// Busy-waits for `ns` nanoseconds (one thread): lets the engine registry queue the runs it times
// behind it, so their timing is not stretched by host launch gaps.
extern "C" __global__ void engines_spin(long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while ((long long)(t - t0) < ns);
}
