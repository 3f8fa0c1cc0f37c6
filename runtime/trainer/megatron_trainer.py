"""The policy trainer: a megatron-core GPTModel with Megatron's DDP, optimizer and LR schedule.

A plain class: `cluster.backend: local` runs it in-process, `cluster.backend: ray` places one per rank
as a Ray actor. Every rank of a data/tensor-parallel group gets the whole rollout batch and takes its
own slice, so the driver never needs to know the layout.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator

import torch

from runtime.algo import grpo_loss
from runtime.config import AlgorithmSection, TrainSection
from runtime.mcore.determinism import fix_cublas_workspace, strict_if_deterministic, trainer_compute
from runtime.testing.moments import moment
from runtime.trainer.batch import (TrainBatch, by_length, pack, pack_varlen, padding_micro_batch, step_slices,
                                   token_budget_micro_batches)
from runtime.trainer import expert_parallel, router_losses, routing_replay
from runtime.trainer.checkpoint_writer import CheckpointWriter
from runtime.trainer.state_offload import StateOffload
from runtime.trainer.tp_replicas import replicated_parameters, take_rank0_gradients


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class MegatronTrainer:
    def __init__(self, *, hf_dir: str, init_checkpoint: str, train: TrainSection, algorithm: AlgorithmSection,
                 temperature: float, rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, device: str = "cpu", dtype: str = "float32",
                 num_threads: int | None = None, true_on_policy: bool = False):
        """true_on_policy (``rollout.true_on_policy``, TP 1): the model's attention, norms and linear layers and the
        log-prob forward on the batch-invariant kernels the built-in engine runs (runtime/mcore/batch_invariant.py),
        so the training forward's log-prob of a token sampled under these weights is bitwise the engine's."""
        if not isinstance(train, TrainSection) or not isinstance(algorithm, AlgorithmSection):
            raise TypeError("MegatronTrainer takes the config's TrainSection and AlgorithmSection "
                            f"(got {type(train).__name__}, {type(algorithm).__name__})")
        if num_threads:
            torch.set_num_threads(num_threads)
        if train.deterministic:  # before the process's first cuBLAS handle
            fix_cublas_workspace()
        from runtime.mcore import env as menv  # first: it quiets megatron's import-time TE/Apex warnings

        from megatron.core import parallel_state as mpu
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from runtime.mcore.convert import load_torch_dist_into
        from runtime.models import load_hf_config

        self.train_cfg, self.algo, self.temperature = train, algorithm, temperature
        self.true_on_policy = bool(true_on_policy)
        if self.true_on_policy and train.tensor_parallel != 1:
            from runtime.errors import ConfigError
            raise ConfigError(f"rollout.true_on_policy needs train.tensor_parallel=1 (got {train.tensor_parallel}): "
                              f"TP > 1 is out of scope (issue 61)")
        self.device = device
        self.rank, self.world_size = rank, world_size
        self.hf_config = load_hf_config(hf_dir)
        expert_parallel.check(train, self.hf_config, world_size)
        menv.init_parallel(rank=rank, world_size=world_size, tp=train.tensor_parallel, master_addr=master_addr,
                           master_port=master_port, device=device, ep=train.expert_parallel)
        self.mpu = mpu
        self.dp_rank, self.dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
        self.tp_size = mpu.get_tensor_model_parallel_world_size()
        # expert parallelism: the DP ranks whose micro-batches this rank's pair up with (expert_parallel.py)
        self.expert_group = expert_parallel.group_dp_ranks(self.dp_rank) if train.expert_parallel > 1 else None
        self.params_dtype = _dtype(dtype)
        self.model = self._build_model(train=True)
        load_torch_dist_into(self.model, init_checkpoint)
        self.lora = train.lora if train.lora.enabled else None  # the base frozen, adapters trained
        if self.lora is not None and router_losses.is_moe(self.hf_config):
            from runtime.errors import ConfigError
            raise ConfigError(f"train.lora on a mixture of experts ({self.hf_config.model_type}) is not supported; "
                              f"set train.lora.enabled: false")
        if self.lora is not None:
            from runtime.trainer import lora
            lora.attach(self.model, self.lora, seed=train.seed, batch_invariant=self.true_on_policy)
        self.ref_model = None  # with LoRA the reference is the base with the adapters off: no second model
        self.tp_replicas = replicated_parameters(self.model) if self.tp_size > 1 else []
        if algorithm.kl_coef > 0 and self.lora is None:
            self.ref_model = self._build_model(train=False)
            load_torch_dist_into(self.ref_model, init_checkpoint)
            self.ref_model.eval().requires_grad_(False)

        from runtime.trainer.host_optimizer import masters_on_host
        with menv.cuda_to_cpu(), (masters_on_host() if train.optimizer_on_host else contextlib.nullcontext()):
            # train.grad_dtype: fp32 gradient buffer (reduced in fp32) or the weights' own dtype;
            # train.distributed_optimizer: master weights + Adam sharded over DP, gradients reduce-scattered
            distributed = bool(train.distributed_optimizer)
            self.ddp = DistributedDataParallel(
                self.model.config, DistributedDataParallelConfig(
                    grad_reduce_in_fp32=train.grad_dtype == "float32", overlap_grad_reduce=False,
                    use_distributed_optimizer=distributed), self.model)
            bf16 = self.params_dtype == torch.bfloat16
            self.optimizer = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=train.lr, min_lr=train.min_lr, weight_decay=train.weight_decay,
                adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2, clip_grad=train.clip_grad,
                bf16=bf16, params_dtype=self.params_dtype, use_distributed_optimizer=distributed), [self.ddp])
        total_steps = train.num_rollout * train.num_steps_per_rollout
        warmup = train.lr_warmup_steps
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if warmup else train.lr, max_lr=train.lr,
            min_lr=train.min_lr, lr_warmup_steps=warmup,
            lr_decay_steps=max(total_steps, warmup + 1), lr_decay_style=train.lr_decay_style,
            start_wd=train.weight_decay, end_wd=train.weight_decay,
            wd_incr_steps=max(total_steps, 1), wd_incr_style="constant")
        self.adapter = None
        self._share_stream = None  # share_next_weight_unit's units, while a CUDA IPC push runs
        self._shared_weights = None
        self.steps_done = 0
        self.host_optimizer = None  # train.optimizer_on_host: masters, Adam and the step on the host
        if train.optimizer_on_host:
            from runtime.trainer.host_optimizer import HostAdam
            self.host_optimizer = HostAdam(self.optimizer, self.ddp, device)
        self.offload = StateOffload(self)
        self.writer = CheckpointWriter()  # a checkpoint's files written beside training (save_begin/save_finish)

    def _build_model(self, train: bool):
        """The GPTModel with the config's attention, fusions and (for the trained copy) recomputation."""
        from runtime.mcore import env as menv
        from runtime.mcore.varlen_attention import check_available
        t = self.train_cfg
        if self.packs and str(self.device).startswith("cuda") and not self.true_on_policy:
            check_available(t.packed_attention)
        recompute = dict(recompute=t.recompute, recompute_modules=tuple(t.recompute_modules),
                         recompute_num_layers=t.recompute_num_layers) if train else {}
        moe = router_losses.is_moe(self.hf_config)
        if moe:
            recompute.update(router_losses.config_overrides(t))
        if moe and train:  # replay slots, used when a batch carries the engine's routes (rollout.routing_replay)
            recompute.update(routing_replay.config_overrides())
        model = menv.build_gpt_model(self.hf_config, dtype=self.params_dtype, device=self.device, init_weights=False,
                                     fusions=t.fusions, core_attention=t.core_attention, packed=self.packs,
                                     packed_attention=t.packed_attention, batch_invariant=self.true_on_policy,
                                     grouped_experts=self._grouped_experts(), **recompute)
        routing_replay.own_routers(model)
        return model

    def _grouped_experts(self) -> bool:
        """``train.moe_grouped_gemm``: auto = on CUDA."""
        setting = self.train_cfg.moe_grouped_gemm
        return str(self.device).startswith("cuda") if setting == "auto" else setting == "on"

    @property
    def packs(self) -> bool:
        """Micro-batches by token budget, packed without padding (``train.max_tokens_per_micro_batch``)."""
        return self.train_cfg.max_tokens_per_micro_batch is not None

    # -- introspection -------------------------------------------------------------------------
    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> bool:
        return True

    # -- forward -------------------------------------------------------------------------------
    def _causal_mask(self, s: int) -> torch.Tensor:
        return torch.triu(torch.ones(s, s, dtype=torch.bool, device=self.device), diagonal=1).view(1, 1, s, s)

    def _chunked_logprobs_enabled(self) -> bool:
        """The chunked output-layer path (no full-vocab fp32 logits): TP 1; ``train.chunked_logprobs``
        auto = on CUDA, on/off forces it (CPU tests use on)."""
        if self.tp_size != 1:
            return False
        if self.true_on_policy:  # the engine's log-prob: the output layer and the log-softmax, batch-invariant
            return True
        setting = self.train_cfg.chunked_logprobs
        if setting != "auto":
            return setting == "on"
        return str(self.device).startswith("cuda")

    def _forward(self, model, mb):
        """The model on a micro-batch's forward layout (packed: megatron's thd packed-sequence params)."""
        extra = {} if mb.group_padding is None else {"padding_mask": mb.group_padding}
        if not mb.packed:
            return model(mb.input_ids, mb.position_ids, self._causal_mask(mb.input_ids.shape[1]), **extra)
        from megatron.core.packed_seq_params import PackedSeqParams
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=mb.cu_seqlens, cu_seqlens_kv=mb.cu_seqlens,
                                 max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen)
        return model(mb.input_ids, mb.position_ids, None, packed_seq_params=params, **extra)

    def _micro_batches(self, idx: list[int], batch: TrainBatch) -> list[list[int]]:
        """``idx`` cut into micro-batches: by token budget when packing, else micro_batch_size samples of like length."""
        lengths = [len(t) for t in batch.tokens]
        if self.packs:
            return token_budget_micro_batches(idx, lengths, self.train_cfg.max_tokens_per_micro_batch)
        order, mbs = by_length(idx, lengths), self.train_cfg.micro_batch_size
        return [order[s: s + mbs] for s in range(0, len(order), mbs)]

    def _pack(self, batch: TrainBatch, idx: list[int], length: int | None = None):
        if self.packs:
            return pack_varlen(batch, idx, self.device, length=length)
        return pack(batch, idx, self.device, length=length)

    def _padding_pass(self, length: int) -> None:
        """Forward and backward of a micro-batch of ``length`` padding tokens, gradient 0: expert parallelism, where
        this rank has fewer micro-batches than its expert group (the MoE layers' token gathers are collective)."""
        mb = padding_micro_batch(length, self.device)
        with router_losses.off(self.model):
            out = self._forward(self.model, mb)
            with strict_if_deterministic():
                (out.float().sum() * 0.0).backward()

    def _token_logprobs(self, model, mb, with_entropy: bool = False, entropy_grad: bool = False, select=None):
        """log p(target) of logits/temperature for every position; vocab-parallel under TP. Returned in
        the micro-batch's sample layout ([k, S-1], see ``PackedMicroBatch``).

        On the chunked path only the positions in `select` (forward layout, bool; default: where the
        loss mask is > 0) get log-probs and entropy (0 elsewhere), and the output layer runs a chunk
        of rows at a time (runtime/trainer/logprobs.py), so no [b, s, vocab] fp32 logits exist.
        """
        if self._chunked_logprobs_enabled():
            logp, entropy = self._token_logprobs_chunked(model, mb, with_entropy, entropy_grad, select)
        else:
            logp, entropy = self._token_logprobs_full(model, mb, with_entropy, entropy_grad)
        return mb.to_rows(logp), (None if entropy is None else mb.to_rows(entropy))

    def _token_logprobs_full(self, model, mb, with_entropy: bool, entropy_grad: bool):
        from megatron.core import tensor_parallel
        logits = self._forward(model, mb)
        logits = logits[:, :-1].float() / self.temperature  # [b, s-1, V/tp]
        entropy = None
        if with_entropy:  # a metric unless entropy_coef > 0: no graph for it then
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropy = self._entropy(logits)
        # clone: for b == 1 the transpose is a view, and megatron's cross-entropy works in place
        ce = tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous().clone(),
                                                          mb.targets.transpose(0, 1).contiguous())
        logp = -ce.transpose(0, 1)
        return logp, entropy

    def _token_logprobs_chunked(self, model, mb, with_entropy: bool, entropy_grad: bool, select):
        from runtime.mcore import env as menv
        from runtime.trainer.logprobs import linear_logprobs
        gpt = menv.unwrap_model(model)
        gpt.post_process = False  # GPTModel then returns the final-norm hidden states, not logits
        try:
            hidden = self._forward(model, mb)  # [s, b, H]
        finally:
            gpt.post_process = True
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
            else gpt.output_layer.weight
        if select is None:
            select = mb.loss_select()
        select = select.to(hidden.device)
        rows = hidden[:-1].transpose(0, 1)[select]  # [n, H]: positions that predict a selected target
        logp_sel, ent_sel = linear_logprobs(rows, weight, mb.targets[select], self.temperature,
                                            with_entropy=with_entropy, batch_invariant=self.true_on_policy)
        logp = torch.zeros(select.shape, dtype=torch.float32, device=hidden.device).masked_scatter(select, logp_sel)
        entropy = None
        if with_entropy:
            if not (entropy_grad and torch.is_grad_enabled()):
                ent_sel = ent_sel.detach()
            entropy = torch.zeros(select.shape, dtype=torch.float32, device=hidden.device).masked_scatter(select, ent_sel)
        return logp, entropy

    def _entropy(self, logits: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            lp = torch.log_softmax(logits, dim=-1)
            return -(lp.exp() * lp).sum(-1)
        # Entropy over a vocab split across TP ranks: reduce max, partition function and E[logit].
        group = self.mpu.get_tensor_model_parallel_group()
        with torch.no_grad():
            m = logits.max(-1, keepdim=True).values
            torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
        e = (logits - m).exp()
        z = e.sum(-1, keepdim=True)
        ez = (e * logits).sum(-1, keepdim=True)
        z = _all_reduce_sum(z, group)
        ez = _all_reduce_sum(ez, group)
        return (torch.log(z) + m - ez / z).squeeze(-1)

    def _unpack(self, values: torch.Tensor, mb, batch: TrainBatch) -> list[list[float]]:
        out = []
        for row, i in enumerate(mb.seq_ids):
            p, n = batch.prompt_lens[i], len(batch.tokens[i]) - batch.prompt_lens[i]
            out.append(values[row, p - 1: p - 1 + n].tolist())
        return out

    @trainer_compute
    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, which: str = "policy") -> list[list[float]]:
        """Log-probs of every sample's response tokens (all samples, on every rank); "ref": the reference
        model's (with LoRA: the base, adapters off)."""
        if which == "ref" and self.lora is not None:
            from runtime.trainer import lora
            with lora.adapters_off(self.model):
                return self.compute_logprobs(batch)
        model = self.model if which == "policy" else self.ref_model
        model.eval()  # no dropout in any log-prob forward
        out: list[list[float]] = [[] for _ in range(len(batch))]
        for idx in self._micro_batches(list(range(len(batch))), batch):  # micro-batches of like lengths
            mb = self._pack(batch, idx)
            # chunked: every response position, whatever its loss mask
            select = mb.response_select(batch) if self._chunked_logprobs_enabled() else None
            # the reference routes itself: the recorded routes are the policy's
            with routing_replay.replaying(model, mb.routes if model is self.model else None):
                logp, _ = self._token_logprobs(model, mb, select=select)
            for i, values in zip(mb.seq_ids, self._unpack(logp, mb, batch)):
                out[i] = values
        return out

    # -- update --------------------------------------------------------------------------------
    @trainer_compute
    def train(self, batch: TrainBatch) -> dict[str, Any]:
        """One rollout's optimizer steps; returns metrics averaged over the rollout (same on every rank)."""
        from megatron.core.distributed import finalize_model_grads

        from runtime.mcore import env as menv

        t0 = time.time()
        self.offload.reload()  # a no-op unless the state was offloaded for the rollout
        a = self.algo
        steps = self.train_cfg.num_steps_per_rollout
        # With one step per rollout the policy has not moved yet: the old log-probs are the current
        # ones (detached in the loss), so the extra forward pass is only needed for several steps.
        if steps > 1 and batch.old_logprobs is None:
            batch.old_logprobs = self.compute_logprobs(batch)
        ref_logprobs = self.compute_logprobs(batch, "ref") if self.algo.kl_coef > 0 else None
        self.model.train()
        lengths = [len(t) for t in batch.tokens]

        def rank_slices(dp_rank: int) -> list[list[list[int]]]:
            return step_slices(len(batch), steps, self.dp_size, dp_rank, self.train_cfg.micro_batch_size,
                               lengths=lengths, max_tokens=self.train_cfg.max_tokens_per_micro_batch)
        slices = rank_slices(self.dp_rank)
        # expert parallelism: the micro-batches of every rank of the expert group, to pair this rank's up with
        group_slices = [rank_slices(r) for r in self.expert_group] if self.expert_group else None
        per_step = len(batch) // steps
        sums: dict[str, torch.Tensor] = {}
        grad_norms = []
        optimizer_s = 0.0
        for s, micro_batches in enumerate(slices):
            step_idx = list(range(s * per_step, (s + 1) * per_step))
            step_tokens = sum(sum(batch.loss_masks[i]) for i in step_idx)
            normalizer = float(step_tokens if a.loss_agg == "token_mean" else len(step_idx))
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            moe = router_losses.begin_step(self.model, len(micro_batches), self._device_obj())
            shapes = None
            if group_slices:  # one count and one shape per micro-batch across the expert group
                micro_batches, shapes = expert_parallel.equal_micro_batches(
                    [g[s] for g in group_slices], micro_batches, lengths, self.packs)
            for m, idx in enumerate(micro_batches):
                if not idx:
                    self._padding_pass(shapes[m])
                    continue
                mb = self._pack(batch, idx, shapes[m] if shapes else None)
                if self.lora is not None and self.lora.dropout > 0:
                    from runtime.trainer import lora
                    lora.set_dropout_key(self.model, (self.train_cfg.seed, self.steps_done, self.dp_rank, m))
                # rollout.routing_replay: the engine's routes through the forward and any recompute in the backward
                with routing_replay.replaying(self.model, mb.routes):
                    logp, entropy = self._token_logprobs(self.model, mb, with_entropy=True,
                                                         entropy_grad=a.entropy_coef > 0)
                    ref = None
                    if ref_logprobs is not None:
                        ref = torch.zeros_like(logp)
                        for row, i in enumerate(mb.seq_ids):
                            p = batch.prompt_lens[i]
                            ref[row, p - 1: p - 1 + len(ref_logprobs[i])] = torch.tensor(ref_logprobs[i])
                    old = mb.old_logp if mb.old_logp is not None else logp.detach()
                    loss, metrics = grpo_loss(
                        logp, old, mb.advantages, mb.resp_mask,
                        a if isinstance(a, AlgorithmSection) else AlgorithmSection.model_validate(a),
                        ref_logp=ref, entropy=entropy, rollout_logp=mb.rollout_logp, normalizer=normalizer)
                    # Megatron DDP averages gradients over DP ranks; our loss is already a global sum.
                    with strict_if_deterministic():  # train.deterministic: the backward's kernels without atomics
                        (loss * self.dp_size).backward()
                # Metrics stay on the device until the step's end: reading one here would stall the host
                # until the GPU is done, and the GPU would then idle while the next micro-batch is packed.
                # grpo_loss normalises by the whole step, so summing over micro-batches and ranks gives step values
                n_tok = mb.resp_mask.sum()
                _accumulate(sums, "_tokens", n_tok)
                for k, v in metrics.items():
                    _accumulate(sums, k, v)
                _accumulate(sums, "loss", loss.detach())
                if s == 0:
                    _accumulate(sums, "_logp_absdiff", ((logp.detach() - mb.rollout_logp).abs() * mb.resp_mask).sum())
                    _accumulate(sums, "_tokens_step0", n_tok)
            for k, v in router_losses.end_step(moe, self.dp_size).items():  # the mean over DP ranks once summed
                _accumulate(sums, k, v)
            moment("train-grads-accumulated")  # every micro-batch's backward done; grads not reduced, not applied
            finalize_model_grads([self.ddp])
            if self.tp_replicas:  # they step from TP rank 0's gradient: one tensor on every rank, as a checkpoint keeps
                take_rank0_gradients(self.tp_replicas, self.mpu.get_tensor_model_parallel_group())
            t_step = time.time()
            if self.host_optimizer is not None:
                ok, grad_norm, _ = self.host_optimizer.step()
            else:
                with menv.cuda_to_cpu():
                    ok, grad_norm, _ = self.optimizer.step()
            optimizer_s += time.time() - t_step
            self.scheduler.step(increment=1)
            self.steps_done += 1
            grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
        # average over every DP rank's tokens
        keys = sorted(sums)
        vec = torch.stack([sums[k].to(self._device_obj()) for k in keys])
        if self.dp_size > 1:
            torch.distributed.all_reduce(vec, group=self.mpu.get_data_parallel_group(with_context_parallel=False))
        total = dict(zip(keys, vec.tolist()))
        out = {k: total[k] / steps for k in keys if not k.startswith("_")}
        # how far the trainer's log-probs are from the engine's on the same weights (before any update)
        out["train_rollout_logp_absdiff"] = total["_logp_absdiff"] / max(total["_tokens_step0"], 1.0)
        out["grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["lr"] = float(self.optimizer.param_groups[0]["lr"])
        out["train_tokens"] = int(total["_tokens"])
        out["train_time_s"] = time.time() - t0
        out["optimizer_step_s"] = optimizer_s  # within train_time_s; on the host with train.optimizer_on_host
        if self.host_optimizer is not None:
            out.update(self.host_optimizer.pop_metrics())
        out["nonfinite_weights"] = self._nonfinite_weights()
        moment("train-step-done")  # weights updated in memory, nothing saved
        return out

    def _nonfinite_weights(self) -> int:
        """Trained weight tensors holding an inf or NaN after the update, the most on any rank (each holds its TP
        shard): the session stops the run on any before they reach the engine or a checkpoint."""
        flags = [torch.isfinite(p.detach()).all() for p in self.model.parameters() if p.requires_grad]
        bad = (~torch.stack(flags)).sum().to(torch.int64) if flags else torch.zeros((), dtype=torch.int64,
                                                                                   device=self._device_obj())
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        return int(bad)

    # -- colocated hand-off: the trainer's state off the GPU while the engine generates --------------
    def offload_state(self, force: bool = False) -> dict[str, float]:
        """Gradients, fp32 master weights and Adam state to pinned CPU buffers (async copies), their GPU
        memory freed; the model's weights stay. A no-op on CPU unless ``force`` (tests). Returns bytes
        moved and seconds. The next :meth:`train` (or :meth:`save`) brings them back first."""
        return self.offload.offload(force=force)

    def reload_state(self) -> dict[str, float]:
        """What :meth:`offload_state` moved, back on the GPU (a no-op when nothing is offloaded)."""
        return self.offload.reload()

    # -- weights & checkpoints -----------------------------------------------------------------
    def hf_weights(self, to_cpu: bool = True) -> dict[str, torch.Tensor]:
        """Full (TP-gathered) weights in Hugging Face names for the rollout engine: on rank 0; the
        other ranks take part in the gather and return {}."""
        return self._from_rank0(self._full_hf_weights(to=0), to_cpu)

    def _from_rank0(self, weights: dict[str, torch.Tensor], to_cpu: bool) -> dict[str, torch.Tensor]:
        """Rank 0's tensors ({} elsewhere), on the host when asked: in-process engines take them where they are,
        Ray's object store needs them on the CPU."""
        if self.rank != 0:
            return {}
        return {k: v.detach().to("cpu") if to_cpu else v.detach() for k, v in weights.items()}

    def _full_hf_weights(self, to: int | None = None) -> dict[str, torch.Tensor]:
        """The whole model in HF names: this rank's copy (every rank takes part in the TP and expert gathers), or with
        ``to`` on that rank only ({} elsewhere: under expert parallelism no other rank holds the others' experts)."""
        out: dict[str, torch.Tensor] = {}
        for unit in self._hf_weight_units(to):
            out.update(unit)
        return out

    def _hf_weight_units(self, to: int | None = None, expert_shards: int = 1) -> Iterator[dict[str, torch.Tensor]]:
        """The whole model in HF names a unit at a time (the embedding, each layer, the head: the adapter's
        ``hf_units``), each gathered whole only while it is used: on every rank, or with ``to`` on that rank only
        (nothing is yielded elsewhere). Every rank runs the whole iteration (each unit's gathers are collective).
        ``expert_shards`` > 1 (``rollout.expert_shards``, not with ``to``): of a mixture's experts only those of the
        engine shard on this rank's GPU (rank r's: shard r mod n; runtime/rollout/expert_shards.py)."""
        from runtime.models import get_adapter
        from runtime.trainer.tp_gather import gathered_units
        if self.adapter is None:
            self.adapter = get_adapter(self.hf_config)
        units = self.adapter.hf_units(self.hf_config, include_tied_lm_head=True)
        shard, experts = None, None
        if expert_shards > 1:
            shard = (self.rank % expert_shards, expert_shards)
            per = int(self.hf_config.num_experts) // expert_shards
            experts = range(shard[0] * per, shard[0] * per + per)
        for name, whole in gathered_units(self.model, units, to=to, expert_shard=shard):
            if whole is None:
                continue
            unit = self.adapter.unit_to_hf(name, whole, self.hf_config, include_tied_lm_head=True, experts=experts)
            whole = None
            yield unit
            unit = None  # dropped before the next unit is gathered

    def next_weight_unit(self, expert_shards: int = 1) -> dict[str, torch.Tensor] | None:
        """The next unit of what the engine takes (the embedding, a layer, the head: the adapter's ``hf_units``; with
        LoRA the adapters, one unit), whole on this rank; None after the last. The first call starts the stream; every
        rank gathers each unit (the TP and expert gathers are collective), so the whole model is never held beside the
        trainer's state (a 30 B mixture of experts is 57 GiB): one unit at a time, alive until
        `release_shared_weights`. ``expert_shards`` (``rollout.expert_shards``): the engine on this GPU holds one shard
        of the experts, and takes only those (`_hf_weight_units`)."""
        self._shared_weights = None
        if self._share_stream is None:
            self._share_stream = self._engine_weight_units_here(expert_shards)
        unit = next(self._share_stream, None)
        if unit is None:
            self._share_stream = None
            return None
        self._shared_weights = {k: v.detach() for k, v in unit.items()}
        return self._shared_weights

    def share_next_weight_unit(self, expert_shards: int = 1):
        """`next_weight_unit` as CUDA IPC handles (runtime/placement/cuda_ipc.py) for the engine on this rank's GPU in
        another process; None after the last."""
        from runtime.placement import cuda_ipc
        unit = self.next_weight_unit(expert_shards)
        return None if unit is None else cuda_ipc.share(unit)

    def release_shared_weights(self, end: bool = False) -> None:
        """Let the shared unit go (the engine has copied it); ``end``: the stream too, where a push stopped part-way."""
        self._shared_weights = None
        if end and self._share_stream is not None:
            self._share_stream.close()
            self._share_stream = None
        if str(self.device).startswith("cuda"):
            # a shared block an engine still counted when it was dropped waits in torch's IPC limbo, where no
            # empty_cache reaches it, until the next shared block's deletion: collected now, the offload before the
            # next generate gives it back
            torch.cuda.ipc_collect()

    # -- weight sync over a group of its own (runtime/placement/weight_sync.py) --------------------------
    def weight_sync_address(self) -> tuple[str, int]:
        """Where rank 0 hosts the weight-sync rendezvous: this node's address (Ray's view of it in a
        Ray actor, loopback otherwise) and a free port on it."""
        from runtime.placement.ports import free_port
        host = "127.0.0.1"
        try:
            import ray
            if ray.is_initialized():
                host = ray.util.get_node_ip_address()
        except ImportError:
            pass
        return host, free_port(host)

    def init_weight_sync(self, host: str, port: int, world_size: int, group_name: str) -> None:
        """Rank 0 joins the weight-sync group as its source (rank 0 of that group); others stay out."""
        from runtime.placement import weight_sync
        if self.rank != 0:
            return
        if getattr(self, "_sync_group", None) is not None:
            weight_sync.destroy_group(self._sync_group)
        self._sync_group = weight_sync.init_group(host, port, 0, world_size, group_name=group_name,
                                                  backend=weight_sync.backend_for(self.device))

    def engine_weights(self, to_cpu: bool = True) -> dict[str, torch.Tensor]:
        """What the rollout engine takes after an update: :meth:`hf_weights`, or with LoRA the adapters only
        (whole, by their megatron names ``...linear_qkv.lora_A``; runtime/rollout/lora_forward.py). On rank 0."""
        return self._from_rank0(self._engine_weights_here(to=0), to_cpu)

    def _engine_weights_here(self, to: int | None = None) -> dict[str, torch.Tensor]:
        """This rank's copy of what the engine takes (every rank joins the TP gather), or with ``to`` on that rank."""
        if self.lora is None:
            return self._full_hf_weights(to=to)
        from runtime.trainer import lora
        return lora.adapter_tensors(self.model)

    def shared_base(self) -> dict[str, torch.Tensor]:
        """The frozen base's own tensors (TP 1, LoRA on), for an engine in this process to decode with
        instead of a copy (runtime/rollout/decode_model.py:FusedModel)."""
        from runtime.trainer import lora
        if self.lora is None or self.tp_size != 1:
            raise RuntimeError("the base is shared only with LoRA on at tensor_parallel 1")
        return lora.base_tensors(self.model)

    def _engine_weight_units(self) -> Iterator[dict[str, torch.Tensor]]:
        """What `broadcast_weights` sends, a unit at a time on rank 0 (every rank takes part in the gathers): the
        whole model is never gathered on one rank (a 30 B mixture of experts is 57 GiB). With LoRA: the adapters."""
        if self.lora is not None:
            adapters = self.engine_weights(to_cpu=False)  # every rank joins the TP gather; {} but on rank 0
            return iter([adapters] if adapters else [])
        return self._hf_weight_units(to=0)

    def _engine_weight_units_here(self, expert_shards: int = 1) -> Iterator[dict[str, torch.Tensor]]:
        """`_engine_weight_units` whole on every rank (each shares them with the engine on its own GPU; of the experts,
        that engine's shard's)."""
        if self.lora is not None:
            return iter([self._engine_weights_here()])
        return self._hf_weight_units(expert_shards=expert_shards)

    def weights_metadata(self) -> list:
        """(name, dtype, shape) of the tensors `broadcast_weights` sends, in order (rank 0; [] elsewhere)."""
        from runtime.placement import weight_sync
        return [m for unit in self._engine_weight_units() for m in weight_sync.metadata_of(unit)]

    def broadcast_weights(self) -> dict[str, float]:
        """Rank 0 broadcasts :meth:`engine_weights` to the engines a unit at a time, each gathered (TP shards, experts)
        just before it goes. Returns the bytes sent, the largest unit's and the seconds (rank 0; {} elsewhere)."""
        from runtime.placement import weight_sync
        t0 = time.time()
        sent = largest = 0
        for unit in self._engine_weight_units():
            n = weight_sync.send(self._sync_group, unit, self._device_obj())
            sent, largest = sent + n, max(largest, n)
            del unit
        if self.rank != 0:
            return {}
        if str(self.device).startswith("cuda"):
            torch.cuda.synchronize()
        return {"bytes": float(sent), "largest_unit_bytes": float(largest), "seconds": time.time() - t0}

    def _device_obj(self) -> torch.device:
        if str(self.device).startswith("cuda"):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def grads(self) -> dict[str, torch.Tensor]:
        """Gradients of the last optimizer step, whole and on CPU (for parallel-equivalence checks). With
        ``train.distributed_optimizer`` only this DP rank's shard of the buffer is reduced over DP (reduce-scatter)."""
        from runtime.trainer.tp_gather import full_grads
        return {k: v.to("cpu") for k, v in full_grads(self.model).items()}

    def save(self, path: str) -> None:
        """The model, optimizer and LR schedule as a torch_dist checkpoint, written before returning (every rank
        takes part). The optimizer's format does not depend on DP size or ``train.distributed_optimizer``: a
        checkpoint loads into any data-parallel layout (runtime/trainer/optimizer_checkpoint.py)."""
        self.save_begin(path, background=False)
        self.save_finish()

    def save_begin(self, path: str, background: bool = True) -> dict[str, float]:
        """Start :meth:`save`: the plan and a host copy of the state now (collective), the files written by a
        thread while training goes on (``background``; runtime/trainer/checkpoint_writer.py). Every rank then
        calls :meth:`save_finish` before the next save or load. Returns the seconds this took (``stall_s``)."""
        from runtime.mcore import env as menv
        from runtime.trainer import master_weights, optimizer_checkpoint
        os.makedirs(path, exist_ok=True)
        reload_s = self.offload.reload()["seconds"]
        menv.save_results_in_this_process()
        with menv.cuda_to_cpu():
            msd = self._model_sharded_state_dict()
            # the weights the fp32 masters determine are left out (runtime/trainer/master_weights.py)
            kept, left = master_weights.split(msd, master_weights.master_backed(self.optimizer, self.model))
            # one optimizer format for every layout (runtime/trainer/optimizer_checkpoint.py)
            state = {"model": kept, "optimizer": optimizer_checkpoint.sharded_state_dict(self.optimizer, self.model, msd),
                     "scheduler": self.scheduler.state_dict(), "steps_done": self.steps_done,
                     "expert_parallel": self.train_cfg.expert_parallel}
            began = self.writer.begin(state, path, background=background)
        if self.rank == 0:
            if left:
                master_weights.write_marker(path, left)
            if self.lora is not None:  # adapters only: the base is the run's converted model
                from runtime.trainer import lora
                lora.write_description(path, self.lora)
        return {**began, "reload_s": reload_s}

    def save_done(self) -> bool:
        """Whether this rank's files of the save under way are written (True when none is)."""
        return self.writer.done()

    def save_finish(self) -> dict[str, Any]:
        """Wait for this rank's files, then finalize the save with every rank (collective). Returns the files
        this rank wrote with their size and sha256 (relative to the checkpoint dir above ``path``), and the
        write's and the hash's seconds; raises what the write met."""
        from runtime.mcore import env as menv
        with menv.cuda_to_cpu():
            return self.writer.finish()

    def load(self, path: str) -> None:
        """The state :meth:`save` wrote at ``path`` (every rank takes part). Weights the checkpoint leaves to their
        fp32 masters are rebuilt from the loaded masters as a step does; a checkpoint holding them (written before)
        loads them."""
        from megatron.core import dist_checkpointing

        from runtime.mcore import env as menv
        from runtime.mcore.convert import _quiet_checkpoint_warnings
        from runtime.trainer import master_weights, optimizer_checkpoint
        self.offload.reload()
        with menv.cuda_to_cpu(), _quiet_checkpoint_warnings():
            expert_parallel.check_resume(path, self.train_cfg.expert_parallel)
            msd = self._model_sharded_state_dict()
            marked = master_weights.marked_dtype(path)
            from_masters = marked is not None
            kept, left = master_weights.split(msd, master_weights.master_backed(self.optimizer, self.model)) \
                if from_masters else (msd, {})
            if from_masters and not left:
                raise ValueError(f"checkpoint {path} holds {marked} weights as their fp32 masters; this trainer's "
                                 f"{self.params_dtype} weights have none: resume with the model.dtype it was written in")
            state = {"model": kept, "optimizer": optimizer_checkpoint.sharded_state_dict(
                self.optimizer, self.model, msd, is_loading=True), "scheduler": None, "steps_done": None}
            loaded = dist_checkpointing.load(state, path)
            if self.lora is None:  # from the masters: all but the weights rebuilt below
                missing = set(menv.unwrap_model(self.model).load_state_dict(loaded["model"],
                                                                           strict=not from_masters).missing_keys)
                if missing != set(left):
                    raise ValueError(f"checkpoint {path} lacks model entries: {sorted(missing - set(left))[:3]}")
            elif not from_masters:
                from runtime.trainer import lora
                lora.load_adapters(self.model, loaded["model"])
            optimizer_checkpoint.load_state_dict(self.optimizer, self.model, self._model_sharded_state_dict(),
                                                 loaded["optimizer"])
            if from_masters:
                master_weights.rebuild(self.optimizer)
        self.scheduler.load_state_dict(loaded["scheduler"])
        self.steps_done = int(loaded["steps_done"])

    def _model_sharded_state_dict(self) -> dict:
        """The model's sharded state dict a checkpoint is made from: every weight, or with LoRA the adapters only
        (the weights their fp32 masters determine are then left out, runtime/trainer/master_weights.py)."""
        if self.lora is None:
            return self.model.sharded_state_dict()
        from runtime.trainer import lora
        return lora.sharded_state_dict(self.model)


def _all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
    return reduce_from_tensor_model_parallel_region(t)


def _accumulate(sums: dict[str, torch.Tensor], key: str, value) -> None:
    """``sums[key] += value`` in float64 where the value lives (the device, for tensors): no host sync."""
    v = value.detach().to(torch.float64) if torch.is_tensor(value) else torch.tensor(float(value), dtype=torch.float64)
    sums[key] = sums[key] + v if key in sums else v
