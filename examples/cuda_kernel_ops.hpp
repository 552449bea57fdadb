#pragma once
#include <cuda_runtime_api.h>

/// Queues out[i] = in[i]^2 on `stream` (device pointers).
cudaError_t launch_square(const float* in, float* out, int n, cudaStream_t stream);
