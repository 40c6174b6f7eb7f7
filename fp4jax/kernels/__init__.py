"""Pallas kernels for the quantization hot path.

  quantize  fused [Hadamard] -> MX quantize -> packed E2M1 + E8M0 codes, and the
            fused fake quantize the dot_general's `pallas` backend calls
  gemm      MXFP4 x MXFP4 GEMM reading packed operands (bf16 math, f32 accumulation)
  hopper_gemm  FP8 x FP8 GEMM on Hopper's tensor cores (Pallas Mosaic GPU), one wgmma
            per 32-element block, each block's partial scaled: the `mosaic` backend's
  target    pallas_call whose interpret mode follows the lowering target (GPU: Triton)

Native block-scaled GEMMs (jax.nn.scaled_matmul) are fp4jax.backends.native.
"""
