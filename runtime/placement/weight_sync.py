"""Weight sync over a torch.distributed group of its own: trainer rank 0 broadcasts, engines receive.

The group is independent of the trainer's default (Megatron) group, so processes that never joined
that one (a rollout engine, an SGLang server) can be members. It is built the way SGLang builds its
`init_weights_update_group` on the server side (TCP rendezvous, a store prefixed by the group name,
c10d's group helper, ranks mapped 1:1), so the trainer can share one group with SGLang engines.
NCCL between GPUs; gloo on CPU, which is how CI tests it.

Protocol: the receiver knows (name, dtype, shape) of every tensor in advance (`metadata`), the
sender broadcasts the tensors in that order, one collective per tensor.
"""
from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Iterable, Literal

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from runtime.placement.handles import EngineHandle, TrainerHandle

Metadata = list[tuple[str, torch.dtype, tuple[int, ...]]]


def init_group(host: str, port: int, rank: int, world_size: int, *, backend: str = "gloo",
               group_name: str = "weight_update_group", timeout_s: float = 600.0):
    """Join the group; rank 0 hosts the rendezvous store. Blocks until all `world_size` members join."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{int(port)}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    # c10d resolves src ranks through this map; a group outside the default world has none.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_group(group) -> None:
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - a member already gone leaves nothing to tear down
        pass


def metadata_of(named: dict[str, torch.Tensor]) -> Metadata:
    return [(name, t.dtype, tuple(t.shape)) for name, t in named.items()]


def send(group, named: dict[str, torch.Tensor], device: str | torch.device) -> int:
    """Broadcast every tensor (in dict order) from rank 0; returns the bytes sent."""
    sent = 0
    for t in named.values():
        t = t.detach()
        if t.device != torch.device(device) or not t.is_contiguous():
            t = t.to(device).contiguous()
        dist.broadcast(t, src=0, group=group)
        sent += t.numel() * t.element_size()
    return sent


def receive(group, metadata: Metadata, device: str | torch.device,
            into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Receive the tensors named in `metadata`. Where `into` has a contiguous tensor of the same
    name, dtype, shape and device, it is received in place (no extra copy of the weights)."""
    out: dict[str, torch.Tensor] = {}
    dev = torch.device(device)
    for name, dtype, shape in metadata:
        target = (into or {}).get(name)
        if (target is not None and target.dtype == dtype and tuple(target.shape) == tuple(shape)
                and target.device == dev and target.is_contiguous()):
            buf = target
        else:
            buf = torch.empty(shape, dtype=dtype, device=dev)
        dist.broadcast(buf, src=0, group=group)
        out[name] = buf
    return out


def backend_for(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def as_metadata(items: Iterable) -> Metadata:
    """Metadata from plain (name, dtype-or-str, shape) triples, e.g. after a trip through JSON."""
    out = []
    for name, dtype, shape in items:
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.removeprefix("torch."))
        out.append((name, dtype, tuple(int(s) for s in shape)))
    return out


# How `direct` weight sync carries the tensors: "as_is" (in-process; between local processes torch's own
# pickling shares CUDA tensors by IPC), "cuda_ipc" (Ray actors sharing a GPU: each engine maps the handles
# of the trainer rank on its GPU, runtime/placement/cuda_ipc.py), "host" (through host memory: Ray's object store).
DirectTransport = Literal["as_is", "cuda_ipc", "host"]


class TrainerToEngine:
    """The weight path from a trainer group to an engine group, for one build of the actors.

    What goes is the trainer's `engine_weights`: the HF-named weights, or with LoRA the adapters only.
    `direct`: they are handed over by call (`transport`: as they are, by CUDA IPC handle, or through host
    memory). `broadcast`: trainer rank 0 and every engine rank join a group of their own and the tensors go
    over it.
    """

    def __init__(self, trainer: TrainerHandle, engine: EngineHandle, mode: str, transport: DirectTransport,
                 group_name: str):
        self.trainer, self.engine, self.mode, self.transport = trainer, engine, mode, transport
        self.metadata: Metadata = []
        self._group_name, self._joins = group_name, 0
        if mode == "broadcast":
            self._join()
            self.metadata = trainer.weights_metadata()

    def _join(self) -> None:
        # c10d keeps the names of groups already made: a re-join takes a fresh one
        name = self._group_name if not self._joins else f"{self._group_name}_{self._joins}"
        self._joins += 1
        host, port = self.trainer.weight_sync_address()
        world = 1 + self.engine.weight_sync_ranks()
        joining = self.trainer.init_weight_sync(host, port, world, name)
        self.engine.init_weight_sync(host, port, 1, world, name)  # engine ranks from 1
        joining.get()

    def push(self, version: int) -> dict[str, float]:
        """The trainer's weights into the engines as `version`. Returns what trainer rank 0 reported sending
        (broadcast: bytes, the largest unit's bytes, seconds); {} by the direct paths."""
        if self.mode == "broadcast":
            # an engine restarted since the group formed is not in it (SGLang servers): form it again
            if not self.engine.weight_sync_ready():
                self._join()
            sending = self.trainer.broadcast_weights()  # runs while the engines receive
            try:
                self.engine.receive_weights(self.metadata, version)
            finally:
                sent = sending.get()[0]  # keeps the trainer's replies in step, also after an engine error
            return sent
        if self.transport == "cuda_ipc":  # a unit at a time: the engine copies each before the next is gathered
            try:
                while (shared := self.trainer.share_next_weight_unit(self.engine.shards))[0] is not None:
                    self.engine.update_weights_shared(shared, version)
                    self.trainer.release_shared_weights()
            finally:
                self.trainer.release_shared_weights(end=True)
        else:
            self.engine.update_weights(self.trainer.engine_weights(self.transport == "host"), version)
        return {}
