// The fixture of tests/test_sass_loops.py: a kernel whose innermost loop holding a tensor-core
// instruction runs, per iteration, 1 HMMA (mma.sync m16n8k16 bf16), 1 FMUL, 2 FFMA and 2 LDS,
// inside an outer loop, beside a loop without tensor instructions.
// known_loop.cubin: nvcc 13.0 -arch=sm_90a -cubin -Xptxas -v (ptxas: 16 registers, 0 bytes
// stack frame, 0 bytes spill stores); known_loop.sass: nvdisasm 13.5 of that cubin.
#include <cuda_bf16.h>
extern "C" __global__ void known_loop(const float* x, float* y, int n, int m) {
  __shared__ unsigned s[256];
  s[threadIdx.x] = threadIdx.x;
  __syncthreads();
  float acc[4] = {0, 0, 0, 0};
  float f = x[threadIdx.x];
  for (int j = 0; j < m; ++j) {          // outer loop: no tensor instruction inside except via the inner loop
    #pragma unroll 1
    for (int i = 0; i < n; ++i) {          // innermost loop with the tensor instruction
      unsigned a0 = s[(i + threadIdx.x) & 255], a1 = s[(i + 3) & 255];
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%4,%5}, {%4,%5}, {%0,%1,%2,%3};"
                   : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]) : "r"(a0), "r"(a1));
      f = f * acc[0];
      f = __fmaf_rn(f, acc[1], acc[2]);
      f = __fmaf_rn(f, acc[3], 1.5f);
    }
    #pragma unroll 1
    for (int i = 0; i < n; ++i) f = f * x[i];  // a loop without tensor instructions
  }
  y[threadIdx.x] = f + acc[0] + acc[1] + acc[2] + acc[3];
}
