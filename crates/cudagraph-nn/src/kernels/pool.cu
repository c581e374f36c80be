// Max pooling over planes (N*C of them), window K, stride S; idx keeps the argmax. As PyTorch's
// kernels: start from -inf at the window's first element and take a value that is greater or
// NaN (v != v), so a window with NaN gives NaN at its last NaN, a window of -inf gives -inf at
// its first element, and idx always lies inside the window (the gradient stays there).
extern "C" __global__ void maxpool_fwd(const float* x, float* y, int* idx, int planes, int H, int W, int K, int S, int OH, int OW) {
    long i = IDX;
    if (i >= (long)planes * OH * OW) return;
    int ow = i % OW; long t = i / OW;
    int oh = t % OH; int p = t / OH;
    float best = __int_as_float(0xff800000); int arg = (p * H + oh * S) * W + ow * S;
    for (int a = 0; a < K; a++)
        for (int b = 0; b < K; b++) {
            int h = oh * S + a, w = ow * S + b;
            if (h < H && w < W) {
                int j = (p * H + h) * W + w;
                float v = x[j];
                if (v > best || v != v) { best = v; arg = j; }
            }
        }
    y[i] = best; idx[i] = arg;
}

// idx comes from maxpool_fwd (always inside its output's window, so inside dx); clamped anyway, so
// no value can write outside.
extern "C" __global__ void maxpool_bwd(const float* dy, const int* idx, float* dx, long n, long n_in) {
    long i = IDX;
    if (i < n) {
        long j = idx[i];
        j = j < 0 ? 0 : (j >= n_in ? n_in - 1 : j);
        atomicAdd(&dx[j], dy[i]);
    }
}
