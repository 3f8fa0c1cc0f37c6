"""The experts as grouped GEMMs (``train.moe_grouped_gemm``, runtime/mcore/grouped_experts.py) against megatron's
``SequentialMLP`` on the CPU in fp32, in-process at EP 1: the same parameters, and the forward and every gradient
equal within rounding. (EP 2: tests/test_expert_parallel.py trains grouped experts at EP 2 against EP 1's loop.)"""
from __future__ import annotations

import pytest
import torch


def test_experts_linear_is_a_loop_over_the_experts_forward_and_backward():
    from runtime.mcore.grouped_experts import experts_linear
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, generator=g, requires_grad=True)
    ws = [torch.randn(16, 8, generator=g, requires_grad=True) for _ in range(3)]  # [out, in], as megatron's
    offs = torch.tensor([3, 3, 10], dtype=torch.int32)  # expert 1 gets no rows
    experts_linear(x, offs, ws).sum().backward()  # sum: an expanded gradient, which grouped_mm's backward refuses
    x2, ws2 = x.detach().clone().requires_grad_(), [w.detach().clone().requires_grad_() for w in ws]
    torch.cat([x2[:3] @ ws2[0].t(), x2[3:] @ ws2[2].t()]).sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-6)
    for w, w2 in zip(ws, ws2):
        assert torch.allclose(w.grad, w2.grad if w2.grad is not None else torch.zeros_like(w), atol=1e-6)
    assert ws[1].grad.abs().sum() == 0


@pytest.fixture(scope="module")
def tiny_moe_hf(tmp_path_factory):
    from runtime.models import load_hf_config
    from runtime.models.tiny import build_tiny_qwen3
    hf = build_tiny_qwen3(tmp_path_factory.mktemp("grouped") / "hf", seed=5, hidden_size=64, num_layers=2,
                          head_dim=16, ffn_hidden_size=64, num_experts=4, experts_per_token=2,
                          expert_ffn_size=32)["path"]
    return load_hf_config(hf)


def test_grouped_experts_forward_and_gradients_are_sequential_mlps(tiny_moe_hf):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from runtime.mcore.env import build_gpt_model
    from runtime.mcore.grouped_experts import GroupedMLP
    torch.manual_seed(0)
    loop = build_gpt_model(tiny_moe_hf)
    grouped = build_gpt_model(tiny_moe_hf, grouped_experts=True)
    assert {type(m) for m in loop.modules()} & {SequentialMLP, GroupedMLP} == {SequentialMLP}
    assert sum(isinstance(m, GroupedMLP) for m in grouped.modules()) == tiny_moe_hf.num_hidden_layers
    assert grouped.state_dict().keys() == loop.state_dict().keys()  # the checkpoint's and the conversion's names
    grouped.load_state_dict(loop.state_dict())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, tiny_moe_hf.vocab_size, (2, 12), generator=g)
    pos = torch.arange(12).expand(2, 12)
    mask = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1).view(1, 1, 12, 12)
    weight = torch.randn(2, 12, tiny_moe_hf.vocab_size, generator=g)
    out = {}
    for name, model in (("loop", loop), ("grouped", grouped)):
        logits = model(ids, pos, mask)
        (logits * weight).sum().backward()
        out[name] = logits.detach(), {k: p.grad for k, p in model.named_parameters()}
    assert torch.allclose(out["grouped"][0], out["loop"][0], rtol=1e-5, atol=1e-5)
    experts = [k for k in out["loop"][1] if "local_experts" in k]
    assert len(experts) == 2 * 4 * tiny_moe_hf.num_hidden_layers
    for k, v in out["loop"][1].items():
        assert v is not None and v.abs().sum() > 0, k  # every expert got tokens: the test reaches them all
        assert torch.allclose(out["grouped"][1][k], v, rtol=1e-5, atol=1e-6), (k, (out["grouped"][1][k] - v).abs().max())
