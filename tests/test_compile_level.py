"""The suite compiles with LLVM at -O1 (conftest.COMPILE_LEVEL), users' runs at
XLA's default: the programs whose bits the tests pin down give the same bits
at both levels, so what the suite checks is what a user's run computes.

The programs: transcendental functions, and the gradients of a Dense layer
through fp4jax.dot_general for recipes whose GEMMs round (bf16, fp8: -O0
changes these) and whose GEMMs are exact (mxfp4, mxfp4-dh16, a stochastic
one); each is computed here and in a process at the default level.
"""

import os
import subprocess
import sys

import conftest
import numpy as np
import pytest

pytestmark = pytest.mark.slow

_PROGRAMS = """
import sys
import jax, jax.numpy as jnp, numpy as np
import fp4jax

x = jax.random.normal(jax.random.key(0), (128, 256), jnp.float32) * 3
w = jax.random.normal(jax.random.key(1), (256, 96), jnp.float32) * 0.05
out = {f.__name__: jax.jit(f)(x) for f in (jnp.exp, jnp.tanh, jax.nn.silu, jax.nn.softmax)}
dims = (((1,), (0,)), ((), ()))
for name in ("bf16", "fp8", "mxfp4", "mxfp4-dh16", "tseng"):
  dg = fp4jax.dot_general(fp4jax.recipe(name))
  loss = lambda a, b: jnp.sum(jnp.tanh(dg(a, b, dims, key=jax.random.key(5))) ** 2)
  out[name + " dX"], out[name + " dW"] = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
np.savez(sys.argv[1], **{k: np.asarray(v) for k, v in out.items()})
"""


def _run(path, xla_flags):
  env = dict(os.environ, XLA_FLAGS=xla_flags)
  env.pop("JAX_COMPILATION_CACHE_DIR")  # compiled here, not read from the suite's cache
  result = subprocess.run([sys.executable, "-c", _PROGRAMS, str(path)], env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return np.load(path)


def test_the_suites_compile_level_gives_the_default_levels_bits(tmp_path):
  """And the comparison can fail: -O0 sums the bf16 GEMM in another order."""
  assert conftest.COMPILE_LEVEL in os.environ["XLA_FLAGS"]
  suite = _run(tmp_path / "suite.npz", os.environ["XLA_FLAGS"])
  default = _run(tmp_path / "default.npz", "")
  assert sorted(suite.files) == sorted(default.files)
  for name in default.files:
    a, b = suite[name], default[name]
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape, name
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=name)
  low = _run(tmp_path / "low.npz", "--xla_backend_optimization_level=0")
  assert (low["bf16 dW"].view(np.uint32) != default["bf16 dW"].view(np.uint32)).any()
