// Max pooling over planes (N*C of them), window K, stride S; idx keeps the argmax.
extern "C" __global__ void maxpool_fwd(const float* x, float* y, int* idx, int planes, int H, int W, int K, int S, int OH, int OW) {
    long i = IDX;
    if (i >= (long)planes * OH * OW) return;
    int ow = i % OW; long t = i / OW;
    int oh = t % OH; int p = t / OH;
    float best = -3.402823466e38f; int arg = 0;
    for (int a = 0; a < K; a++)
        for (int b = 0; b < K; b++) {
            int h = oh * S + a, w = ow * S + b;
            if (h < H && w < W) {
                int j = (p * H + h) * W + w;
                if (x[j] > best) { best = x[j]; arg = j; }
            }
        }
    y[i] = best; idx[i] = arg;
}

// idx comes from maxpool_fwd (always inside dx); clamped anyway, so no value can write outside.
extern "C" __global__ void maxpool_bwd(const float* dy, const int* idx, float* dx, long n, long n_in) {
    long i = IDX;
    if (i < n) {
        long j = idx[i];
        j = j < 0 ? 0 : (j >= n_in ? n_in - 1 : j);
        atomicAdd(&dx[j], dy[i]);
    }
}
