"""The trainer's state off the GPU while a colocated engine generates, and back for the update.

What moves: megatron DDP's fp32 gradient buffers, the optimizer's fp32 master weights and Adam's
moments (about 16 bytes per parameter: 8.9 GiB of Qwen3-0.6B's 10 GiB of trainer state). The bf16
weights stay: the forward of the next step and the weight sync need them. With the distributed optimizer
(``train.distributed_optimizer``) the masters and moments are this rank's 1/DP shards
(``shard_fp32_from_float16_groups`` and the inner optimizer's state); its fp32-weight shards are views of
the weights and stay, as does anything else that shares a storage with a parameter.

How: each tensor's storage is copied to a pinned CPU buffer (non-blocking copies, one synchronise for
all), then shrunk to 0 bytes (``untyped_storage().resize_(0)``), which returns its memory to the
caching allocator for the engine's KV pool. Every tensor and view that points at the storage (the
parameters' ``main_grad`` views into the DDP buffer, the optimizer's param groups) stays the same
Python object; reloading grows the storage back and copies the bytes in, so nothing is rebuilt and
the state after a round trip is bitwise the state before. The pinned buffers are allocated once and
reused (pinning ~9 GiB takes seconds; copying it takes a fraction of one).

With the optimizer on the host (``train.optimizer_on_host``, runtime/trainer/host_optimizer.py) the masters and
moments never are on the GPU, so only the gradient buffers leave it, and they are dropped rather than copied:
every step starts by zeroing them, so their bytes are not worth a copy either way (they come back as zeros).
"""
from __future__ import annotations

import time

import torch


class StateOffload:
    def __init__(self, trainer):
        self.trainer = trainer
        self.storages: list = []        # the storages offloaded now, with their sizes and buffers
        self.buffers: dict[int, torch.Tensor] = {}  # position in the walk -> CPU buffer, reused
        self.offloaded = False

    # the tensors that move, each storage once, in a fixed order (the buffers are reused by position)
    def _tensors(self) -> list[torch.Tensor]:
        tr = self.trainer
        out = []
        for buf in list(getattr(tr.ddp, "buffers", [])) + list(getattr(tr.ddp, "expert_parallel_buffers", [])):
            if getattr(buf, "grad_data", None) is not None:
                out.append(buf.grad_data)
        if getattr(tr, "host_optimizer", None) is not None:
            return out  # the optimizer's state lives on the host already
        opts = getattr(tr.optimizer, "chained_optimizers", None) or [tr.optimizer]
        model_params = {id(p) for p in tr.model.parameters()}
        for opt in opts:
            # fp32 master copies: whole (mixed-precision optimizer) or this DP rank's shards (distributed)
            for attr in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
                for group in getattr(opt, attr, None) or []:
                    out.extend(p for p in group if p is not None and id(p) not in model_params)
            inner = getattr(opt, "optimizer", opt)
            for group in inner.param_groups:
                for p in group["params"]:
                    for v in inner.state.get(p, {}).values():
                        if isinstance(v, torch.Tensor) and v.numel() > 1:  # Adam's moments, not its step count
                            out.append(v)
        return out

    def _unique_storages(self, force: bool) -> list:
        # the weights stay (under the distributed optimizer fp32 weights are the masters' storage)
        seen = {p.untyped_storage().data_ptr() for p in self.trainer.model.parameters()}
        out = []
        for t in self._tensors():
            st = t.untyped_storage()
            if st.nbytes() == 0 or st.data_ptr() in seen or (t.device.type != "cuda" and not force):
                continue
            seen.add(st.data_ptr())
            out.append(st)
        return out

    def offload(self, force: bool = False) -> dict[str, float]:
        if self.offloaded:
            return {"bytes": 0.0, "seconds": 0.0}
        on_gpu = str(self.trainer.device).startswith("cuda")
        if not on_gpu and not force:
            return {"bytes": 0.0, "seconds": 0.0}
        t0 = time.time()
        storages = self._unique_storages(force)
        moved = dropped = 0
        drop = getattr(self.trainer, "host_optimizer", None) is not None  # only gradients: zeroed before use
        for pos, st in enumerate(storages):
            n = st.nbytes()
            if drop:
                self.buffers[pos] = torch.empty(n, dtype=torch.uint8, device="meta")  # its size only
                dropped += n
                continue
            buf = self.buffers.get(pos)
            if buf is None or buf.numel() != n:
                buf = torch.empty(n, dtype=torch.uint8, pin_memory=on_gpu and torch.cuda.is_available())
                self.buffers[pos] = buf
            buf.copy_(_bytes_of(st), non_blocking=on_gpu)
            moved += n
        if on_gpu:
            torch.cuda.synchronize()
        for st in storages:
            st.resize_(0)
        drop_regrowable_caches(self.trainer.model)
        if on_gpu:
            # hand the freed blocks back to the driver: the allocator would keep them cached (reserved), and
            # the engine's KV pool, too large to fit into them, would be allocated beside them
            torch.cuda.empty_cache()
        self.storages = [(st, pos) for pos, st in enumerate(storages)]
        self.offloaded = True
        out = {"bytes": float(moved), "seconds": time.time() - t0}
        if on_gpu:  # what the trainer keeps on its GPU while the engine generates: the weights, ideally
            out["resident_bytes"] = float(torch.cuda.memory_reserved(self.trainer.device))
        if drop:
            out["dropped_bytes"] = float(dropped)
        return out

    def reload(self) -> dict[str, float]:
        if not self.offloaded:
            return {"bytes": 0.0, "seconds": 0.0}
        on_gpu = str(self.trainer.device).startswith("cuda")
        t0 = time.time()
        moved = 0
        for st, pos in self.storages:
            buf = self.buffers[pos]
            st.resize_(buf.numel())
            if buf.is_meta:
                _bytes_of(st).zero_()
                continue
            _bytes_of(st).copy_(buf, non_blocking=on_gpu)
            moved += buf.numel()
        if on_gpu:
            torch.cuda.synchronize()  # the pinned buffers are written again at the next offload
        self.storages = []
        self.offloaded = False
        return {"bytes": float(moved), "seconds": time.time() - t0}


def drop_regrowable_caches(model) -> None:
    """Empty megatron's caches that a step fills and the next one remakes on demand: the rotary embeddings per
    sequence length (an ``lru_cache`` on ``RotaryEmbedding.forward``, up to 32 tensors, a new one for each packed
    micro-batch's longest sample) and the tensor-parallel global memory buffer. They are made mid-step, while the
    step's freed activations sit in the caching allocator, so one of a few MiB can land inside such a block and keep
    that block's whole segment (GiBs) reserved through ``empty_cache``, beside the engine that needs it. (On 2 x H100
    with GLM-Z1-9B a trainer rank once kept over 7 GiB more than its weights while the engine generated; with this
    and ``release_shared_weights``' ipc_collect it keeps its weights alone, bench/results/glm9b_host_optimizer_*.)"""
    from megatron.core import parallel_state
    for forward in {type(m).forward for m in model.modules()}:
        if hasattr(forward, "cache_clear"):
            forward.cache_clear()
    buffer = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    if buffer is not None:
        buffer.buffer.clear()


def _bytes_of(storage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
