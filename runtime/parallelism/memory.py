"""Bytes per GPU of a GPT trained under FSDP2 x tensor parallelism: a pure function of the shape
and the layout, so that ``make validate`` can refuse a job that cannot fit before any GPU is
asked for, and docs/fsdp.md can show its arithmetic.

What is split ``tp`` ways is what the plan in ``tensor_parallel`` splits: every block's weight
matrices and column-split biases (12 d^2 + 7 d per block), the embedding and the head (V d
each). Norms, row-split biases and the position table (6 d per block, T d, 2 d) are replicated
over ``tp``. FSDP2 then shards both over ``dp``.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
# Per parameter, as FSDP2 keeps it here: fp32 shard, fp32 gradient shard, AdamW's two fp32 moments.
PARAM_BYTES, GRAD_BYTES, ADAM_BYTES = 4, 4, 8
COMPUTE_BYTES = 2  # bf16: gathered parameters, activations
REDUCE_BYTES = 4  # fp32 gradient reduce-scatter (distributed.fsdp.reduce_dtype default)
# Activation bytes per token of one block, per unit of width, 16-bit, sequence parallel (Korthikanti
# et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 2 with flash
# attention, which keeps no T x T scores). An upper bound here: this GPT has no dropout masks (2 of 34).
BLOCK_ACT_PER_TOKEN_DIM = 34
# The allocator's fragmentation, the CUDA context and NCCL's buffers: what a budget must leave free.
RESERVE_FRACTION = 0.1


@dataclass(frozen=True)
class GPTShape:
    layers: int
    dim: int
    heads: int
    seq_len: int
    vocab_size: int

    @property
    def split_params(self) -> int:
        """Parameters the TP plan splits ``tp`` ways."""
        d = self.dim
        return self.layers * (12 * d * d + 7 * d) + 2 * self.vocab_size * d

    @property
    def replicated_params(self) -> int:
        """Parameters every TP rank holds whole (norms, row-split biases, positions)."""
        return self.layers * 6 * self.dim + self.seq_len * self.dim + 2 * self.dim

    @property
    def params(self) -> int:
        return self.split_params + self.replicated_params


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes on one GPU; ``activations`` for one micro-batch, the largest moment of a step."""

    parameters: int
    gradients: int
    optimizer: int
    gathered: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.gathered + self.activations

    def terms(self) -> dict[str, int]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "gathered": self.gathered, "activations": self.activations}


def check_divisible(shape: GPTShape, tp: int) -> str | None:
    """Why ``shape`` cannot be split ``tp`` ways (None when it can): attention is split by heads,
    embeddings and logits by the vocabulary, the residual stream by the sequence. Torch-free, so
    the job schema can ask it."""
    for name, n in (("model.transformer.heads", shape.heads), ("model.transformer.vocab_size", shape.vocab_size),
                    ("model.transformer.seq_len", shape.seq_len)):
        if n % tp:
            return f"{name}={n} is not a multiple of distributed.tp_size={tp}"
    return None


def memory_budget(shape: GPTShape, dp: int, tp: int, micro_batch: int, checkpointed: bool,
                  loss_parallel: bool = False) -> MemoryBudget:
    """Per-GPU bytes of training ``shape`` on ``dp x tp`` GPUs, ``micro_batch`` sequences per
    forward on each data-parallel rank (a TP group shares its micro-batch).

    - parameters, gradients, optimizer: each GPU's shard, ``split/(tp dp) + replicated/dp``
      parameters at 4 + 4 + 8 bytes;
    - gathered: what FSDP2 holds unsharded over dp at once: two blocks' bf16 parameters (the one
      running, the one prefetched), one block's gradient before its fp32 reduce-scatter, and the
      root (embedding, head, positions), gathered for the whole step;
    - activations: with checkpointing, every block's input (b T d, kept on the sequence shard) and
      one block's full activations while it is recomputed; without, all blocks' in full; plus the
      logits (b T V in bf16 and their fp32 softmax), split ``tp`` ways only under loss parallel.
    """
    d, T, V, L = shape.dim, shape.seq_len, shape.vocab_size, shape.layers
    shard = shape.split_params // (tp * dp) + shape.replicated_params // dp
    block_split, block_rep = (12 * d * d + 7 * d) // tp, 6 * d
    root = 2 * V * d // tp + T * d + 2 * d
    gathered = (2 * (block_split + block_rep) * COMPUTE_BYTES + (block_split + block_rep) * REDUCE_BYTES
                + root * COMPUTE_BYTES)
    tokens = micro_batch * T
    one_block = BLOCK_ACT_PER_TOKEN_DIM * tokens * d // tp
    blocks = L * tokens * d * COMPUTE_BYTES // tp + one_block if checkpointed else L * one_block
    logits = tokens * V * (COMPUTE_BYTES + 4) // (tp if loss_parallel else 1)
    return MemoryBudget(parameters=shard * PARAM_BYTES, gradients=shard * GRAD_BYTES, optimizer=shard * ADAM_BYTES,
                        gathered=gathered, activations=blocks + logits)


def check_fits(budget: MemoryBudget, gpu_memory_bytes: int, job: str) -> str | None:
    """One line saying why ``budget`` does not fit a GPU of ``gpu_memory_bytes`` (None when it
    does), naming the largest term so the reader knows what to change."""
    usable = int(gpu_memory_bytes * (1 - RESERVE_FRACTION))
    if budget.total <= usable:
        return None
    name, largest = max(budget.terms().items(), key=lambda kv: kv[1])
    return (f"{job}: needs {budget.total / GB:.1f} GB per GPU, over the {usable / GB:.1f} GB usable of a "
            f"{gpu_memory_bytes / GB:.0f} GB GPU (largest: {name} {largest / GB:.1f} GB); raise "
            f"distributed.tp_size or distributed.num_workers, lower data.batch_size, or set "
            f"model.gradient_checkpointing: true")
