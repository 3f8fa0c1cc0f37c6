"""The optimizer's state and its step on the host (``train.optimizer_on_host``): ZeRO-Offload's split.

What lives where. The GPU keeps the bf16 weights and megatron DDP's gradient buffer (bf16 or fp32,
``train.grad_dtype``). The fp32 master weights and Adam's two moments live in host memory, and AdamW runs
there. They are megatron's own objects: the trainer builds megatron's optimizer as usual (the distributed
optimizer shards them over the data-parallel ranks, each rank's shard on its own host), but its fp32 masters
are made on the host (:class:`_MastersOnHost`) and the Adam moments, made like the masters, follow them. So
megatron's bookkeeping (param groups the LR schedule writes, the masters' tensor-parallel attributes, the
checkpoint code of runtime/trainer/optimizer_checkpoint.py) is unchanged, and a checkpoint loads straight
into the host masters.

A step (:meth:`HostAdam.step`), replacing megatron's ``optimizer.step()`` after ``finalize_model_grads``:

1. the grad norm as megatron computes it: this rank's gradients (its shard of each bucket under the distributed
   optimizer), without shared parameters and tensor-parallel duplicates, squared, summed over the optimizer's
   grad-stats group (every rank with the distributed optimizer, the TP group without), square root; the clip
   coefficient ``clip_grad / (norm + 1e-6)`` when it is below 1;
2. the rank's gradients stream to pinned host buffers in chunks of ``chunk_elems`` on a side stream (a ring of
   ``ring`` buffers, the copy of chunk i+ring starting when the host has read chunk i);
3. per chunk on the host: the gradients to fp32 (times the clip coefficient), torch's fused AdamW over the
   chunk's pieces of the masters, one call per param group (its lr and weight decay, as the schedule set them);
   the updated masters rounded to bf16 into a pinned buffer and streamed to the GPU weights on another side
   stream while the host goes on with the next chunk;
4. with the distributed optimizer, megatron's all-gather of the updated shards over the DP ranks.

Under expert parallelism megatron chains two optimizers, the dense parameters' (over the data-parallel ranks) and
the experts' (over the expert-data-parallel ranks, their own gradient buffers): each one's masters and buffers are
planned into chunks as above, and the norm is megatron's chained one (one sum over a shared grad-stats group, else
the root of the sum of each optimizer's squared norm), its clip coefficient applied to both.

Adam's step count is the same per-parameter ``state["step"]`` torch keeps (checkpointed as before). Updates
equal megatron's GPU step within float rounding (another summation order of the norm, the fused kernel): the
the per-update contract of docs/resume.md, tested on CPU against megatron's own optimizer.

Why not megatron-core's ``HybridDeviceOptimizer`` (``OptimizerConfig.optimizer_cpu_offload``, 0.16.1): without
Transformer Engine no path keeps the fp32 master on the host. With ``use_precision_aware_optimizer`` (its
supported path: the distributed optimizer then hands it the bf16 shards and the host makes the fp32 master)
``OptimizerConfig.__post_init__`` calls ``is_te_min_version`` before it looks at ``optimizer_cpu_offload``, a
TypeError without TE (optimizer_config.py:383). Without it, the distributed optimizer makes the fp32 master
beside the weights on the GPU (distrib_optimizer.py:399 ``shard_model_param.clone().float()``, with fp32
main grads beside it, :2419 ``.grad = shard_model_grad.float()``), and HybridDeviceOptimizer pins a second fp32
copy of it on the host (hybrid_optimizer.py ``_get_sub_optimizer_param_groups``), steps that, and copies it
back into the GPU master after every step (``param_copy_back_gpu_hook``): Adam's moments leave the GPU, the
master and an fp32 gradient copy stay. (It also needs CUDA streams to be built: not constructible on CPU.)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from runtime.trainer.optimizer_checkpoint import inner_optimizers

# Elements per transfer chunk: a power of two, so the pinned buffers (the caching host allocator rounds each
# allocation up to a power of two) waste nothing; 32 Mi elements = 64 MiB of bf16.
CHUNK_ELEMS = 1 << 25
RING = 2  # pinned buffers per direction: one being copied while the host works on the other


class _MastersOnHost(TorchFunctionMode):
    """While megatron builds its optimizer, the fp32 master copies it makes of half-precision weights
    (``.clone().float()`` of a weight or its DP shard) are made in host memory, never beside the weights."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float and not kwargs and len(args) == 1:
            t = args[0]
            if t.is_cuda and t.dtype in (torch.bfloat16, torch.float16):
                return t.to("cpu").float()
        return func(*args, **kwargs)


def masters_on_host():
    """Context for ``get_megatron_optimizer`` when the optimizer lives on the host (see :class:`_MastersOnHost`)."""
    return _MastersOnHost()


