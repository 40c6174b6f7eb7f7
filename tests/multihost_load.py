"""Counting what a sharded load reads; one process of a two-process load.

`CountingFile` stands in for safetensors' safe_open and counts the elements
each read returns, per tensor. Run as a script, this file is one of two
processes (4 virtual CPU devices each, from XLA_FLAGS) loading a Hugging
Face directory onto an FSDP mesh over all 8 (tests/test_convert.py):

  python tests/multihost_load.py COORDINATOR PROCESS_ID HF_DIR OUT.npz

It saves the blocks its devices hold ("path|start:stop,..." -> array) and,
under "read|<tensor>", the elements it read of each tensor; under
"non_finite", what checkpointing.non_finite says of the load plus a tensor
with one NaN, and under "holds_the_nan", whether this process holds it.
"""

import collections
import sys

import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
from safetensors import safe_open

from fp4jax import checkpointing
from fp4jax.llama import hf as hf_llama
from fp4jax.llama import model as model_lib
from fp4jax import sharding


class CountingFile:
  """safe_open(...) whose slice reads add their sizes to `CountingFile.reads`."""
  reads = collections.Counter()

  def __init__(self, *args, **kwargs):
    self._file = safe_open(*args, **kwargs)

  def __enter__(self):
    self._file.__enter__()
    return self

  def __exit__(self, *exc):
    return self._file.__exit__(*exc)

  def keys(self):
    return self._file.keys()

  def get_slice(self, name):
    view = self._file.get_slice(name)

    class View:
      get_shape, get_dtype = view.get_shape, view.get_dtype

      def __getitem__(self, index):
        block = view[index]
        CountingFile.reads[name] += block.size
        return block

    return View()


def main(coordinator, process_id, hf_dir, out):
  dist = sharding.distributed_config()
  dist.update(coordinator=coordinator, num_processes=2,
              process_id=int(process_id))
  sharding.initialize_distributed(dist)
  fields, _ = hf_llama.llama_fields(
      hf_llama.read_json(f"{hf_dir}/config.json", "config"), hf_dir)  # pylint: disable=protected-access
  cfg = model_lib.LlamaConfig(**fields)
  mesh_cfg = sharding.mesh_config()
  mesh_cfg.update(data=1, fsdp=8)
  mesh = sharding.make_mesh(mesh_cfg)
  abstract = hf_llama.abstract_params(cfg, mesh)
  checkpoint = hf_llama.HfCheckpoint(hf_dir, cfg)
  hf_llama.safe_open = CountingFile
  loaded = checkpoint.load(abstract)
  saved = {f"read|{name}": np.int64(n)
           for name, n in CountingFile.reads.items()}
  for path, x in jax.tree_util.tree_flatten_with_path(loaded)[0]:
    for shard in x.addressable_shards:
      where = ",".join(f"{s.start or 0}:{s.stop or n}"
                       for s, n in zip(shard.index, x.shape))
      saved[f"{jax.tree_util.keystr(path)}|{where}"] = np.asarray(shard.data)
  # init_from's finiteness check: a NaN that one process's devices hold is
  # named by both.
  planted = np.zeros((16, 1), np.float32)
  planted[13] = np.nan
  rows = jax.make_array_from_callback(
      planted.shape, NamedSharding(mesh, P("fsdp")), lambda index: planted[index])
  saved["holds_the_nan"] = np.bool_(any(np.isnan(np.asarray(shard.data)).any()
                                        for shard in rows.addressable_shards))
  saved["non_finite"] = np.str_(checkpointing.non_finite(dict(loaded=loaded, planted=rows)))
  np.savez(out, **saved)


if __name__ == "__main__":
  main(*sys.argv[1:])
