"""fp4jax.audit: every GEMM of the traced train step, its precision as the trace
shows it, set beside what the recipe asks; FLOP shares against a hand count;
planted mismatches named; bad input refused with one line."""

import dataclasses
import json

import pytest

from fp4jax import audit
from fp4jax import dot
from fp4jax import recipes
from fp4jax import sharding
from fp4jax.audit import __main__ as audit_cli
from fp4jax.audit import report
from fp4jax.data import tokenizers
from fp4jax.llama import linears
from fp4jax.train import config as train_config
from fp4jax.train import step as train_step
from fp4jax.train.cli import load_config_file
from tests import helpers

DEFAULT = "configs/default.py"
LINEARS = [layer.path for layer in linears.BLOCK]


def _config(recipe="mxfp4-dh16", n_layers=1, **model):
  config = load_config_file(DEFAULT)
  config.quant.name = recipe
  config.model.n_layers = n_layers
  for key, value in model.items():
    config.model[key] = value
  return config


def _rows(config):
  (_, rows), = audit.audit_config(config)
  return rows


def _model_cfg(config):
  return train_config.resolve(config, tokenizers.make_tokenizer(config.data.tokenizer))[0]


def _hand_count(cfg, config):
  """(FLOPs of the linears' GEMMs, FLOPs of all GEMMs) of one train step, by hand:
  2 * tokens * fan-in * fan-out per linear and role, 2 * B * heads * L^2 * head_dim
  per attention product and role, the head as a linear."""
  tokens, d, hd = config.batch_size * config.seq_len, cfg.dim, cfg.head_dim
  per_block = (d * cfg.n_heads * hd + 2 * d * cfg.n_kv_heads * hd + cfg.n_heads * hd * d
               + 3 * d * cfg.mlp_dim)
  linear = 3 * 2 * tokens * per_block * cfg.n_layers
  attention = 3 * 2 * (2 * config.batch_size * cfg.n_heads * config.seq_len ** 2 * hd)
  head = 3 * 2 * tokens * d * cfg.vocab_size
  return linear, linear + attention * cfg.n_layers + head


def test_default_config_lists_every_linear_per_role_in_the_recipes_formats():
  config = _config(n_layers=2)
  rows = _rows(config)
  recipe = recipes.recipe("mxfp4-dh16")
  for block in range(2):
    for path in LINEARS:
      for role, name in report.ROLES.items():
        found = [r for r in rows if r.layer == f"block_{block}/{path}" and r.role == name]
        assert len(found) == 1, (block, path, role)
        row, gemm = found[0], getattr(recipe, role)
        assert not row.mismatch, row.mismatch
        for op, spec in ((row.lhs, gemm.lhs), (row.rhs, gemm.rhs)):
          assert op.quant == {spec} and not op.raw
          assert op.rotations == {(16, "none")}
        assert report.operand_text(row.lhs) == "mxfp4 b32 E8M0-even RNE, H16 (none signs)"
        # W is the layer's kernel in Fprop and Dgrad (its rhs), in no operand of Wgrad
        keys = "".join(f"['{name}']" for name in f"block_{block}/{path}/kernel".split("/"))
        kernel = ("input", f"[0].params{keys}")
        reads_w = [op.data == {kernel} for op in (row.lhs, row.rhs)]
        assert reads_w == ([False, False] if role == "wgrad" else [False, True]), (path, role)
  # attention's products and the head stay in the compute dtype, and say so
  for layer in ("block_0/attn/qk", "block_0/attn/pv", "head"):
    assert {r.role for r in rows if r.layer == layer} == {"Fprop", "Dgrad", "Wgrad"}
    assert all(not r.lhs.quant and not r.rhs.quant and not r.mismatch
               for r in rows if r.layer == layer)
  assert len(rows) == 2 * (7 + 2) * 3 + 3


@pytest.mark.parametrize("recipe, of_linears", [
    ("bf16", {}), ("fp8", {"fp8": 1}), ("mxfp4", {"mxfp4": 1}), ("mxfp4-dh16", {"mxfp4": 1}),
    ("mxfp4-fprop-dgrad", {"mxfp4": 2 / 3, "fp8": 1 / 3})])
def test_flop_shares_match_a_hand_count(recipe, of_linears):
  """of_linears: each quantized precision's share of the linears' FLOPs (the rest,
  attention's products and the head, run unquantized in bf16 or f32)."""
  config = _config(recipe)
  rows = _rows(config)
  linear, total = _hand_count(_model_cfg(config), config)
  assert sum(r.flops for r in rows) == total
  shares = report.flop_shares(rows)
  assert set(shares) - set(of_linears) <= {"bf16", "f32"}
  for precision, fraction in of_linears.items():
    assert shares[precision] == pytest.approx(fraction * linear / total, abs=1e-12)
  assert not any(r.mismatch for r in rows)


def test_micro_batches_count_every_iteration_of_their_scan():
  config = _config("mxfp4")
  config.micro_batch = 4
  rows = _rows(config)
  linear, total = _hand_count(_model_cfg(config), config)
  assert sum(r.flops for r in rows) == total
  assert report.flop_shares(rows)["mxfp4"] == pytest.approx(linear / total, abs=1e-12)


