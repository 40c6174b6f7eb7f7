"""The numerics: formats, scales, rotations. Imports jax only; nothing here knows of Flax, models or training.

  elements       E2M1/E2M3/E3M2/E4M3/E5M2 grids, rounding onto them, E2M1 codes by bit arithmetic
  scales         E8M0 shared exponents (floor, ceil, even, rceil) and E4M3 block scales
  formats        QuantSpec, QArray, quantize, fake_quantize, packing
  tiles          the layout of 2D (square-tile) block scaling
  blocks2d       matrices quantized in square tiles (TiledQArray)
  hadamard       block-diagonal Hadamard rotations and their sign policies
  operand        one GEMM operand: zero-padded, rotated, fake-quantized along its contraction axis
  quest          QuEST's Gaussian-fit scales and trust mask
  eden           MS-EDEN's unbiased rescaling
  four_over_six  NVFP4 blocks scaled to 4 or 6, whichever errs less
"""
