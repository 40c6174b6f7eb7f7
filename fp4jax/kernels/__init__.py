"""Pallas kernels for the quantization hot path.

  quantize  fused [Hadamard] -> MX quantize -> packed E2M1 + E8M0 codes, the
            fused fake quantize the dot_general's `pallas` backend calls, and the
            FP8 elements + float32 scales, contraction axis last, of `mosaic`
  hopper_gemm  FP8 x FP8 GEMM on Hopper's tensor cores (Pallas Mosaic GPU), one wgmma
            per 32-element block, each block's partial scaled: the `mosaic` backend's
  target    pallas_call whose interpret mode follows the lowering target (GPU: Triton)

Native block-scaled GEMMs (jax.nn.scaled_matmul) are fp4jax.backends.native.
"""
