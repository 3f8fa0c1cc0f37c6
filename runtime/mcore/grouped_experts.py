"""A mixture of experts' experts as two grouped GEMMs (``train.moe_grouped_gemm``), in place of megatron's
``SequentialMLP``.

Without Transformer Engine megatron-core runs its experts as ``SequentialMLP``: a Python loop over the local experts,
three GEMMs and a handful of elementwise kernels each, and a host sync to split the tokens (128 experts at EP 1 for
Qwen3-30B-A3B: ~1,000 launches a layer, many on a few tokens). :class:`GroupedMLP` is that module with another
forward: the experts' fc1 weights stacked into one [E, 2F, H] tensor and fc2's into [E, H, F] (a copy made for the
GEMM and again in the backward, never kept between them; the gradients go back to each expert's own parameter),
then ``torch.nn.functional.grouped_mm`` over the tokens in expert order (the dispatcher's layout,
``tokens_per_expert`` rows each), the same activation and routing-weight scaling between them. Its modules, parameters, names, sharded checkpoint and the conversion's keys
are ``SequentialMLP``'s: a checkpoint loads either way and exports the hub's per-expert keys.

The arithmetic is the same; the summation order of the GEMMs' kernels is not, so the two differ by float
rounding (bf16 on a GPU): hence a setting, part of what a resumed run keeps.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP


def _aligned(*tensors: torch.Tensor) -> bool:
    """grouped_mm's layout rule: every stride but the unit one, and the start, a multiple of 16 bytes."""
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or any(s != 1 and (s * size) % 16 for s in t.stride()):
            return False
    return True


def _groupable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether grouped_mm takes these: any dtype on the CPU, bf16 on CUDA (as runtime/rollout/decode_model.py
    uses it), in a layout it accepts."""
    return (not x.is_cuda or x.dtype == torch.bfloat16) and _aligned(x, w)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of ``x`` [T, K] times ``w[e]`` [K, N]: one grouped GEMM where it runs, else a loop
    over the groups (it reads the offsets on the host)."""
    if _groupable(x, w):
        return F.grouped_mm(x, w, offs=offs)
    ends = offs.tolist()
    return torch.cat([x[s:e] @ w[i] for i, (s, e) in enumerate(zip([0] + ends[:-1], ends))])


def _grouped_wgrad(x: torch.Tensor, g: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[E, K, N]: for each group, its rows of ``x`` [T, K] transposed times its rows of ``g`` [T, N]."""
    if _groupable(x, g):
        return F.grouped_mm(x.t(), g, offs=offs)
    ends = offs.tolist()
    return torch.stack([x[s:e].t() @ g[s:e] for s, e in zip([0] + ends[:-1], ends)])


class _ExpertsLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ weights[e].T`` for every expert e (weights in megatron's [out, in] layout).
    The weights are stacked into one [E, in, out] tensor for the GEMM and stacked again in the backward instead of
    kept: the autograd of ``torch.stack`` + ``grouped_mm`` would hold that copy (all of a layer's expert weights)
    from the forward to the backward, in every layer."""

    @staticmethod
    def forward(ctx, x, offs, *weights):
        ctx.save_for_backward(x, offs, *weights)
        return _grouped_mm(x, torch.stack(weights).transpose(-2, -1), offs)

    @staticmethod
    def backward(ctx, g):
        x, offs, *weights = ctx.saved_tensors
        g = g.contiguous()
        gx = _grouped_mm(g, torch.stack(weights), offs) if ctx.needs_input_grad[0] else None
        gw = _grouped_wgrad(x, g, offs).transpose(-2, -1)  # [E, out, in]
        return (gx, None, *gw.unbind(0))


def experts_linear(x: torch.Tensor, offs: torch.Tensor, weights) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of ``x`` [T, in] through expert e's linear (``weights[e]`` [out, in]): [T, out]."""
    return _ExpertsLinear.apply(x.contiguous(), offs, *weights)


class GroupedMLP(SequentialMLP):
    """``SequentialMLP`` with its experts' GEMMs grouped (see the module). Configurations it does not cover
    (FP8/FP4, linear biases, routing weights on the input, TE's activation) run ``SequentialMLP``'s forward."""

    def _groupable(self) -> bool:
        c = self.config
        return not (c.fp8 or c.fp4 or c.add_bias_linear or c.moe_apply_probs_on_input or c.use_te_activation_func
                    or (c.bias_activation_fusion and not (c.gated_linear_unit and c.activation_func is F.silu)))

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """megatron's MLP between fc1 and fc2 for an expert: the (gated) activation times each token's routing
        weight, in the activation's dtype (runtime/mcore/fusions.py's fused SwiGLU where the config has it)."""
        c = self.config
        if c.bias_activation_fusion:
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
            return weighted_bias_swiglu_impl(h, None, probs.unsqueeze(-1), c.activation_func_fp8_input_store)
        if c.gated_linear_unit:
            gate, linear = torch.chunk(h, 2, dim=-1)
            if (clamp := c.activation_func_clamp_value) is not None:
                gate, linear = gate.clamp(max=clamp), linear.clamp(min=-clamp, max=clamp)
            a = c.activation_func(gate) * (linear + c.glu_linear_offset)
        else:
            a = c.activation_func(h)
        return (a * probs.unsqueeze(-1)).to(a.dtype)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        if not self._groupable():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        offs = tokens_per_expert.to(device=x.device).cumsum(0).to(torch.int32)
        h = experts_linear(x, offs, [e.linear_fc1.weight for e in self.local_experts])  # [T, 2F/tp]
        h = self._activation(h, permuted_probs)
        y = experts_linear(h, offs, [e.linear_fc2.weight for e in self.local_experts])  # [T, H]
        return y, None


def with_grouped_experts(spec):
    """A layer spec whose MoE experts are :class:`GroupedMLP` instead of ``SequentialMLP`` (the same submodules);
    a spec without them unchanged."""
    import copy
    mlp = getattr(getattr(spec, "submodules", None), "mlp", None)
    experts = getattr(getattr(mlp, "submodules", None), "experts", None)
    if experts is None or experts.module is not SequentialMLP:
        return spec
    spec = copy.deepcopy(spec)
    spec.submodules.mlp.submodules.experts.module = GroupedMLP
    return spec
