"""How a model is spread over a 2-D mesh of ranks beyond plain FSDP: tensor parallelism inside a
node, FSDP2 across nodes (torchtitan's layout). Nothing here knows the loop; the loop calls
``parallelize`` once after building the model, the way it calls ``apply_fsdp`` today.

- ``tensor_parallel``: the mesh (``("dp_shard", "tp")``), the GPT's tensor-parallel plan
  (column/row splits, sequence-parallel norms, loss parallel) applied before FSDP on the
  data-parallel dimension, and the CPU attention rule DTensor lacks.
- ``memory``: the per-GPU memory budget of a GPT under (dp, tp), as a pure function that
  ``make validate`` can check against the GPU memory it is told.

This package file imports nothing heavy.
"""
