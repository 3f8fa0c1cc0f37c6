"""LoRA on the trainer's megatron-core model (``train.lora``): a low-rank pair beside each target linear,
the base frozen.

Each target (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2`` of every layer) keeps its
class's forward and adds ``scale * (dropout(x) A^T) B^T`` to its output (``scale = alpha / rank``; B's product
accumulated into the output by one addmm, ``runtime.models.base.add_lora_up``, as the engine does); the
pair lives on the linear as ``lora_A`` [rank, in] and ``lora_B`` [out, rank], so the base weights keep
their names (the converted checkpoint loads as before) and the adapters are ``<linear>.lora_A/B``.

Tensor parallelism: a ColumnParallelLinear (qkv, fc1) splits its output, so B is split on its rows like
the weight and A is whole on every rank; the ``[.., rank]`` hidden goes through megatron's
copy-to-region (identity forward, all-reduce backward) so A's and the input's gradients are whole. A
RowParallelLinear (proj, fc2) splits its input: A is split on its columns, the partial hidden is
all-reduced (``rank`` numbers per token, cheaper than reducing the output), B is whole.

Frozen base: every other parameter has ``requires_grad=False`` before megatron's DDP and optimizer are
built, so they see only the adapters (no gradient buffer, master copy or Adam state for the base), and
megatron's linears take their frozen-weight path (no weight gradient). The embedding's output is marked as
requiring grad so that recomputed (checkpointed) layers, whose inputs would otherwise not require it, still
pass gradients to their adapters.

Randomness: A's initial values (PEFT's: uniform in +-1/sqrt(in), B = 0) come from a generator keyed by
(train.seed, the linear's index), made whole and then sliced for the rank, so every build and every TP
layout starts from the same adapters. The dropout mask (``train.lora.dropout`` > 0, training forward
only) is keyed by (train.seed, optimizer step, DP rank, micro-batch, linear) — a recomputed forward
draws the same mask, and a resumed run the same masks as an unbroken one.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from typing import Iterator

import torch
import torch.nn.functional as F

from runtime.config import LoraSection
from runtime.models.base import add_lora_up

DESCRIPTION_FILE = "lora.json"  # in a trainer checkpoint's model dir: it holds adapters, not the base


def _key_seed(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)


class _LoraMixin:
    """The adapter of one linear (set up by :func:`attach`); ``lora_row``: a RowParallelLinear."""

    lora_A: torch.nn.Parameter
    lora_B: torch.nn.Parameter

    def _add_lora(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The linear's output ``out`` plus the adapter's ``scale * (dropout(x) A^T) B^T`` (``out`` when off)."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)
        if not self.lora_on:
            return out
        if self.training and self.lora_dropout > 0:
            x = x * self._dropout_mask(x)
        down, up = self.lora_products
        h = down(x, self.lora_A)
        h = reduce_from_tensor_model_parallel_region(h) if self.lora_row else copy_to_tensor_model_parallel_region(h)
        return up(out, h, self.lora_B, self.lora_scale)

    def _dropout_mask(self, x: torch.Tensor) -> torch.Tensor:
        """keep / (1 - p) over the whole input (a row-parallel rank takes its columns of it)."""
        if self.lora_key is None:
            raise RuntimeError("LoRA dropout needs a key per micro-batch (lora.set_dropout_key)")
        full = list(x.shape)
        tp, rank = self.lora_tp
        if self.lora_row:
            full[-1] *= tp
        g = torch.Generator(device=x.device)
        g.manual_seed(_key_seed(*self.lora_key, self.lora_index))
        keep = torch.rand(full, generator=g, device=x.device) >= self.lora_dropout
        if self.lora_row and tp > 1:
            n = x.shape[-1]
            keep = keep[..., rank * n:(rank + 1) * n]
        return keep.to(x.dtype) / (1.0 - self.lora_dropout)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base's entries as before; the adapters sharded the way they are split (module doc)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        adapters = {"lora_A": self.lora_A, "lora_B": self.lora_B}
        axis = {"lora_A": 1} if self.lora_row else {"lora_B": 0}
        out.update(make_sharded_tensors_for_checkpoint(adapters, prefix, axis, sharded_offsets,
                                                       tp_group=self.tp_group,
                                                       dp_cp_group=(metadata or {}).get("dp_cp_group")))
        return out


_CLASSES: dict[type, type] = {}


def _lora_class(base: type) -> type:
    """``base`` (a megatron parallel linear) with the adapter added to its forward."""
    cls = _CLASSES.get(base)
    if cls is not None:
        return cls
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    if issubclass(base, ColumnParallelLinear):
        def forward(self, input_, weight=None, runtime_gather_output=None):
            out, bias = base.forward(self, input_, weight, runtime_gather_output)
            return self._add_lora(out, input_), bias
    else:
        def forward(self, input_):
            out, bias = base.forward(self, input_)
            return self._add_lora(out, input_), bias
    cls = type(f"Lora{base.__name__}", (_LoraMixin, base), {"forward": forward})
    _CLASSES[base] = cls
    return cls


def lora_modules(model) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, module) of every linear that carries an adapter, in model order."""
    from runtime.mcore.env import unwrap_model
    for name, module in unwrap_model(model).named_modules():
        if isinstance(module, _LoraMixin):
            yield name, module


