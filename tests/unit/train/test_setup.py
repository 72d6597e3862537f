"""The non-finite skip happens on the device and equals an optimizer step that was never taken."""

from __future__ import annotations

import pytest
import torch

from runtime.config import JobConfig
from runtime.train.setup import build_optimizer, step_unless

GRADS = [1.0, float("nan"), 2.0, float("inf"), -3.0]


def _run(name: str, fused_skip: bool) -> torch.Tensor:
    cfg = JobConfig(name="t", optimizer={"name": name, "lr": 0.1, "momentum": 0.9, "nesterov": name == "sgd"})
    p = torch.nn.Parameter(torch.ones(4))
    opt = build_optimizer(cfg, [p])
    for g in GRADS:
        p.grad = torch.full((4,), g)
        bad = not bool(torch.isfinite(p.grad).all())
        if fused_skip:
            step_unless(opt, torch.tensor(float(bad)))
        elif not bad:
            opt.step()
    return p.detach().clone()


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_device_side_skip_matches_skipping_the_step_on_the_host(name: str) -> None:
    on_device = _run(name, fused_skip=True)
    assert torch.isfinite(on_device).all()
    assert torch.allclose(on_device, _run(name, fused_skip=False), atol=1e-6)


def test_optimizers_are_fused_where_torch_has_kernels_for_the_device() -> None:
    opt = build_optimizer(JobConfig(name="t"), [torch.nn.Parameter(torch.ones(2))])
    assert opt.defaults["fused"] and getattr(opt, "_step_supports_amp_scaling", False)


def test_a_skipped_first_sgd_step_leaves_no_uninitialised_momentum() -> None:
    cfg = JobConfig(name="t", optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0})
    p = torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer(cfg, [p])
    p.grad = torch.full((3,), float("nan"))
    step_unless(opt, torch.tensor(1.0))
    assert torch.equal(opt.state[p]["momentum_buffer"], torch.zeros(3))
    p.grad = torch.ones(3)
    step_unless(opt, torch.tensor(0.0))
    assert torch.allclose(p.detach(), torch.full((3,), 0.9))


def test_an_unfused_sgd_skip_restores_params_and_momentum_on_the_device() -> None:
    """FSDP's DTensors get foreach SGD (no fused kernel): the skip is a device-side restore (on DTensor
    shards: the FSDP cells with a planted NaN in test_combination_matrix.py)."""

    def run(device_skip: bool) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=True)
        opt.state[p]["momentum_buffer"] = torch.zeros(4)
        for g in GRADS:
            p.grad = torch.full((4,), g)
            bad = not bool(torch.isfinite(p.grad).all())
            if device_skip:
                step_unless(opt, torch.tensor(float(bad)))
            elif not bad:
                opt.step()
        return p.detach().clone(), opt.state[p]["momentum_buffer"].clone()

    (p_dev, m_dev), (p_host, m_host) = run(True), run(False)
    assert torch.isfinite(p_dev).all() and torch.isfinite(m_dev).all()
    assert torch.equal(p_dev, p_host) and torch.equal(m_dev, m_host)



def test_fsdp_gathers_batch_norm_models_in_fp32_unless_told_and_others_in_the_autocast_dtype() -> None:
    from runtime.config import FSDPConfig
    from runtime.train.parallel import fsdp_param_dtype

    bf16 = torch.bfloat16
    assert fsdp_param_dtype(FSDPConfig(), bf16, has_batch_norm=False) == bf16
    assert fsdp_param_dtype(FSDPConfig(), bf16, has_batch_norm=True) is None  # torch's batch norm: fp32 weights
    assert fsdp_param_dtype(FSDPConfig(), None, has_batch_norm=False) is None
    assert fsdp_param_dtype(FSDPConfig(param_dtype="bf16"), None, has_batch_norm=True) == bf16
