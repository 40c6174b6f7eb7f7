"""The model's linear layers, named once: the seven of a block, and the head.

Each `Linear` is a module path (inside block_<i> for the block's), the
logical names of its kernel's axes, contracted axes first (fp4jax.llama.model
documents the layouts), how many axes it contracts, and its Hugging Face
weight with that weight's layout (fp4jax.llama.hf). Sizes come from a
LlamaConfig. The model, the block check (fp4jax.llama.block_check), the
adaptive Wgrad monitor, the Hugging Face mapping and the ablation's
diagnostics read this table.
"""

import dataclasses

# Logical axis name -> the LlamaConfig attribute that is its size.
_SIZES = {"embed": "dim", "heads": "n_heads", "kv_heads": "n_kv_heads",
          "head_dim": "head_dim", "mlp": "mlp_dim", "vocab": "vocab_size"}


@dataclasses.dataclass(frozen=True)
class Linear:
  """One linear layer: y = x W with W of logical axes `kernel_axes`."""
  path: str                 # module path, e.g. "attn/q" (inside block_<i>)
  kernel_axes: tuple        # logical names, the n_in contracted ones first
  n_in: int                 # how many leading kernel axes are contracted
  hf_name: str              # Hugging Face weight (of the layer, for a block's)
  hf_layout: str            # how the kernel sits in it (fp4jax.llama.hf)

  @property
  def name(self) -> str:
    """The module's own name ("q")."""
    return self.path.rsplit("/", 1)[-1]

  def fan_in(self, cfg) -> list:
    """[(logical name, size)] of the contracted (input) axes under LlamaConfig cfg."""
    return self._axes(cfg)[:self.n_in]

  def fan_out(self, cfg) -> list:
    """[(logical name, size)] of the output axes."""
    return self._axes(cfg)[self.n_in:]

  def _axes(self, cfg):
    return [(a, getattr(cfg, _SIZES[a])) for a in self.kernel_axes]


BLOCK = (
    Linear("attn/q", ("embed", "heads", "head_dim"), 1, "self_attn.q_proj.weight", "in_heads"),
    Linear("attn/k", ("embed", "kv_heads", "head_dim"), 1, "self_attn.k_proj.weight",
           "in_heads"),
    Linear("attn/v", ("embed", "kv_heads", "head_dim"), 1, "self_attn.v_proj.weight",
           "in_heads"),
    Linear("attn/o", ("heads", "head_dim", "embed"), 2, "self_attn.o_proj.weight", "out_heads"),
    Linear("mlp/gate", ("embed", "mlp"), 1, "mlp.gate_proj.weight", "t"),
    Linear("mlp/up", ("embed", "mlp"), 1, "mlp.up_proj.weight", "t"),
    Linear("mlp/down", ("mlp", "embed"), 1, "mlp.down_proj.weight", "t"),
)
HEAD = Linear("head", ("embed", "vocab"), 1, "lm_head.weight", "t")

_BY_PATH = {layer.path: layer for layer in BLOCK + (HEAD,)}


def linear(path: str) -> Linear:
  """The Linear of module path `path` ("attn/q", ..., "head")."""
  return _BY_PATH[path]


def diagnostics_layers(cfg) -> tuple:
  """Module paths fp4jax.diagnostics measures by default under LlamaConfig cfg:
  the first block's first linear (q) and the last block's last (down)."""
  return (f"block_0/{BLOCK[0].path}", f"block_{cfg.n_layers - 1}/{BLOCK[-1].path}")
