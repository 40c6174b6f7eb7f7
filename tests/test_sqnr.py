"""Signal-to-quantization-noise ratio floors per format and scale mode.

SQNR = 10 log10(sum x^2 / sum (x - fake_quantize(x))^2), nearest rounding,
blocks along the last axis of a [256, 1024] array. `pytest -s` prints the
table; torchao reports about 13 dB for fp4 and 18 dB for fp8 with its own
(different) data, for orientation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.numerics import formats

SPECS = [formats.QuantSpec(f, scale_mode=m)
         for f in formats.FORMATS
         for m in (formats.SCALE_MODES if f.startswith("mx") else ("floor",))]

# Measured with this file's data (docs/numerics.md); the floors are 1 dB
# lower. (fmt, scale_mode) -> (gauss, student_t3) dB.
MEASURED = {
    ("mxfp4", "floor"): (18.79, 16.81),
    ("mxfp4", "ceil"): (16.82, 14.02),
    ("mxfp4", "even"): (19.02, 16.99),
    ("mxfp4", "rceil"): (18.74, 16.31),
    ("mxfp6_e2m3", "floor"): (30.95, 29.23),
    ("mxfp6_e2m3", "ceil"): (28.77, 25.50),
    ("mxfp6_e2m3", "even"): (31.00, 29.25),
    ("mxfp6_e2m3", "rceil"): (30.97, 29.12),
    ("mxfp6_e3m2", "floor"): (25.35, 25.03),
    ("mxfp6_e3m2", "ceil"): (25.54, 25.57),
    ("mxfp6_e3m2", "even"): (25.54, 25.58),
    ("mxfp6_e3m2", "rceil"): (25.54, 25.58),
    ("mxfp8_e4m3", "floor"): (30.65, 29.27),
    ("mxfp8_e4m3", "ceil"): (31.54, 31.45),
    ("mxfp8_e4m3", "even"): (31.20, 30.36),
    ("mxfp8_e4m3", "rceil"): (31.54, 31.45),
    ("mxfp8_e5m2", "floor"): (25.35, 25.03),
    ("mxfp8_e5m2", "ceil"): (25.54, 25.59),
    ("mxfp8_e5m2", "even"): (25.54, 25.59),
    ("mxfp8_e5m2", "rceil"): (25.54, 25.59),
    ("nvfp4", "-"): (20.43, 20.81),
    ("fp8_e4m3", "-"): (31.57, 31.59),
    ("fp8_e5m2", "-"): (25.56, 25.64),
}
MARGIN_DB = 1.0


def data():
  rng = np.random.default_rng(0)
  return {"gauss": rng.standard_normal((256, 1024)).astype(np.float32),
          "student_t3": rng.standard_t(3, (256, 1024)).astype(np.float32)}


@jax.jit
def sqnr_all(xs):
  """{dist: [SQNR dB per spec in SPECS]}."""
  out = {}
  for name, x in xs.items():
    sig = jnp.sum(x * x)
    out[name] = jnp.stack([
        10 * jnp.log10(sig / jnp.sum((x - formats.fake_quantize(x, s))**2))
        for s in SPECS])
  return out


def sqnr_table():
  """Rows (fmt, scale_mode, {dist: dB})."""
  res = jax.device_get(sqnr_all({k: jnp.asarray(v) for k, v in data().items()}))
  return [(s.fmt, s.scale_mode if s.family == "mx" else "-",
           {d: float(res[d][i]) for d in res}) for i, s in enumerate(SPECS)]


@pytest.fixture(scope="module")
def table():
  rows = sqnr_table()
  print("\nSQNR (dB), nearest rounding, [256, 1024] blocks along the last axis")
  print(f"{'format':12s} {'scale':6s} {'gauss':>7s} {'student_t3':>11s}")
  for fmt, mode, r in rows:
    print(f"{fmt:12s} {mode:6s} {r['gauss']:7.2f} {r['student_t3']:11.2f}")
  return rows


def test_sqnr_floors(table):
  assert len(table) == len(MEASURED)
  for fmt, mode, r in table:
    for value, measured in zip((r["gauss"], r["student_t3"]),
                               MEASURED[(fmt, mode)]):
      assert value >= measured - MARGIN_DB, (fmt, mode, value, measured)


def test_sqnr_orders_formats(table):
  """More mantissa bits, more SQNR (same scaling); FP4 well below FP8."""
  g = {(f, m): r["gauss"] for f, m, r in table}
  assert g[("mxfp4", "rceil")] + 10 < g[("mxfp8_e4m3", "rceil")]
  assert g[("mxfp6_e2m3", "rceil")] > g[("mxfp6_e3m2", "rceil")]
  assert g[("mxfp8_e4m3", "rceil")] > g[("mxfp8_e5m2", "rceil")]
  assert g[("nvfp4", "-")] > g[("mxfp4", "rceil")]  # finer scales, blocks 16
