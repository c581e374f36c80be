// SGD with momentum and weight decay (PyTorch's update; the momentum buffer starts at zero,
// which equals PyTorch's first-step copy when dampening is 0).
// buf may be null when momentum is 0 (it is never touched then).
extern "C" __global__ void sgd_step(float* w, const float* g, float* buf, long n, float lr, float momentum, float wd) {
    long i = IDX;
    if (i < n) {
        float d = g[i] + wd * w[i];
        if (momentum != 0.0f) { buf[i] = momentum * buf[i] + d; d = buf[i]; }
        w[i] -= lr * d;
    }
}

extern "C" __global__ void step_inc(float* step) { step[0] += 1.0f; }

// Adam / AdamW with the step count on the device (PyTorch's capturable=True).
extern "C" __global__ void adam_step(float* w, const float* g, float* m, float* v, const float* step, long n,
                                     float lr, float b1, float b2, float eps, float wd, int decoupled) {
    long i = IDX;
    if (i < n) {
        float t = step[0];
        float gi = g[i];
        if (decoupled) w[i] -= lr * wd * w[i]; else gi += wd * w[i];
        m[i] = b1 * m[i] + (1.0f - b1) * gi;
        v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
        float mh = m[i] / (1.0f - powf(b1, t));
        float vh = v[i] / (1.0f - powf(b2, t));
        w[i] -= lr * mh / (sqrtf(vh) + eps);
    }
}