@dataclass
class _Piece:
    """A contiguous run of one fp32 master inside a chunk: master elements [lo, hi) <-> chunk [at, at + hi - lo),
    and the model weight's flat elements [wlo, wlo + hi - lo)."""
    master: torch.Tensor
    weight: torch.nn.Parameter
    lo: int
    hi: int
    at: int
    wlo: int


@dataclass
class _Chunk:
    """``numel`` elements of one bucket's gradient buffer starting at ``start`` (this rank's part of it), updated by
    the ``part``-th of the chained optimizers."""
    grad: torch.Tensor  # the GPU gradient bucket (a view of the DDP buffer; the region is taken at copy time)
    start: int
    numel: int
    part: int = 0
    pieces: list[_Piece] = field(default_factory=list)


class HostAdam:
    """The host half of the trainer's optimizer (module doc). ``optimizer``: what ``get_megatron_optimizer``
    returned for ``ddp`` (built under :func:`masters_on_host`); ``device``: the trainer's device."""

    def __init__(self, optimizer, ddp, device: str, chunk_elems: int = CHUNK_ELEMS, ring: int = RING):
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        self.chained = optimizer
        self.opts = inner_optimizers(optimizer)  # the dense parameters' and, under expert parallelism, the experts'
        self.opt = self.opts[0]  # the config, the DP param sync and the model chunks are common to both
        self.ddp = ddp
        self.cuda = str(device).startswith("cuda")
        self.distributed = all(isinstance(o, DistributedOptimizer) for o in self.opts)
        for o in self.opts:
            if not hasattr(o, "optimizer") or not isinstance(o.optimizer, torch.optim.Optimizer):
                raise TypeError(f"unexpected megatron optimizer {type(o).__name__}")
        buffers = list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", None) or [])
        weights = [p for buf in buffers for p in buf.params]
        if any(w.dtype == torch.float32 for w in weights):
            raise ValueError("train.optimizer_on_host needs half-precision weights (model.dtype bfloat16): fp32 "
                             "weights are their own master")
        for m in self.masters():  # made on the host already (masters_on_host); anything megatron made elsewhere moves
            if m.device.type != "cpu":
                m.data = m.data.to("cpu")
        self.group_of = {id(m): g for o in self.opts for g in o.optimizer.param_groups for m in g["params"]}
        self.state_of = {id(m): o.optimizer.state for o in self.opts for g in o.optimizer.param_groups
                         for m in g["params"]}
        self.chunk_elems, self.ring = int(chunk_elems), int(ring)
        self.chunks = [c for i, o in enumerate(self.opts) for c in self._plan(i, o, self._buffers_of(o, buffers))]
        grad_dtype = {buf.grad_dtype for buf in buffers}
        weight_dtype = {buf.param_dtype for buf in buffers}
        if len(grad_dtype) != 1 or len(weight_dtype) != 1:
            raise NotImplementedError(f"one gradient and weight dtype expected, got {grad_dtype}, {weight_dtype}")
        self.grad_dtype, self.weight_dtype = grad_dtype.pop(), weight_dtype.pop()
        n = min(self.chunk_elems, max((c.numel for c in self.chunks), default=1))
        pin = self.cuda and torch.cuda.is_available()
        self.grads_in = [torch.empty(n, dtype=self.grad_dtype, pin_memory=pin) for _ in range(self.ring)]
        self.weights_out = [torch.empty(n, dtype=self.weight_dtype, pin_memory=pin) for _ in range(self.ring)]
        self.grad32 = torch.empty(n, dtype=torch.float32)
        if self.cuda:
            self.d2h, self.h2d = torch.cuda.Stream(), torch.cuda.Stream()
        self.last: dict[str, float] = {}
        self._sums: dict[str, float] = {}

    # -- the layout: which gradient elements this rank updates, cut into chunks -----------------------------
    @staticmethod
    def _buffers_of(opt, buffers: list) -> list:
        """The DDP buffers whose weights' masters ``opt`` holds (the dense ones, or the experts')."""
        mine = {id(m) for g in opt.optimizer.param_groups for m in g["params"]}
        return [buf for buf in buffers if any(id(getattr(p, "main_param", None)) in mine for p in buf.params)]

    def _plan(self, part: int, opt, buffers: list) -> list[_Chunk]:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        dp_rank, dp = (opt.data_parallel_group.rank(), opt.data_parallel_group.size()) \
            if isinstance(opt, DistributedOptimizer) else (0, 1)
        chunks: list[_Chunk] = []
        for buf in buffers:
            for bucket in buf.buckets:
                n = bucket.grad_data.numel()
                lo, hi = dp_rank * n // dp, (dp_rank + 1) * n // dp  # megatron's shard of a bucket (n % dp == 0)
                entries = []
                for w in bucket.params_list:
                    ws, we, _ = buf.param_index_map[w]
                    ps, pe = max(ws - bucket.offset, lo), min(we - bucket.offset, hi)
                    if pe <= ps:
                        continue
                    m = w.main_param  # megatron's master of this rank's part of w
                    if m is None or m.numel() != pe - ps:
                        raise ValueError(f"master of a {tuple(w.shape)} weight has {None if m is None else m.numel()} "
                                         f"elements, its shard {pe - ps}")
                    entries.append((ps, pe, m, w, ps - (ws - bucket.offset)))
                entries.sort(key=lambda e: e[0])
                for c0 in range(lo, hi, self.chunk_elems):
                    c1 = min(c0 + self.chunk_elems, hi)
                    chunk = _Chunk(bucket.grad_data, c0, c1 - c0, part)
                    for ps, pe, m, w, wofs in entries:
                        a, b = max(ps, c0), min(pe, c1)
                        if b > a:
                            chunk.pieces.append(_Piece(m, w, a - ps, b - ps, a - c0, wofs + a - ps))
                    if chunk.pieces:
                        chunks.append(chunk)
        return chunks

    # -- the step -----------------------------------------------------------------------------------------
    def masters(self) -> list[torch.Tensor]:
        return [p for o in self.opts for g in o.optimizer.param_groups for p in g["params"]]

    def _state(self, m: torch.Tensor) -> dict:
        state = self.state_of[id(m)][m]
        if "exp_avg" not in state:  # Adam's moments appear at the first step, as torch's AdamW makes them
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(m, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def grad_norm(self) -> float:
        """Megatron's ``get_grad_norm_fp32`` over this rank's gradients: shared parameters and tensor-parallel
        duplicates left out, squares summed in fp32 over the grad-stats group; chained (expert parallelism) as
        megatron's ChainedOptimizer: one sum where the optimizers share that group, else the root of the sum of
        their squared norms."""
        from megatron.core import tensor_parallel
        from megatron.core.transformer.module import param_is_not_shared
        squares: list[list[torch.Tensor]] = [[] for _ in self.opts]
        for chunk in self.chunks:
            grad = chunk.grad.view(-1)
            tp_group = getattr(self.opts[chunk.part], "tp_group", None)
            for p in chunk.pieces:
                m = p.master
                if param_is_not_shared(m) and tensor_parallel.param_is_not_tensor_parallel_duplicate(m, tp_group):
                    g = grad[chunk.start + p.at: chunk.start + p.at + p.hi - p.lo]
                    squares[chunk.part].append(torch.linalg.vector_norm(g, dtype=torch.float32).square())
        dev = self.chunks[0].grad.device if self.chunks else torch.device("cuda" if self.cuda else "cpu")

        def summed(parts: list[int]) -> torch.Tensor:
            found = [x for i in parts for x in squares[i]]
            total = (torch.stack(found).sum() if found else torch.zeros((), dtype=torch.float32, device=dev)).reshape(1)
            torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM,
                                         group=self.opts[parts[0]].get_grad_stats_parallel_group())
            return total
        shared = len(self.opts) == 1 or self.chained.grads_states_parallel_group_is_shared()
        if shared:
            return float(summed(list(range(len(self.opts)))).item()) ** 0.5
        return sum(float(summed([i]).item()) for i in range(len(self.opts))) ** 0.5

    def _fetch(self, i: int) -> None:
        """Start copying chunk i's gradients into its ring buffer."""
        chunk = self.chunks[i]
        src = chunk.grad.view(-1)[chunk.start: chunk.start + chunk.numel]
        dst = self.grads_in[i % self.ring][:chunk.numel]
        if self.cuda:
            with torch.cuda.stream(self.d2h):
                dst.copy_(src, non_blocking=True)
                self._fetched[i] = self.d2h.record_event()
        else:
            dst.copy_(src)

    def _store(self, i: int) -> None:
        """Start copying chunk i's new weights (in its ring buffer) into the model's weights."""
        out = self.weights_out[i % self.ring]
        for p in self.chunks[i].pieces:
            dst = p.weight.data.view(-1)[p.wlo: p.wlo + p.hi - p.lo]
            src = out[p.at: p.at + p.hi - p.lo]
            if self.cuda:
                with torch.cuda.stream(self.h2d):
                    dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src)
        if self.cuda:
            self._stored[i] = self.h2d.record_event()

    @torch.no_grad()
    def step(self) -> tuple[bool, float, None]:
        """One optimizer step over the gradients in the DDP buffer; ``(True, grad norm, None)`` like megatron's."""
        from torch.optim.adamw import adamw
        t0 = time.perf_counter()
        self._fetched: dict[int, torch.cuda.Event] = {}
        self._stored: dict[int, torch.cuda.Event] = {}
        if self.cuda:  # the side streams start after the backward and the gradient reduction
            self.d2h.wait_stream(torch.cuda.current_stream())
            self.h2d.wait_stream(torch.cuda.current_stream())
        n = len(self.chunks)
        for i in range(min(self.ring, n)):
            self._fetch(i)
        norm = self.grad_norm()
        clip = self.opt.config.clip_grad
        coeff = clip / (norm + 1.0e-6) if clip > 0 else 1.0
        t_norm = time.perf_counter()
        states = {id(m): self._state(m) for m in self.masters()}
        step_before = {k: float(s["step"]) for k, s in states.items()}
        wait_s = adam_s = 0.0
        for i, chunk in enumerate(self.chunks):
            tw = time.perf_counter()
            if self.cuda:
                self._fetched.pop(i).synchronize()
            wait_s += time.perf_counter() - tw
            g32 = self.grad32[:chunk.numel]
            g32.copy_(self.grads_in[i % self.ring][:chunk.numel])
            if i + self.ring < n:
                self._fetch(i + self.ring)  # its buffer is free now
            if coeff < 1.0:
                g32.mul_(coeff)
            if self.cuda and i >= self.ring:
                tw = time.perf_counter()
                self._stored.pop(i - self.ring).synchronize()  # chunk i - ring's weights left this buffer
                wait_s += time.perf_counter() - tw
            ta = time.perf_counter()
            by_group: dict[int, list[_Piece]] = {}
            for p in chunk.pieces:
                by_group.setdefault(id(self.group_of[id(p.master)]), []).append(p)
            for pieces in by_group.values():
                group = self.group_of[id(pieces[0].master)]
                params, grads, avgs, sqs, steps = [], [], [], [], []
                for p in pieces:
                    st = states[id(p.master)]
                    params.append(p.master.data.view(-1)[p.lo:p.hi])
                    grads.append(g32[p.at: p.at + p.hi - p.lo])
                    avgs.append(st["exp_avg"].view(-1)[p.lo:p.hi])
                    sqs.append(st["exp_avg_sq"].view(-1)[p.lo:p.hi])
                    steps.append(torch.tensor(step_before[id(p.master)], dtype=torch.float32))
                beta1, beta2 = group["betas"]
                adamw(params, grads, avgs, sqs, [], steps, foreach=False, fused=True, amsgrad=False,
                      beta1=beta1, beta2=beta2, lr=float(group["lr"]), weight_decay=float(group["weight_decay"]),
                      eps=group["eps"], maximize=False)
            out = self.weights_out[i % self.ring]
            for p in chunk.pieces:
                out[p.at: p.at + p.hi - p.lo].copy_(p.master.data.view(-1)[p.lo:p.hi])
            adam_s += time.perf_counter() - ta
            self._store(i)
        for k, s in states.items():
            s["step"].fill_(step_before[k] + 1)
        tw = time.perf_counter()
        if self.cuda:
            for ev in self._stored.values():
                ev.synchronize()
            torch.cuda.current_stream().wait_stream(self.d2h)  # the gradient buffer is zeroed on this stream next
        t_done = time.perf_counter()
        if self.distributed and not self.opt.ddp_config.overlap_param_gather:
            from runtime.mcore import env as menv
            with menv.cuda_to_cpu():
                for model_chunk in self.opt.model_chunks:
                    model_chunk.start_param_sync()  # the updated shards to every DP rank (megatron's all-gather)
        moved = sum(c.numel for c in self.chunks)
        self.last = {"step_s": time.perf_counter() - t0, "norm_s": t_norm - t0, "adam_s": adam_s,
                     "wait_s": wait_s + (t_done - tw), "chunks": n,
                     "d2h_bytes": moved * self.grads_in[0].element_size(),
                     "h2d_bytes": moved * self.weights_out[0].element_size()}
        for k in ("adam_s", "wait_s"):
            self._sums[k] = self._sums.get(k, 0.0) + self.last[k]
        return True, norm, None

    def pop_metrics(self) -> dict[str, float]:
        """Seconds since the last call: the host's AdamW (with the casts around it), and the host waiting on
        the transfers (what the overlap did not hide)."""
        out = {"optimizer_host_adam_s": self._sums.get("adam_s", 0.0),
               "optimizer_transfer_wait_s": self._sums.get("wait_s", 0.0)}
        self._sums = {}
        return out

    def host_bytes(self) -> dict[str, int]:
        """What this rank holds on the host: masters, Adam's moments, the transfer buffers (pinned on a GPU)."""
        masters = sum(m.numel() * m.element_size() for m in self.masters())
        moments = sum(v.numel() * v.element_size() for o in self.opts for s in o.optimizer.state.values()
                      for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))
        buffers = sum(b.numel() * b.element_size() for b in (*self.grads_in, *self.weights_out))
        return {"masters": masters, "moments": moments, "buffers": buffers,
                "scratch": self.grad32.numel() * self.grad32.element_size()}
