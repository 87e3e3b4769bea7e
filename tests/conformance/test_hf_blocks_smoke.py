"""Smoke tests for the Hugging Face MoE block registry (tests/conformance/hf_blocks.py)."""

from __future__ import annotations

import pytest
import torch

from tests.conformance.hf_blocks import BLOCKS, LEFT_OUT

NAMES = sorted(BLOCKS)


def _x(spec, seed=1234):
    return torch.randn(2, 5, spec.hidden_size, generator=torch.Generator().manual_seed(seed))


def test_registry_nonempty_and_documented():
    assert len(BLOCKS) >= 20
    for name, spec in BLOCKS.items():
        assert spec.notes and spec.model_type, name
        assert 1 <= spec.top_k <= spec.num_experts, name
    assert all(isinstance(v, str) and v for v in LEFT_OUT.values())


@pytest.mark.parametrize("name", NAMES)
def test_block(name):
    spec = BLOCKS[name]
    x = _x(spec)
    b0 = spec.build(0)
    assert not b0.training

    y0, logits = spec.run(b0, x)
    assert y0.shape == x.shape and y0.dtype == torch.float32
    assert torch.isfinite(y0).all()
    assert y0.abs().max() > 0
    if logits is not None:
        assert logits.shape == (x.shape[0] * x.shape[1], spec.num_logits or spec.num_experts)
        assert torch.isfinite(logits).all()

    # deterministic for a given seed, different for another seed
    y0b, _ = spec.run(spec.build(0), x)
    torch.testing.assert_close(y0b, y0, rtol=0, atol=0)
    y1, _ = spec.run(spec.build(1), x)
    assert not torch.allclose(y0, y1)

    # the router matters: perturbing one router row (one expert's logit) changes the output
    w = b0.get_parameter(spec.router_param)
    assert w.shape[0] >= spec.num_experts
    gen = torch.Generator().manual_seed(7)
    changed = False
    for row in range(w.shape[0]):
        saved = w.data[row].clone()
        with torch.no_grad():
            w.data[row] += torch.randn(w.shape[1], generator=gen) * 1.0
        y_p, _ = spec.run(b0, x)
        with torch.no_grad():
            w.data[row] = saved
        if not torch.allclose(y_p, y0, atol=1e-6):
            changed = True
            break
    assert changed or spec.dense, f"{name}: no single router row changes the output"
