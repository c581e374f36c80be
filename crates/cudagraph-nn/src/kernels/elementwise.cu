extern "C" __global__ void bias_act(float* y, const float* b, int rows, int cols, int relu) {
    long i = IDX;
    if (i < (long)rows * cols) {
        float v = y[i] + b[i % cols];
        y[i] = relu ? relu_f(v) : v;
    }
}

extern "C" __global__ void relu_fwd(const float* x, float* y, long n) {
    long i = IDX;
    if (i < n) y[i] = relu_f(x[i]);
}

// dx = dy where y > 0 (y is the ReLU output).
extern "C" __global__ void relu_bwd(const float* dy, const float* y, float* dx, long n) {
    long i = IDX;
    if (i < n) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

extern "C" __global__ void add_inplace(float* a, const float* b, long n) {
    long i = IDX;
    if (i < n) a[i] += b[i];
}

// y[(i / hw) % c] planes: y[(n·C + ch)·HW + p] += b[ch] over n elements (a convolution's NCHW
// output). vec: HW a multiple of 4 and y 16-byte aligned, one float4 per thread (a group never
// crosses a plane). wide: n ≥ 2^31, 64-bit index arithmetic (otherwise 32-bit division).
extern "C" __global__ void bias_planes(float* y, const float* b, long n, int hw, int c, int vec, int wide) {
    const long i = IDX;
    const long e = vec ? i * 4 : i;
    if (e >= n) return;
    const int ch = wide ? (int)((e / hw) % c) : (int)(((unsigned int)e / (unsigned int)hw) % (unsigned int)c);
    const float bb = b[ch];
    if (vec) {
        float4 v = reinterpret_cast<float4*>(y)[i];
        v.x += bb; v.y += bb; v.z += bb; v.w += bb;
        reinterpret_cast<float4*>(y)[i] = v;
    } else {
        y[e] += bb;
    }
}
