"""The rollout engine's side of LoRA (``train.lora``): the adapters in fixed buffers, applied in the forward.

The engine never merges an adapter into its bf16 weights (``W + BA`` then ``- BA`` does not give ``W``
back in bf16). Each adapted projection adds ``scale * (x A^T) B^T`` to its output in the decoder's own
forward (runtime/rollout/decode_model.py) through the function the trainer adds it with
(``runtime.models.base.add_lora_up``: B's product accumulated into the output by one addmm, here in place),
so both compute the same sum in the same order. The buffers are
allocated once, at the configured rank, when the engine is built: every layer's A [rank, in] and
B [out, rank], zero until the first sync (zero B is the trainer's initial adapter). A sync copies the trainer's adapters into them in place, so CUDA graphs
captured over them stay valid: no re-capture after an update. (One tensor per layer and projection, not views
into one stack: the compiled pieces see every layer's adapter as they see its weights.)

Wire format (``MegatronTrainer.engine_weights``): the trainer's whole adapters by megatron name,
``decoder.layers.<i>.self_attention.linear_qkv.lora_A`` etc. B of the fused qkv comes in megatron's
per-group row order; an engine whose own fused qkv is in HF order (q, k, v: an engine that loaded its own
base) reorders those rows on the copy (``split_qkv``); fc1's rows (gate, up) are the engine's order as is.
"""
from __future__ import annotations

import re

import torch

from runtime.models.base import add_lora_up

ADAPTER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(?:self_attention|mlp)\.(linear_qkv|linear_proj|linear_fc1|"
                          r"linear_fc2)\.lora_(A|B)$")
# what each adapted projection is in the engine's forward: (in features, out features) from the model's sizes
_PROJECTIONS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def is_adapter_name(name: str) -> bool:
    return ADAPTER_NAME.match(name) is not None


class EngineAdapters:
    """Every layer's adapters at a fixed rank: ``a[target][layer]`` [rank, in], ``b[target][layer]`` [out, rank]."""

    def __init__(self, lora, *, n_layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
                 device, dtype, qkv_grouped: bool):
        self.rank, self.scale = int(lora.rank), float(lora.scale)
        self.targets = tuple(t for t in _PROJECTIONS if t in set(lora.target_modules))
        self.nh, self.nkv, self.hd = heads, kv_heads, head_dim
        self.qkv_grouped = qkv_grouped
        q, kv = heads * head_dim, kv_heads * head_dim
        shapes = {"linear_qkv": (hidden, q + 2 * kv), "linear_proj": (q, hidden),
                  "linear_fc1": (hidden, 2 * ffn), "linear_fc2": (ffn, hidden)}
        self.a: dict[str, list[torch.Tensor]] = {}
        self.b: dict[str, list[torch.Tensor]] = {}
        for t in self.targets:
            fan_in, fan_out = shapes[t]
            self.a[t] = [torch.zeros(self.rank, fan_in, device=device, dtype=dtype) for _ in range(n_layers)]
            self.b[t] = [torch.zeros(fan_out, self.rank, device=device, dtype=dtype) for _ in range(n_layers)]
        self.n_layers = n_layers

    def pair(self, layer: int, target: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(A, B) views of one layer's adapter, (None, None) where the projection has none."""
        if target not in self.a:
            return None, None
        return self.a[target][layer], self.b[target][layer]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.a, self.b) for ts in d.values() for t in ts)

    @torch.no_grad()
    def load(self, named: dict[str, torch.Tensor]) -> None:
        """Copy the trainer's adapters in (all-or-nothing: every name and shape is checked first). An adapter of a
        smaller rank fills the first rows/columns; the rest is zeroed."""
        parsed = []
        for name, t in named.items():
            m = ADAPTER_NAME.match(name)
            if m is None:
                raise ValueError(f"update_weights: {name!r} is not a LoRA adapter of this engine")
            layer, target, which = int(m.group(1)), m.group(2), m.group(3)
            if target not in self.a or layer >= self.n_layers:
                raise ValueError(f"update_weights: {name}: this engine has no adapter there "
                                 f"(targets {list(self.targets)}, {self.n_layers} layers)")
            buf = (self.a if which == "A" else self.b)[target][layer]
            r = t.shape[0] if which == "A" else t.shape[1]
            want = (r, buf.shape[1]) if which == "A" else (buf.shape[0], r)
            if t.dim() != 2 or tuple(t.shape) != want or r > self.rank:
                raise ValueError(f"update_weights: {name} has shape {tuple(t.shape)}; this engine's buffers hold "
                                 f"rank <= {self.rank} and {tuple(buf.shape)}")
            parsed.append((buf, which, target, t))
        for buf, which, target, t in parsed:
            if which == "A":
                buf[: t.shape[0]].copy_(t)
                buf[t.shape[0]:].zero_()
            else:
                if target == "linear_qkv" and not self.qkv_grouped:
                    from runtime.models.base import split_qkv
                    t = torch.cat(split_qkv(t, self.nh, self.nkv, self.hd), dim=0)
                buf[:, : t.shape[1]].copy_(t)
                buf[:, t.shape[1]:].zero_()


def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None,
             scale: float) -> torch.Tensor:
    """``out + scale * (x A^T) B^T`` written into ``out`` (``out`` when there is no adapter): the trainer's sum.
    ``out`` is the projection's fresh output, which nobody else holds (inference: no autograd)."""
    if a is None:
        return out
    return add_lora_up(out, torch.nn.functional.linear(x, a), b, scale, in_place=True)


__all__ = ["EngineAdapters", "add_lora", "is_adapter_name", "ADAPTER_NAME"]