@pytest.mark.parametrize("recipe, signs", [("mxfp4-rh16", "per-step"),
                                           ("mxfp4-lh16", "per-layer"),
                                           ("mxfp4-fh16", "fixed")])
def test_hadamard_sign_policies_are_read_from_the_trace(recipe, signs):
  rows = _rows(_config(recipe))
  linear_rows = [r for r in rows if r.layer.split("/", 1)[-1] in LINEARS]
  assert len(linear_rows) == 7 * 3
  for r in linear_rows:
    assert r.lhs.rotations == r.rhs.rotations == {(16, signs)}, (r.layer, r.role)
  assert not any(r.mismatch for r in rows)


def test_a_pinned_block_runs_unquantized_and_its_flops_count_as_bf16():
  config = _config(n_layers=2, bf16_layers=("block_0",))
  rows = _rows(config)
  linear, total = _hand_count(_model_cfg(config), config)
  assert report.flop_shares(rows)["mxfp4"] == pytest.approx(linear / 2 / total, abs=1e-12)
  for r in rows:
    assert not r.mismatch, (r.layer, r.role, r.mismatch)
    if r.layer.startswith("block_0/"):
      assert not r.lhs.quant and not r.rhs.quant and not r.lhs.rotations
  assert sum(r.want_recipe == "bf16_layers pin" for r in rows) == 7 * 3


def test_a_dgrad_run_unquantized_is_named(monkeypatch):
  """One layer's Dgrad (mlp/down's: W [mlp, embed]) goes around its quantizers."""
  config = _config()
  cfg = _model_cfg(config)
  real = dot._gemm

  def planted(a, b, dims, gemm, *args, role="gemm", **kwargs):
    if role == "dgrad" and tuple(b.shape) == (cfg.mlp_dim, cfg.dim):
      gemm = recipes.Gemm()
    return real(a, b, dims, gemm, *args, role=role, **kwargs)

  monkeypatch.setattr(dot, "_gemm", planted)
  train_step._programs.cache_clear()  # pylint: disable=protected-access
  try:
    rows = _rows(config)
  finally:
    train_step._programs.cache_clear()  # pylint: disable=protected-access
  bad = [(r.layer, r.role) for r in rows if r.mismatch]
  assert bad == [("block_0/mlp/down", "Dgrad")]
  (row,) = [r for r in rows if r.mismatch]
  assert row.mismatch[0].startswith("lhs: asked mxfp4 b32 E8M0-even RNE, ran bf16 (unquantized)")
  assert "asked H16 (none signs), ran no rotation" in " ".join(row.mismatch)


def test_a_pin_that_does_not_hold_is_named():
  """The config pins block_0 to bf16, the program it ran does not (the pin lost
  between the config and the model): block_0's 21 linear GEMMs are named."""
  config = _config(n_layers=2)
  cfg = _model_cfg(config)
  recipe = recipes.recipe("mxfp4-dh16")
  mesh = sharding.make_mesh(config.mesh)
  programs = train_step.make_programs(config, cfg, recipe, mesh)
  gemms = audit.step_gemms(config, programs, cfg, mesh)
  pinned = report.audit(gemms, dataclasses.replace(cfg, bf16_layers=("block_0",)), recipe)
  bad = sorted((r.layer, r.role) for r in pinned if r.mismatch)
  assert bad == sorted((f"block_0/{p}", role) for p in LINEARS for role in report.ROLES.values())
  assert all(r.want_recipe == "bf16_layers pin" and "asked unquantized, ran mxfp4" in r.mismatch[0]
             for r in pinned if r.mismatch)
  assert not any(r.mismatch for r in report.audit(gemms, cfg, recipe))


def test_a_run_directory_is_audited_from_its_config_json(tmp_path):
  config = _config("fp8")
  with open(tmp_path / "config.json", "w", encoding="utf-8") as f:
    json.dump(dict(config.to_dict(), resolved={}), f)
  from_run = audit_cli._run_config(str(tmp_path))  # pylint: disable=protected-access
  assert report.summary(_rows(from_run)) == report.summary(_rows(config))


@pytest.mark.parametrize("argv, names", [
    (["nothere.py"], ["nothere.py", "does not exist"]),
    (["README.md"], ["README.md", "config file (.py) nor a run directory"]),
    ([], ["give a config file or a run directory"]),
    ([DEFAULT, "--config.modle.n_layers=1"], ["--config.modle", "did you mean"]),
    (["FOLDER"], ["is a folder but not an fp4jax run", "config.json is missing"]),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, argv, names):
  argv = [str(tmp_path) if a == "FOLDER" else a for a in argv]
  rc, out = helpers.main_in_process(audit_cli.run, ["fp4jax.audit"] + argv)
  helpers.refused(rc, out, *names)


def test_command_prints_the_table_and_a_bad_recipe_exits_2():
  rc, out = helpers.cli("-m", "fp4jax.audit", DEFAULT, "--config.model.n_layers=1")
  assert rc == 0, out[-3000:]
  assert "block_0/mlp/down  Wgrad" in out
  assert out.strip().splitlines()[-1].endswith("; 0 mismatches")
  rc, out = helpers.cli("-m", "fp4jax.audit", DEFAULT, "--config.quant=nope")
  helpers.refused(rc, out, "unknown recipe 'nope'")