def attach(model, lora: LoraSection, seed: int, batch_invariant: bool = False) -> int:
    """Freeze ``model`` and give each target linear an adapter (module doc). Returns the adapter parameters'
    count. Call after the base weights are loaded and before DDP and the optimizer are built. ``batch_invariant``
    (``rollout.true_on_policy``): the adapter's two products by runtime/kernels/batch_invariant.py, as the engine's."""
    from runtime.kernels import batch_invariant as bi
    products = (bi.fixed_shape_mm, bi.fixed_shape_addmm) if batch_invariant else (F.linear, add_lora_up)
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import layers as tpl

    from runtime.mcore.env import unwrap_model
    if not lora.enabled:
        raise ValueError("lora.attach with train.lora.enabled false")
    gpt = unwrap_model(model)
    for p in gpt.parameters():
        p.requires_grad_(False)
    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    targets = set(lora.target_modules)
    count = 0
    for index, (name, module) in enumerate(
            (n, m) for n, m in gpt.named_modules()
            if n.rpartition(".")[2] in targets and isinstance(m, (tpl.ColumnParallelLinear, tpl.RowParallelLinear))):
        row = isinstance(module, tpl.RowParallelLinear)
        w = module.weight
        out_local, in_local = w.shape
        in_full = in_local * tp if row else in_local
        g = torch.Generator().manual_seed(_key_seed("lora-init", seed, index))
        bound = 1.0 / math.sqrt(in_full)
        a = (torch.rand(lora.rank, in_full, generator=g, dtype=torch.float64) * 2 - 1) * bound
        if row:
            a = a[:, tp_rank * in_local:(tp_rank + 1) * in_local]
        module.__class__ = _lora_class(type(module))
        module.lora_A = torch.nn.Parameter(a.to(device=w.device, dtype=w.dtype).contiguous())
        module.lora_B = torch.nn.Parameter(torch.zeros(out_local, lora.rank, device=w.device, dtype=w.dtype))
        if row:
            tpl.set_tensor_model_parallel_attributes(module.lora_A, True, 1, 1)
            tpl.set_defaults_if_not_set_tensor_model_parallel_attributes(module.lora_B)
        else:
            tpl.set_tensor_model_parallel_attributes(module.lora_B, True, 0, 1)
            tpl.set_defaults_if_not_set_tensor_model_parallel_attributes(module.lora_A)
        module.lora_row, module.lora_index, module.lora_tp = row, index, (tp, tp_rank)
        module.lora_scale, module.lora_dropout = float(lora.scale), float(lora.dropout)
        module.lora_on, module.lora_key, module.lora_products = True, None, products
        count += module.lora_A.numel() + module.lora_B.numel()
    if not count:
        raise ValueError(f"train.lora.target_modules {sorted(targets)}: no such linear in the model")
    # recomputed layers are autograd Functions over their input: it must require grad for their adapters' grads
    gpt.embedding.register_forward_hook(_input_requires_grad)
    return count


