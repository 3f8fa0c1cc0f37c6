"""A built-in engine replica split over several engines by its experts (``rollout.expert_shards``).

Each engine of a replica holds every expert-free weight (attention, norms, router, embeddings, head) and
``num_experts / shards`` of every MoE layer's experts: shard ``s`` the global experts ``s·L .. s·L + L - 1``. The
engines of a replica are given the same requests and run the same loop in step: each computes the attention of
every row, routes every token over all experts, runs the routed copies that land on its own experts and sums them
into a partial output, and one all-reduce per MoE layer over the replica's group adds the shards' partials. Every
engine then holds the same hidden states, samples the same tokens and makes the same scheduling decisions (the
page pool is sized to the smallest engine's), so only the replica's first engine's results are read.

Why this split and not expert parallelism's all-to-all: a decode step of a mixture of experts at rollout batch sizes
reads every expert's weights, and those bytes are what bounds it; split over ``n`` GPUs each reads ``1/n`` of them,
and the only traffic is one [tokens, hidden] all-reduce per layer. The attention is repeated on every shard; at
Qwen3-30B-A3B's shape it is ~5 % of the weights. The experts' outputs are summed in another order than one engine
sums them, so a replica of ``n`` shards makes other bits than one of ``1`` (each replica is deterministic run to
run: the resume contract holds at a fixed ``rollout.expert_shards``).

Weights come in by HF name as everywhere (``mlp.experts.{e}.gate_proj.weight`` ...): a shard takes its own experts'
and passes over the others' (`ExpertShard.owns`); the trainer's colocated weight sync hands each engine only the
experts of its shard (runtime/trainer/megatron_trainer.py: `share_next_weight_unit`).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

_HUB_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)(\.(?:gate_proj|up_proj|down_proj)\.weight)$")
_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts\.)(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class ShardSpec:
    """Where engine ``index`` of a replica of ``count`` finds the others: the replica's rendezvous (its first engine
    hosts the store) and the group's name. Picklable: it travels to the engine's process."""
    index: int
    count: int
    host: str
    port: int
    name: str


def hub_expert(name: str) -> tuple[str, int, str] | None:
    """(prefix, global expert index, suffix) of a hub per-expert weight name, else None."""
    m = _HUB_EXPERT.match(name)
    return None if m is None else (m[1], int(m[2]), m[3])


class ExpertShard:
    """This engine's place in its replica and the group the replica's engines share."""

    def __init__(self, spec: ShardSpec, num_experts: int, device: torch.device, timeout_s: float = 600.0):
        if num_experts % spec.count:
            raise ValueError(f"rollout.expert_shards={spec.count} must divide the model's num_experts={num_experts}")
        from runtime.placement.weight_sync import backend_for, init_group
        self.index, self.count = int(spec.index), int(spec.count)
        self.experts, self.local = int(num_experts), num_experts // self.count
        self.first = self.index * self.local
        self.device = device
        self.group = init_group(spec.host, spec.port, self.index, self.count, backend=backend_for(device.type),
                                group_name=spec.name, timeout_s=timeout_s)
        # NCCL makes its communicator at the first collective, which may not be inside a CUDA graph's capture (the
        # decode steps' sums are captured: torch >= 2.2 keeps captured collectives off its watchdog)
        self.sum_(torch.zeros(1, device=device))

    def owns(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.local

    def others(self, expert: int) -> bool:
        """Whether ``expert`` is one of the model's that another shard of the replica holds."""
        return 0 <= expert < self.experts and not self.owns(expert)

    def sum_(self, partial: torch.Tensor) -> torch.Tensor:
        """The replica's sum of every shard's ``partial``, in place (the same bits on every shard)."""
        dist.all_reduce(partial, group=self.group)
        return partial

    def smallest(self, value: int) -> int:
        """The smallest of every shard's ``value`` (the page pool each can hold: all keep the same pages)."""
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def close(self) -> None:
        if self.device.type == "cuda":  # a communicator whose collectives CUDA graphs captured can hang in its destroy
            return  # (pytorch#115388): it goes with the engine's process
        from runtime.placement.weight_sync import destroy_group
        destroy_group(self.group)


def local_expert_model(model_dir: str, dtype: torch.dtype, attn_implementation: str, shard: ExpertShard,
                       device: torch.device):
    """The HF model of ``model_dir`` on ``device`` with only ``shard``'s experts ([L, 2F, H] and [L, H, F] fused, as
    transformers holds them), the rest whole: built empty and filled from the checkpoint's safetensors one tensor at a
    time (the whole model is never in memory: a 30 B mixture is 61 GB)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from runtime.rollout.hf_weights import update_targets
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for attr in ("gate_up_proj", "down_proj"):
            whole = getattr(experts, attr)
            setattr(experts, attr, torch.nn.Parameter(
                torch.empty((shard.local, *whole.shape[1:]), dtype=whole.dtype, device="meta"), requires_grad=False))
        experts.num_experts = shard.local
    model.to_empty(device=device)
    # buffers made at build (RoPE's table) were on the meta device: made again
    model.model.rotary_emb = type(model.model.rotary_emb)(config).to(device)
    targets = update_targets(model, expert_offset=shard.first)
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    # parameter -> tensors written into it: a fused expert parameter needs one per expert and projection it fuses
    # (gate and up, or down) from the hub's keys, and counts that many from transformers' fused key
    need = {"gate_up_proj": 2 * shard.local, "down_proj": shard.local}
    written: dict[str, int] = {}
    with torch.no_grad():
        for file in files:
            with safe_open(os.path.join(model_dir, file), framework="pt") as f:
                for key in f.keys():
                    hub = hub_expert(key)
                    if hub is not None:
                        if not shard.owns(hub[1]):
                            continue
                        targets[key].copy_(f.get_tensor(key))
                        param, count = hub[0] + ("down_proj" if hub[2].startswith(".down") else "gate_up_proj"), 1
                    elif fused := _FUSED_EXPERTS.match(key):  # transformers' own layout: this shard's rows of the experts
                        targets[key].copy_(f.get_slice(key)[shard.first:shard.first + shard.local])
                        param, count = key, need[fused[2]]
                    elif key in targets:
                        targets[key].copy_(f.get_tensor(key))
                        param, count = key, 1
                    else:
                        continue
                    written[param] = written.get(param, 0) + count
    if model.config.tie_word_embeddings:
        model.tie_weights()
    missing = [n for n, _ in model.named_parameters()
               if written.get(n, 0) < need.get(n.rpartition(".")[2] if ".mlp.experts." in n else "", 1)]
    if missing:
        raise ValueError(f"{model_dir}: the checkpoint lacks {len(missing)} weight(s) of this model, e.g. {missing[:3]}")
    try:
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json: the one made from config.json stays
        pass
    return model.eval()

