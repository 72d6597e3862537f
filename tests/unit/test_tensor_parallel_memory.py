"""The per-GPU memory budget of a GPT under dp x tp (runtime.parallelism.memory) and the shape
checks of the tensor-parallel plan: pure arithmetic, no ranks."""

from __future__ import annotations

import pytest

from runtime.parallelism.memory import GB, GPTShape, check_divisible, check_fits, memory_budget
from runtime.parallelism.tensor_parallel import loss_parallel_pays
from runtime.train.model_zoo import GPT

GPT_10B = GPTShape(layers=32, dim=5120, heads=40, seq_len=4096, vocab_size=256)


def test_split_and_replicated_parameters_add_up_to_the_models_own_count() -> None:
    shape = GPTShape(layers=3, dim=48, heads=4, seq_len=20, vocab_size=72)
    model = GPT(shape.vocab_size, shape.dim, shape.layers, shape.heads, shape.seq_len, checkpointed=False)
    assert shape.params == sum(p.numel() for p in model.parameters())


def test_the_split_part_of_each_gpus_shard_shrinks_with_tp_and_the_whole_with_dp() -> None:
    one = memory_budget(GPT_10B, dp=1, tp=1, micro_batch=1, checkpointed=True)
    tp8 = memory_budget(GPT_10B, dp=1, tp=8, micro_batch=1, checkpointed=True)
    dp8_tp8 = memory_budget(GPT_10B, dp=8, tp=8, micro_batch=1, checkpointed=True)
    # 16 bytes per parameter: fp32 parameters, fp32 gradients, AdamW's two fp32 moments
    assert one.parameters + one.gradients + one.optimizer == 16 * GPT_10B.params
    want_tp8 = 4 * (GPT_10B.split_params // 8 + GPT_10B.replicated_params)
    assert tp8.parameters == want_tp8
    assert dp8_tp8.parameters == 4 * (GPT_10B.split_params // 64 + GPT_10B.replicated_params // 8)


def test_gpt_10b_on_8_nodes_of_8_gpus_with_tp8_fits_an_80_gb_gpu_without_checkpointing() -> None:
    budget = memory_budget(GPT_10B, dp=8, tp=8, micro_batch=4, checkpointed=False)
    assert 14 * GB < budget.total < 15 * GB  # the docs/fsdp.md figure: 14.4 GB
    assert check_fits(budget, 80 * 10**9, "gpt_10b") is None


def test_gpt_10b_as_plain_fsdp_over_64_gpus_is_refused_naming_its_activations() -> None:
    budget = memory_budget(GPT_10B, dp=64, tp=1, micro_batch=4, checkpointed=False)
    message = check_fits(budget, 80 * 10**9, "gpt_10b")
    assert message is not None
    assert message.startswith("gpt_10b: needs 96.4 GB per GPU")
    assert "largest: activations" in message and "distributed.tp_size" in message


def test_checkpointing_keeps_one_blocks_activations_and_every_blocks_input() -> None:
    full = memory_budget(GPT_10B, dp=8, tp=8, micro_batch=1, checkpointed=False)
    ckpt = memory_budget(GPT_10B, dp=8, tp=8, micro_batch=1, checkpointed=True)
    logits = 4096 * 256 * 6
    per_block = 34 * 4096 * 5120 // 8
    assert full.activations == 32 * per_block + logits
    assert ckpt.activations == 32 * 4096 * 5120 * 2 // 8 + per_block + logits


def test_loss_parallel_splits_the_logits_and_pays_only_past_the_width() -> None:
    wide = GPTShape(layers=2, dim=1024, heads=8, seq_len=2048, vocab_size=128_000)
    gathered = memory_budget(wide, dp=1, tp=8, micro_batch=1, checkpointed=True)
    split = memory_budget(wide, dp=1, tp=8, micro_batch=1, checkpointed=True, loss_parallel=True)
    logits = 2048 * 128_000 * 6
    assert gathered.activations - split.activations == logits - logits // 8
    assert loss_parallel_pays(128_000, 1024) and not loss_parallel_pays(256, 5120)


@pytest.mark.parametrize(("shape", "tp", "message"), [
    (GPT_10B, 8, None),
    (GPT_10B, 16, "model.transformer.heads=40 is not a multiple of distributed.tp_size=16"),
    (GPTShape(layers=2, dim=64, heads=8, seq_len=30, vocab_size=256), 4,
     "model.transformer.seq_len=30 is not a multiple of distributed.tp_size=4"),
])
def test_a_shape_that_cannot_be_split_tp_ways_is_named(shape: GPTShape, tp: int, message: str | None) -> None:
    assert check_divisible(shape, tp) == message