def _input_requires_grad(module, args, output):
    if torch.is_grad_enabled() and torch.is_tensor(output) and not output.requires_grad:
        return output.detach().requires_grad_(True)
    return output


@contextlib.contextmanager
def adapters_off(model) -> Iterator[None]:
    """The base alone (the KL reference): every adapter skipped inside the block."""
    mods = [m for _, m in lora_modules(model)]
    for m in mods:
        m.lora_on = False
    try:
        yield
    finally:
        for m in mods:
            m.lora_on = True


def set_dropout_key(model, key: tuple) -> None:
    """The dropout masks' key for the next training forward (module doc)."""
    for _, m in lora_modules(model):
        m.lora_key = tuple(key)


def is_adapter(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def sharded_state_dict(model) -> dict:
    """The model's sharded state dict restricted to the adapters (what a LoRA checkpoint holds)."""
    from runtime.mcore.env import unwrap_model
    return {k: v for k, v in unwrap_model(model).sharded_state_dict().items() if is_adapter(k)}


def load_adapters(model, state: dict) -> None:
    """Put loaded adapter tensors (``sharded_state_dict``'s keys) into the model; every adapter must be there."""
    from runtime.mcore.env import unwrap_model
    gpt = unwrap_model(model)
    own = {k for k in gpt.state_dict() if is_adapter(k)}
    if set(state) != own:
        missing, extra = sorted(own - set(state)), sorted(set(state) - own)
        raise ValueError(f"LoRA checkpoint does not match the model's adapters (missing {missing[:3]}, "
                         f"unexpected {extra[:3]}); was it written with the same train.lora?")
    result = gpt.load_state_dict(state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys


def adapter_tensors(model) -> dict[str, torch.Tensor]:
    """Every adapter whole (TP shards gathered; on every TP rank), by parameter name."""
    from runtime.trainer.tp_gather import gather_full
    from runtime.mcore.env import unwrap_model
    gpt = unwrap_model(model)
    return gather_full(gpt, {n: p.detach() for n, p in gpt.named_parameters() if is_adapter(n)})


def base_tensors(model) -> dict[str, torch.Tensor]:
    """The frozen base's tensors themselves (no copies), by state-dict name: what an engine in this process
    reads instead of a copy of its own (tensor parallelism 1)."""
    from runtime.mcore.env import unwrap_model
    return {k: v.detach() for k, v in unwrap_model(model).state_dict(keep_vars=True).items()
            if torch.is_tensor(v) and not k.endswith("_extra_state") and not is_adapter(k)}


def describe(lora: LoraSection) -> dict:
    """What a checkpoint's ``lora.json`` records: the adapters' shape and scale (the base is the run's
    converted model)."""
    return {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
            "target_modules": list(lora.target_modules)}


def write_description(model_dir: str, lora: LoraSection) -> None:
    from runtime.storage import write_json_atomic
    write_json_atomic(os.path.join(model_dir, DESCRIPTION_FILE), describe(lora))


def read_description(model_dir: str) -> LoraSection | None:
    """The ``train.lora`` a checkpoint's adapters were made with; None for a full-parameter checkpoint."""
    path = os.path.join(model_dir, DESCRIPTION_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return LoraSection(enabled=True, **json.load(f))


def merge(state: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Whole megatron weights with the adapters merged in: W + scale B A, computed in fp32 (the weights come
    back in fp32; cast after). ``adapters``: :func:`adapter_tensors`' names."""
    out = {k: v.to(torch.float32) for k, v in state.items() if not is_adapter(k)}
    for name in adapters:
        if not name.endswith(".lora_A"):
            continue
        linear = name[: -len(".lora_A")]
        a, b = adapters[name].to(torch.float32), adapters[linear + ".lora_B"].to(torch.float32)
        out[linear + ".weight"] = out[linear + ".weight"] + scale * (b @ a)
    return out
