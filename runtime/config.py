"""The one typed config of a grpoflow run: sections loaded from YAML, overridable with --set.

Everything is validated here, before any heavy import or download, and every error is one line
naming the field and the fix.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from runtime.errors import ConfigError


class Section(BaseModel):
    # allow_inf_nan=False: no float setting has a meaning at inf or nan (`train.lr: .inf` trained a NaN model)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def _check_scheme(uri: str, allowed: tuple[str, ...], forms: str) -> str:
    """Refuse a URI whose scheme we cannot read (gs://, ftp://, a typo) before anything tries to open it."""
    m = _SCHEME.match(uri)
    if m and m.group(1).lower() not in allowed:
        raise ValueError(f"unsupported scheme '{m.group(1)}://' in {uri!r}; use {forms}")
    return uri


_SOURCE_SCHEMES = ("hf", "s3", "builtin", "file")


def _no_credentials(uri: str) -> str:
    """Refuse a password in a source URI: it would be printed in the plan and stored with the run, and no reader
    takes it from there (botocore reads `user:pw@bucket` as a bucket name)."""
    from urllib.parse import urlsplit

    from runtime.secrets import redact_uri
    try:
        parts = urlsplit(uri)
        userinfo = parts.password or (parts.scheme.lower() == "s3" and "@" in parts.netloc)
    except ValueError:
        return uri
    if userinfo:
        raise ValueError(f"{redact_uri(uri)}: credentials do not belong in the URI (it is printed and stored with the run); "
                         f"remove them and set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for s3://, "
                         f"HF_TOKEN for hf://")
    return uri


class ModelSection(Section):
    source: str = Field("builtin://tiny-qwen3", description="hf://org/name[@rev], a local dir, s3://..., or builtin://tiny-qwen3 (-moe)")
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    parity_tolerance: float = Field(1e-4, gt=0)
    builtin_seed: int = 0

    @field_validator("source")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        return _no_credentials(_check_scheme(v, _SOURCE_SCHEMES, "hf://org/name[@revision], s3://bucket/prefix, "
                                                                 "builtin://tiny-qwen3 or a local directory"))


class DatasetSection(Section):
    source: str
    format: Literal["auto", "slime", "dapo", "aime"] = "auto"
    input_key: str | None = None  # None: the format's default (prompt / problem)
    label_key: str | None = None  # None: label / reward_model.ground_truth / answer
    metadata_key: str | None = "metadata"
    split: str = "train"

    @field_validator("source")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        return _no_credentials(_check_scheme(v, _SOURCE_SCHEMES, "hf://org/name[@revision], s3://bucket/key, "
                                                                 "builtin://arith/<split> or a local file"))


class DataSection(Section):
    train: DatasetSection = DatasetSection(source="builtin://arith/train")
    eval: dict[str, DatasetSection] = Field(default_factory=lambda: {"arith": DatasetSection(source="builtin://arith/eval")})
    apply_chat_template: bool = True
    system_prompt: str | None = None
    max_prompt_len: int = Field(1024, gt=0, description="prompts longer than this many tokens are left out at prepare")
    shuffle: bool = True


# The `sglang.launch_server` flags the SGLang backend sets from rollout.sglang itself; `launch` may not repeat them.
SGLANG_MANAGED_FLAGS = ("--model-path", "--model", "--tp-size", "--tensor-parallel-size", "--mem-fraction-static",
                        "--host", "--port", "--random-seed", "--weight-version", "--base-gpu-id",
                        "--enable-memory-saver", "--enable-deterministic-inference", "--enable-return-routed-experts")
SGLANG_PORT_STRIDE = 10  # with a fixed base port, engine i listens on port + 10 * i


class SGLangSection(Section):
    """`rollout.engine: sglang`: the SGLang servers grpoflow launches and feeds (docs/sglang.md)."""

    # The server command prefix; None runs `python -m sglang.launch_server`. Extra server flags go at
    # its end ("{python}" = the running Python).
    launch: list[str] | None = None
    mem_fraction: float = Field(0.7, gt=0, lt=1, description="--mem-fraction-static")
    concurrency: int = Field(64, gt=0, description="requests in flight per SGLang engine")
    num_engines: int = Field(1, gt=0)
    tp_size: int = Field(1, gt=0)
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, lt=65536, description="0: free ports; else engine i uses port + 10*i")
    startup_timeout_s: float = Field(900.0, gt=0)
    request_timeout_s: float = Field(1800.0, gt=0, description="one /generate; long reasoning rollouts take minutes")
    max_restarts: int = Field(3, ge=0, description="per engine, over its life")
    weight_sync: Literal["disk", "tensor"] = "disk"
    scratch_dir: str | None = None  # weights pushed to the engines + their logs; None: a temp dir
    deterministic: bool = True  # --enable-deterministic-inference: sampling_seed honoured

    @model_validator(mode="after")
    def _launch_and_ports(self) -> "SGLangSection":
        for flag in self.launch or []:
            name = flag.split("=", 1)[0]
            if name in SGLANG_MANAGED_FLAGS:
                raise ValueError(f"launch sets {name}, which grpoflow sets itself; remove it (rollout.sglang has "
                                 f"keys for it: tp_size, mem_fraction, host, port, deterministic)")
        last = self.port + SGLANG_PORT_STRIDE * (self.num_engines - 1)
        if self.port and last >= 65536:
            raise ValueError(f"port={self.port}: engine i listens on port + {SGLANG_PORT_STRIDE}*i, and engine "
                             f"{self.num_engines - 1}'s port {last} is past 65535; lower port or num_engines")
        return self


class RolloutSection(Section):
    engine: Literal["builtin", "sglang"] = "builtin"
    rollout_batch_size: int = Field(8, gt=0, description="prompts per rollout")
    n_samples_per_prompt: int = Field(8, ge=2, description="group advantages need at least 2 samples per prompt")
    max_new_tokens: int = Field(16, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="-1: off")
    reward: str = "math"  # math | dapo | deepscaler | module:function: fn(response, label, metadata=None[, *, finish_reason])
    reward_timeout_s: float = Field(5.0, gt=0)
    custom_rollout: str | None = None  # module:function replacing generate+reward
    dynamic_sampling: bool = False
    # groups in flight per rollout: rollout_batch_size x this (dynamic sampling draws them at once; partial
    # rollout keeps that many generating and stops once rollout_batch_size of them are complete)
    over_sampling_factor: float = Field(1.0, ge=1.0)
    # prompt draws per rollout while filtering leaves too few groups; then uninformative ones fill the batch
    max_draws: int = Field(4, gt=0)
    # partial rollout: a rollout stops once rollout_batch_size groups are complete (and kept); the extra
    # complete groups and the unfinished samples (tokens, log-probs, the weight version of each token) are
    # run state, saved with each checkpoint, and go first in the next rollout, continued under the new weights
    # (built-in engine and SGLang; on SGLang where a rollout stops depends on timing: no bitwise resume)
    partial: bool = False
    # a buffered sample with tokens older than this many weight versions is dropped (and counted)
    max_staleness: int = Field(2, ge=0)
    # The built-in engine's KV cache: its size in GiB (None: what the memory plan leaves free on a GPU,
    # a bounded default on CPU). Part of the plan that `grpoflow validate` checks.
    kv_cache_gb: float | None = Field(None, gt=0)
    # The built-in engine's decoder: paged = our paged KV cache with continuous batching and preemption
    # (CUDA graphs and the Triton kernel on CUDA); hf = HF's forward with a dynamic cache (the reference);
    # auto = paged where the model family has it (runtime/rollout/decode_model.py), else hf.
    decode_path: Literal["auto", "paged", "hf"] = "auto"
    # The paged decoder's decode steps between host syncs: queued requests are admitted into freed rows, and a
    # partial rollout's stop is checked, only at these points, so it decides which samples a partial rollout
    # carries over. Fewer syncs run faster on a GPU; a short max_new_tokens needs fewer steps to cut samples mid-way.
    sync_every: int = Field(16, gt=0)
    # The built-in engine's compiled kernels (norms, log-softmax, sampling) with one configuration each, chosen
    # without timing: inductor otherwise times several configurations of a reduction at its first call and keeps
    # the fastest, which a fresh process may pick differently, summing in another order, so two runs' rollout
    # log-probs (TIS weights, hence every gradient) differ in the last bits, and at a near-tie a token changes.
    # Measured on an H100 (64 samples of <= 2048 tokens; the recipe's 8192 not yet): no cost beyond decode's own
    # run-to-run spread (+-3 %), a shorter first compile (bench/results/engine_repeat_*). SGLang's own is rollout.sglang.deterministic.
    deterministic: bool = True
    # The built-in engine's linear layers (q/k/v, o, gate/up, down): bf16 (the model's dtype), or fp8 = rowwise
    # e4m3 with a scale per output row and per token (runtime/rollout/fp8_weights.py), quantised from the
    # trainer's weights at each weight sync; embeddings and the head stay bf16. Halves the engine's weights and
    # the bytes a decode step reads; its log-probs then differ from the trainer's more than bf16's, so fp8 turns
    # algorithm.use_tis on unless the config sets it.
    weights_dtype: Literal["bf16", "fp8"] = "bf16"
    # Rollout routing replay (R3), for a mixture of experts: the engine records each token's top-k experts per MoE
    # layer (prompt and response; SGLang's servers return them: runtime/rollout/sglang/routes.py), the samples carry
    # them (partial rollout's buffer and checkpoints too), and the trainer's forwards (log-probs, the update, its
    # recompute) route every token to those experts instead of its own top-k (the weights from its own router at
    # those experts, so the router still trains: megatron's router replay). Off until measured on the GPU. A dense
    # model has nothing to route: a no-op there.
    routing_replay: bool = False
    # Cascade attention in the built-in engine's paged decoder: each decode step reads a group's shared prompt pages
    # once for all its live samples (8 samples x the query heads of a KV head: one tensor-core tile), merged with
    # each sample's own pages by log-sum-exp (docs/cascade-attention.md). Same attention, summed in another order:
    # log-probs within float noise of off. Off until measured on the GPU (bench/rollout_bench.py --cascade-ab).
    cascade_attention: bool = False
    # True on-policy (issue 61, docs/true-on-policy.md): the built-in engine and the trainer compute the forward, the
    # attention and the sampled token's log-prob with one batch-invariant set of kernels (runtime/kernels/
    # batch_invariant.py), so every token sampled under the current weights has an engine log-prob bitwise equal to
    # the trainer's in its training forward (train_rollout_logp_absdiff is 0), preempted samples included. Dense
    # models, TP 1, LoRA without dropout, bf16 engine weights, no partial rollout; slower (GEMMs in fixed row blocks,
    # an attention that never splits a row), off by default.
    true_on_policy: bool = False
    # A built-in engine replica split by its experts, for a mixture too large for one GPU beside the trainer: this
    # many consecutive engines (cluster.rollout_gpus of them in all) make one replica, each holding 1/n of every MoE
    # layer's experts and all the rest; they run the same requests in step and sum their experts' outputs (one
    # all-reduce per MoE layer; runtime/rollout/expert_shards.py). Another order of sums than one engine's: the
    # samples differ in the last bits from expert_shards 1 (deterministic at any fixed value). 1: each engine whole.
    expert_shards: int = Field(1, ge=1)
    sglang: SGLangSection = SGLangSection()

    @model_validator(mode="before")
    @classmethod
    def _moved_sglang_keys(cls, data: Any) -> Any:
        # the flat rollout.sglang_* keys of older configs are read into the section, so the frozen config of
        # a run made before it resumes as it was
        old = sorted(k for k in data if isinstance(k, str) and k.startswith("sglang_")) if isinstance(data, dict) else []
        if not old:
            return data
        data = dict(data)
        section = dict(data.get("sglang") or {})
        for key in old:
            name = key.removeprefix("sglang_")
            if name in section:
                raise ValueError(f"{key} and sglang.{name} are both set: keep sglang.{name} only")
            section[name] = data.pop(key)
        data["sglang"] = section
        return data


class AlgorithmSection(Section):
    normalize_adv_std: bool = True  # False = Dr.GRPO
    eps_clip: float = Field(0.2, ge=0, lt=1, description="the ratio is clipped below at 1 - eps_clip")
    eps_clip_high: float | None = Field(None, ge=0, description="None: = eps_clip; DAPO's clip-higher uses 0.28")
    # runtime/algo/losses.py:aggregate; seq_mean_token_sum_norm is Dr.GRPO's (divides by loss_norm_tokens)
    loss_agg: Literal["token_mean", "seq_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = "token_mean"
    loss_norm_tokens: int | None = Field(None, gt=0, description="seq_mean_token_sum_norm's constant; None: rollout.max_new_tokens")
    kl_coef: float = Field(0.0, ge=0)
    kl_type: Literal["k1", "k2", "k3"] = "k3"
    kl_clamp: float | None = Field(None, gt=0, description="cap on k3's value (verl: 10); None: off")
    entropy_coef: float = Field(0.0, ge=0)
    use_tis: bool = False
    tis_cap: float = Field(2.0, gt=0)
    # truncate: weight min(ratio, tis_cap) (TIS); mask: weight ratio where ratio <= tis_cap, else 0 (MIS)
    tis_mode: Literal["truncate", "mask"] = "truncate"
    logratio_clamp: float = Field(20.0, gt=0, description="|log-ratio| bound before exp (policy, TIS, KL)")
    dual_clip_c: float | None = Field(None, description="verl's dual clip for A < 0 (verl: 3); None: off")

    @field_validator("dual_clip_c")
    @classmethod
    def _dual_clip_above_one(cls, c: float | None) -> float | None:
        if c is not None and not c > 1:
            raise ValueError(f"must be > 1 (verl uses 3), or null for off; got {c}")
        return c

    @model_validator(mode="after")
    def _kl_clamp_is_for_k3(self) -> "AlgorithmSection":
        if self.kl_clamp is not None and self.kl_type != "k3":
            raise ValueError(f"kl_clamp caps the k3 estimator only; unset it or use kl_type k3 (not {self.kl_type})")
        return self


FLOAT32_MAX = 3.4028234663852886e38  # the optimizer's dtype

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# train.lr when LoRA is on and the config sets none: about 10x the full-parameter rate of the recipes
# (1e-6), where LoRA's best rate sits (docs/lora.md)
LORA_DEFAULT_LR = 1e-5


class LoraSection(Section):
    """`train.lora`: low-rank adapters on the megatron model's linears; the base stays frozen (docs/lora.md)."""

    enabled: bool = False
    rank: int = Field(32, gt=0, description="r of each adapter pair (A: r x in, B: out x r)")
    alpha: float = Field(32.0, gt=0, description="the adapter's output is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="on the adapter's input, in the training forward only")
    # megatron's names: attention qkv (fused q/k/v), attention output, MLP in (fused gate/up), MLP out
    target_modules: list[Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]] = Field(
        default_factory=lambda: list(LORA_TARGETS), min_length=1)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class TrainSection(Section):
    num_rollout: int = Field(6, gt=0)
    global_batch_size: int = Field(64, gt=0, description="samples per optimizer step")
    num_steps_per_rollout: int = Field(1, gt=0)
    micro_batch_size: int = Field(16, gt=0)
    # 0 trains nothing (a control run); above float32's largest the optimizer's step cannot be taken at all
    lr: float = Field(1e-3, ge=0)
    min_lr: float = Field(0.0, ge=0, description="the decay's floor; at most lr")
    lr_warmup_steps: int = Field(0, ge=0)
    lr_decay_style: Literal["constant", "cosine", "linear"] = "constant"
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.98, ge=0, lt=1)
    clip_grad: float = Field(1.0, ge=0, description="max grad norm; 0: off")
    tensor_parallel: int = Field(1, gt=0)
    data_parallel: int = Field(1, gt=0, description="unset: cluster.trainer_gpus / tensor_parallel (1 without GPUs)")
    # a mixture of experts: the experts split over this many ranks (megatron's expert_model_parallel_size), each
    # holding num_experts / expert_parallel of them and the tokens routed to them gathered from its group (the
    # allgather dispatcher). The expert group is cut from the data-parallel ranks, so it divides data_parallel
    # (and the model's num_experts). 1: every rank holds every expert.
    expert_parallel: int = Field(1, gt=0)
    seed: int = 1234
    # a mixture of experts (Qwen3-MoE): the router z-loss's coefficient (megatron's moe_z_loss_coeff, the squared
    # log-partition of the router logits), added to the loss and reported as router_z_loss; 0: off. The
    # load-balancing loss's coefficient is the model's own (config.json router_aux_loss_coef).
    router_z_loss_coef: float = Field(0.0, ge=0)
    # a mixture of experts: the trainer's experts as two grouped GEMMs (torch's grouped_mm) instead of megatron's
    # SequentialMLP loop over them (runtime/mcore/grouped_experts.py; the same parameters and checkpoints, results
    # equal within float rounding). auto: on CUDA (bf16 grouped GEMMs on sm90+), off on the CPU, whose results stay
    # as they were; on / off force it.
    moe_grouped_gemm: Literal["auto", "on", "off"] = "auto"
    # -- memory (runtime/plan/memory.py models each of these; `grpoflow validate` names the ones that fit) --
    # megatron activation recomputation: none; selective (the named submodules of every layer are run again
    # in the backward instead of keeping their outputs; "core_attn" saves nothing beside flash attention);
    # full (whole layers keep only their input: the first recompute_num_layers of them, None = all).
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_modules: list[Literal["layernorm", "mlp", "core_attn"]] = Field(
        default_factory=lambda: ["layernorm", "mlp"])
    recompute_num_layers: int | None = Field(None, gt=0)
    # Micro-batches by a token budget: samples packed back to back without padding (per-sample positions,
    # attention within each sample), as many as fit this many tokens. None: micro_batch_size samples, padded.
    max_tokens_per_micro_batch: int | None = Field(None, gt=0)
    # megatron's distributed optimizer: the fp32 master weights and Adam's moments are sharded over the
    # data-parallel ranks (each holds 1/DP of them) and gradients are reduce-scattered instead of all-reduced;
    # the trainer state per GPU then shrinks with DP, which is what lets a 9B model train on 80 GiB GPUs.
    # Updates equal the replicated optimizer's within float rounding (the grad norm is summed in another
    # order); checkpoints have one layout-free format, so a run may resume with it on or off, at any DP.
    distributed_optimizer: bool = False
    # dtype of the gradient buffer and its data-parallel reduction: float32 (megatron's grad_reduce_in_fp32;
    # exact accumulation over micro-batches) or bfloat16 (the bf16 weights' own dtype: half the gradient
    # memory, accumulated and reduced in bf16). With fp32 weights (the CPU default) gradients are fp32 either way.
    grad_dtype: Literal["float32", "bfloat16"] = "float32"
    # The fp32 master weights, Adam's moments and the update itself on the host (ZeRO-Offload's split,
    # runtime/trainer/host_optimizer.py): the GPU keeps the bf16 weights and gradients only (16 of 18 B/param
    # off it with bf16 gradients). Each step the gradients stream to the host in chunks, AdamW runs there, and
    # the new bf16 weights stream back, overlapped. Needs bf16 weights (model.dtype). Updates equal the GPU
    # optimizer's within float rounding; a run may resume with it on or off (one checkpoint format).
    optimizer_on_host: bool = False
    # -- numerics of the trainer's forward (change results within float noise; the defaults are the fast ones) --
    # chunked output layer for the log-probs (no [tokens x vocab] fp32 logits): auto = at TP 1 on CUDA
    chunked_logprobs: Literal["auto", "on", "off"] = "auto"
    # pure-PyTorch fusions on CUDA (runtime/mcore/fusions.py): auto = all of them; none; or a list. CPU: none.
    fusions: Literal["auto", "none"] | list[Literal["rope", "swiglu", "bda", "gqa", "norm"]] = "auto"
    # core attention: auto = torch SDPA (flash) on CUDA, megatron's unfused one on CPU (SDPA there too when
    # packing); sdpa; megatron (refuses packed micro-batches)
    core_attention: Literal["auto", "sdpa", "megatron"] = "auto"
    # the kernel of packed micro-batches on CUDA: flash2 = FlashAttention-2 as torch ships it; fa4 = the
    # flash-attn-4 package's CuTe kernels (pip install 'grpoflow[fa4]'; about 2x FA2's forward + backward on the
    # H100, so the trainer's packed step is faster). CPU: block-causal SDPA either way.
    packed_attention: Literal["flash2", "fa4"] = "flash2"
    # torch's deterministic kernels while the trainer computes (runtime/mcore/determinism.py; the backward in strict
    # mode: an op there without a deterministic kernel stops the step, named), and its compiled norm in pieces whose
    # kernels do not depend on which token count, in which process, compiled them (fusions.deterministic_norm; torch
    # sums the weight's gradient over the tokens, no configuration is timed): on CUDA two updates from one state are
    # bitwise equal, so a run resumed after a failure ends as the unbroken one does on GPUs too (2 x H100,
    # bench/results: +1.6 % of a step with deterministic_norm, 2026-11-27). Off: atomically accumulated backward
    # kernels move the weights by float noise from run to run. With packed micro-batches it needs packed_attention
    # flash2 (torch's FlashAttention, whose deterministic backward it selects). CPU kernels are deterministic either way.
    deterministic: bool = True
    lora: LoraSection = LoraSection()

    @field_validator("lr")
    @classmethod
    def _lr_in_float32(cls, v: float) -> float:
        if v > FLOAT32_MAX:
            raise ValueError(f"{v:g} is past float32's largest value (3.4e38), the optimizer's dtype; learning "
                             f"rates are about 1e-6 to 1e-3")
        return v

    @model_validator(mode="after")
    def _deterministic_attention(self) -> "TrainSection":
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr={self.min_lr:g} is above train.lr={self.lr:g}; the decay's floor must be "
                             f"at most lr: lower min_lr")
        if self.deterministic and self.packed_attention == "fa4":
            raise ValueError("train.packed_attention=fa4 has no deterministic backward and train.deterministic (on by "
                             "default) needs one: set train.deterministic=false to train with fa4, or "
                             "train.packed_attention=flash2")
        return self


class EvalSection(Section):
    interval: int | None = Field(None, gt=0, description="rollouts between evals; a multiple of checkpoint.interval")
    before_train: bool = False
    n_samples_per_prompt: int = Field(4, gt=0)
    pass_k: list[int] = Field(default_factory=lambda: [1])
    max_new_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    max_prompts: int | None = Field(None, gt=0)


class CheckpointSection(Section):
    interval: int = Field(2, gt=0, description="rollouts per chunk and checkpoint")
    keep_last: int = Field(3, gt=0)
    # The checkpoint is written by a background writer beside the next chunk's rollouts (the loop stalls only
    # for a host copy of the state); it is durable (manifest last, `latest` moved) before the next checkpoint
    # starts and before the run finishes. false: written inside the step, as before.
    background: bool = True


class TrackingSection(Section):
    enabled: bool = True
    uri: str | None = None  # None: sqlite under storage.root (or storage.state_dir when root is remote)
    experiment: str = "grpoflow"
    registered_model: str | None = None  # None: <config name>
    # HF exports kept on disk besides the `best` and `latest` versions': those of the run's last N registered
    # versions. Older versions of the run stay in the registry with their metrics and lineage, their artifacts
    # removed (runtime/tracking/export_retention.py). None: every export is kept.
    keep_exports: int | None = Field(2, ge=0, description=(
        "HF exports kept besides best's and latest's: the run's last N versions' (None: all). The seed config "
        "(GLM-Z1-9B, 3000 rollouts, an eval point every 20) registers 150 versions of 18.8 GB (2 bytes a "
        "parameter): 2.8 TB if all are kept; with 2, at most 3 exports (best, the newest, the one before) plus the "
        "one being written: <= 4 x 18.8 = 75 GB"))


class ClusterSection(Section):
    backend: Literal["ray", "local"] = "local"
    address: str | None = None  # join an existing Ray cluster; None starts a local one
    colocate: bool = True  # the engine shares the trainer's GPUs; false: rollout_gpus of its own
    trainer_gpus: int = Field(0, ge=0, description="= data_parallel × tensor_parallel; 0: one device, no GPU accounting")
    rollout_gpus: int = Field(0, ge=0)
    weight_sync: Literal["auto", "direct", "broadcast"] = "auto"  # see runtime/placement/layout.py:weight_sync_mode
    num_cpus: int | None = Field(None, gt=0)
    placement_timeout_s: float = Field(60.0, gt=0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Memory of one GPU of the target machine, in GiB (24 for an RTX 4090): the plan `grpoflow validate`
    # checks and the run re-checks before it takes a GPU. None: the GPU found at run time (80 for validate).
    gpu_memory_gb: float | None = Field(None, gt=0)
    # The trainer's gradients, fp32 master weights and Adam state go to pinned CPU memory while the engine
    # generates (colocated), and come back for the update. auto: on when colocated on a GPU.
    offload_trainer_state: Literal["auto", "on", "off"] = "auto"
    # Memory of one node's host (CPU) in GiB, for the plan's host side (train.optimizer_on_host, the pinned
    # buffers of the state offload, the processes). None: 1.6 GiB per GiB of GPU memory of the node's GPUs
    # (the H100 machines here: 128 GiB per 80 GiB card).
    host_memory_gb: float | None = Field(None, gt=0)

    @field_validator("offload_trainer_state", mode="before")
    @classmethod
    def _yaml_on_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare on / off as a boolean: `offload_trainer_state: on` means "on"
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


DEFAULT_ROOT = "./grpoflow-data"  # storage.root when a config or a command names none


class StorageSection(Section):
    root: str = DEFAULT_ROOT
    state_dir: str | None = None  # local dir for MLflow/Prefect state when root is remote
    # Disk space in GiB the run may take where it writes (storage.root; under an s3:// root, storage.state_dir,
    # which keeps the local mirrors): the plan's disk row is checked against it by `grpoflow validate`, and by the
    # run before it takes a GPU against the lesser of it and the free space there. None: the free space measured
    # there (validate prints this machine's and leaves the refusal to the run).
    disk_gb: float | None = Field(None, gt=0)

    @field_validator("root")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        return _no_credentials(_check_scheme(v, ("s3", "file"), "a local directory or s3://bucket/prefix"))

    @field_validator("state_dir")
    @classmethod
    def _local(cls, v: str | None) -> str | None:
        return v if v is None else _check_scheme(v, ("file",), "a local directory")


class GrpoConfig(Section):
    name: str = "grpo"
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    rollout: RolloutSection = RolloutSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    tracking: TrackingSection = TrackingSection()
    cluster: ClusterSection = ClusterSection()
    storage: StorageSection = StorageSection()

    @model_validator(mode="before")
    @classmethod
    def _derive_data_parallel(cls, data: Any) -> Any:
        train, cluster = (data.get("train"), data.get("cluster")) if isinstance(data, dict) else (None, None)
        if isinstance(train, dict) and isinstance(cluster, dict) and train.get("data_parallel") is None:
            gpus, tp = cluster.get("trainer_gpus"), train.get("tensor_parallel", 1)
            if isinstance(gpus, int) and isinstance(tp, int) and gpus > 0 and tp > 0 and gpus % tp == 0:
                data = {**data, "train": {**train, "data_parallel": gpus // tp}}
        return data

    @model_validator(mode="after")
    def _remember_secrets(self) -> "GrpoConfig":
        from runtime.secrets import remember
        remember(self.model_dump(mode="json"))  # masked wherever they would be printed or stored
        return self

    @model_validator(mode="after")
    def _derive_loss_norm_tokens(self) -> "GrpoConfig":
        a = self.algorithm
        if a.loss_agg == "seq_mean_token_sum_norm" and a.loss_norm_tokens is None:
            a.loss_norm_tokens = self.rollout.max_new_tokens  # Dr.GRPO's constant: the longest a response can be
        return self

    @model_validator(mode="after")
    def _lora_checks(self) -> "GrpoConfig":
        lora, t = self.train.lora, self.train
        if not lora.enabled:
            return self
        if self.rollout.engine == "sglang":
            raise ValueError("train.lora is not wired to SGLang's adapters yet; use rollout.engine: builtin "
                             "(or set train.lora.enabled: false)")
        if self.rollout.decode_path == "hf":
            raise ValueError("train.lora applies the adapters in the built-in engine's paged decoder; set "
                             "rollout.decode_path: auto (or paged)")
        if t.optimizer_on_host:  # the host step is built and tested for a whole model's state, not adapters'
            raise ValueError("train.lora trains megabytes of adapters, whose optimizer state stays on the GPU; set "
                             "train.optimizer_on_host: false")
        if "lr" not in t.model_fields_set:
            t.lr = LORA_DEFAULT_LR
        return self

    @model_validator(mode="after")
    def _routing_replay(self) -> "GrpoConfig":
        r = self.rollout
        if not r.routing_replay:
            return self
        if r.engine != "sglang" and r.decode_path == "hf":  # SGLang records them itself (return_routed_experts)
            raise ValueError("rollout.routing_replay: the routes are recorded by the built-in engine's paged decoder; "
                             "set rollout.decode_path: auto (or paged), or rollout.routing_replay: false")
        if r.custom_rollout:
            raise ValueError("rollout.routing_replay: a custom rollout's samples carry no routes; unset "
                             "rollout.custom_rollout, or set rollout.routing_replay: false")
        return self

    @model_validator(mode="after")
    def _expert_shards(self) -> "GrpoConfig":
        r, n = self.rollout, self.rollout.expert_shards
        if n == 1:
            return self
        engines = max(self.cluster.rollout_gpus, 1)
        if r.engine != "builtin":
            raise ValueError(f"rollout.expert_shards={n} splits the built-in engine; SGLang splits its servers by "
                             f"rollout.sglang.tp_size: set rollout.expert_shards: 1")
        if engines % n:
            raise ValueError(f"rollout.expert_shards={n} must divide the engines, one per rollout GPU "
                             f"(cluster.rollout_gpus={self.cluster.rollout_gpus}); set rollout_gpus to a multiple of {n}")
        if r.decode_path == "hf" or self.train.lora.enabled or r.true_on_policy:
            what = ("rollout.decode_path: hf" if r.decode_path == "hf" else "train.lora" if self.train.lora.enabled
                    else "rollout.true_on_policy")
            raise ValueError(f"rollout.expert_shards={n} runs in the paged decoder of a whole-weight mixture, not with "
                             f"{what}: set rollout.expert_shards: 1")
        return self

    @model_validator(mode="after")
    def _cascade_attention(self) -> "GrpoConfig":
        r = self.rollout
        if r.cascade_attention and r.engine == "sglang":
            raise ValueError("rollout.cascade_attention is the built-in engine's (SGLang has its own radix attention): "
                             "use rollout.engine: builtin, or rollout.cascade_attention: false")
        if r.cascade_attention and r.decode_path == "hf":
            raise ValueError("rollout.cascade_attention runs in the built-in engine's paged decoder; set "
                             "rollout.decode_path: auto (or paged), or rollout.cascade_attention: false")
        return self

    @model_validator(mode="after")
    def _fp8_rollout(self) -> "GrpoConfig":
        r = self.rollout
        if r.weights_dtype == "bf16":
            return self
        if r.engine == "sglang":
            raise ValueError("rollout.weights_dtype: fp8 is the built-in engine's; SGLang quantises with its own "
                             "server arguments: use rollout.engine: builtin, or rollout.weights_dtype: bf16")
        if r.decode_path == "hf":
            raise ValueError("rollout.weights_dtype: fp8 runs in the built-in engine's paged decoder; set "
                             "rollout.decode_path: auto (or paged), or rollout.weights_dtype: bf16")
        if "use_tis" not in self.algorithm.model_fields_set:
            self.algorithm.use_tis = True  # the engine's log-probs are FP8's: TIS weighs the gap to the trainer's
        return self

    @model_validator(mode="after")
    def _cross_checks(self) -> "GrpoConfig":
        r, t = self.rollout, self.train
        samples = r.rollout_batch_size * r.n_samples_per_prompt
        if samples != t.global_batch_size * t.num_steps_per_rollout:
            raise ValueError(
                f"golden rule violated: rollout.rollout_batch_size × rollout.n_samples_per_prompt = "
                f"{r.rollout_batch_size} × {r.n_samples_per_prompt} = {samples}, but train.global_batch_size × "
                f"train.num_steps_per_rollout = {t.global_batch_size} × {t.num_steps_per_rollout} = "
                f"{t.global_batch_size * t.num_steps_per_rollout}; make them equal")
        dp = t.data_parallel
        gpus = self.cluster.trainer_gpus
        if gpus and gpus != dp * t.tensor_parallel:
            raise ValueError(
                f"cluster.trainer_gpus={gpus} but train.data_parallel × train.tensor_parallel = {dp} × "
                f"{t.tensor_parallel} = {dp * t.tensor_parallel}; make them equal (leave data_parallel unset to derive it)")
        if dp % t.expert_parallel:
            raise ValueError(
                f"train.expert_parallel={t.expert_parallel} must divide train.data_parallel={dp} (megatron cuts the "
                f"expert groups from the data-parallel ranks: world {dp * t.tensor_parallel} = TP × EP × expert-DP)")
        if t.global_batch_size % (dp * t.micro_batch_size) != 0:
            raise ValueError(
                f"train.global_batch_size={t.global_batch_size} must be divisible by train.data_parallel × "
                f"train.micro_batch_size = {dp} × {t.micro_batch_size}")
        if t.max_tokens_per_micro_batch is not None:
            longest = self.data.max_prompt_len + r.max_new_tokens
            if t.max_tokens_per_micro_batch < longest:
                raise ValueError(
                    f"train.max_tokens_per_micro_batch={t.max_tokens_per_micro_batch} is below the longest sample "
                    f"(data.max_prompt_len + rollout.max_new_tokens = {longest}); raise it to at least {longest}")
            if t.core_attention == "megatron":
                raise ValueError("train.max_tokens_per_micro_batch packs samples, which megatron's own core attention "
                                 "refuses; set train.core_attention=auto (or sdpa)")
        if t.recompute_num_layers is not None and t.recompute != "full":
            raise ValueError(f"train.recompute_num_layers={t.recompute_num_layers} is only read with "
                             f"train.recompute=full (got {t.recompute}); remove it or set recompute: full")
        if t.recompute == "selective" and not t.recompute_modules:
            raise ValueError("train.recompute=selective needs train.recompute_modules (e.g. [layernorm, mlp])")
        if t.chunked_logprobs == "on" and t.tensor_parallel != 1:
            raise ValueError(f"train.chunked_logprobs=on needs train.tensor_parallel=1 (got {t.tensor_parallel}); "
                             f"under TP the log-probs use megatron's vocab-parallel cross-entropy: set it to auto")
        if self.eval.interval is not None and self.eval.interval % self.checkpoint.interval != 0:
            raise ValueError(
                f"eval.interval={self.eval.interval} must be a multiple of checkpoint.interval="
                f"{self.checkpoint.interval} (an eval needs a checkpoint to export)")
        if r.true_on_policy:
            self._true_on_policy_scope()
        if r.top_k == 0:
            raise ValueError("rollout.top_k=0 keeps no token: use -1 (off) or a count >= 1")
        if r.partial:
            if r.custom_rollout:  # a custom rollout makes its own samples: there is nothing to cut and continue
                raise ValueError("rollout.partial needs the pipeline's own generation, not rollout.custom_rollout: "
                                 "remove rollout.custom_rollout, or set rollout.partial: false")
            if not self.algorithm.use_tis:
                raise ValueError("rollout.partial trains tokens made by older weights, which TIS corrects: set "
                                 "algorithm.use_tis: true (algorithm.tis_mode: mask for MIS)")
        if t.optimizer_on_host and (self.model.dtype == "float32"
                                    or (self.model.dtype == "auto" and self.cluster.device == "cpu")):
            raise ValueError("train.optimizer_on_host keeps an fp32 master of bf16 weights on the host, but the "
                             "weights are fp32 here (their own master); set model.dtype: bfloat16 or "
                             "train.optimizer_on_host: false")
        if self.algorithm.entropy_coef and t.tensor_parallel > 1:
            raise ValueError("algorithm.entropy_coef > 0 needs train.tensor_parallel=1 (the entropy bonus is not "
                             "computed under tensor parallelism); set one of them back")
        if any(k < 1 or k > self.eval.n_samples_per_prompt for k in self.eval.pass_k):
            raise ValueError(f"eval.pass_k={self.eval.pass_k}: every k must be in 1..eval.n_samples_per_prompt")
        if self.storage.root.startswith("s3://") and self.tracking.enabled:
            uri = self.tracking.uri
            if uri is None and self.storage.state_dir is None:
                raise ValueError("storage.root is on S3: set storage.state_dir (a local dir for the MLflow "
                                 "SQLite store) or tracking.uri (an MLflow server)")
            if uri is not None and uri.startswith("sqlite") and "s3://" in uri:
                raise ValueError("tracking.uri: an MLflow SQLite store cannot live on S3; use a local path or a server")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.name):
            raise ValueError(f"name={self.name!r}: use letters, digits, '.', '_' and '-'")
        return self

    def _true_on_policy_scope(self) -> None:
        """What rollout.true_on_policy does not cover, refused in one line each (issue 61)."""
        r, t = self.rollout, self.train
        out = "is out of scope of rollout.true_on_policy (issue 61)"
        if t.tensor_parallel > 1:
            raise ValueError(f"train.tensor_parallel={t.tensor_parallel} {out}: a TP > 1 trainer sums partial products "
                             f"in another order than the engine; set train.tensor_parallel: 1 or "
                             f"rollout.true_on_policy: false")
        if t.lora.enabled and t.lora.dropout > 0:
            raise ValueError(f"train.lora.dropout={t.lora.dropout} {out}: the training forward drops what the engine "
                             f"kept; set train.lora.dropout: 0 or rollout.true_on_policy: false")
        if r.engine != "builtin":
            raise ValueError(f"rollout.engine={r.engine} {out}: only the built-in engine runs the trainer's kernels; "
                             f"set rollout.engine: builtin or rollout.true_on_policy: false")
        if r.weights_dtype != "bf16":
            raise ValueError(f"rollout.weights_dtype={r.weights_dtype} {out}: FP8 weights are not the trainer's; set "
                             f"rollout.weights_dtype: bf16 or rollout.true_on_policy: false")
        if r.partial:
            raise ValueError(f"rollout.partial {out}: carried tokens were sampled under older weights; set "
                             f"rollout.partial: false or rollout.true_on_policy: false")
        if r.cascade_attention:
            raise ValueError(f"rollout.cascade_attention {out}: it sums a row's attention in another order than the "
                             f"trainer; set rollout.cascade_attention: false or rollout.true_on_policy: false")
        if r.decode_path == "hf":
            raise ValueError("rollout.decode_path=hf: rollout.true_on_policy runs in the paged decoder; set "
                             "rollout.decode_path: auto (or paged)")
        if r.custom_rollout:
            raise ValueError(f"rollout.custom_rollout {out}: a custom rollout makes its own log-probs; remove it or "
                             f"set rollout.true_on_policy: false")

    # -- derived quantities --------------------------------------------------------------------
    @property
    def samples_per_rollout(self) -> int:
        return self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt

    def chunk_bounds(self) -> list[tuple[int, int]]:
        """[start, end) rollout ids of each chunk."""
        step = self.checkpoint.interval
        return [(s, min(s + step, self.train.num_rollout)) for s in range(0, self.train.num_rollout, step)]

    def eval_points(self) -> list[int]:
        """Rollout counts after which the model is evaluated (0 = before training)."""
        n = self.train.num_rollout
        pts = [0] if self.eval.before_train else []
        if self.eval.interval:
            pts += list(range(self.eval.interval, n + 1, self.eval.interval))
        if not pts or pts[-1] != n:
            pts.append(n)
        return pts

    def eval_sampling(self) -> dict[str, Any]:
        e, r = self.eval, self.rollout
        return {"temperature": e.temperature, "top_p": e.top_p, "top_k": r.top_k,
                "max_new_tokens": e.max_new_tokens or r.max_new_tokens}

    def rollout_sampling(self) -> dict[str, Any]:
        r = self.rollout
        return {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "max_new_tokens": r.max_new_tokens}


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {dotted}: '{k}' is not a section")
        node = nxt
    node[keys[-1]] = value


# ---- YAML: one value per key -----------------------------------------------------------------------
class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one mapping. PyYAML keeps the last value silently: `lr:` twice under `train:`, or
    two `train:` sections, would run with whichever came last."""

    def __init__(self, key: str, line: int, first_line: int):
        self.key, self.line, self.first_line = key, line, first_line
        super().__init__(f"line {line}: {key} is given twice (first on line {first_line})")


def _check_unique_keys(node, prefix: str = "", visited: set | None = None) -> None:
    visited = set() if visited is None else visited
    if id(node) in visited:  # an alias of a node already checked
        return
    visited.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`, then a key of base: an override
                continue
            if isinstance(key_node, yaml.ScalarNode):
                key = (key_node.tag, key_node.value)
                dotted = f"{prefix}{key_node.value}"
                if key in first:
                    raise DuplicateKeyError(dotted, key_node.start_mark.line + 1, first[key])
                first[key] = key_node.start_mark.line + 1
                _check_unique_keys(value_node, dotted + ".", visited)
            else:
                _check_unique_keys(value_node, prefix, visited)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique_keys(item, f"{prefix}{i}.", visited)


# A config is a few hundred values; aliases can multiply a 1.5 KB file into billions (each level of an "alias
# bomb" repeats the last nine times), which every later reader (validation, its error line) would expand.
MAX_YAML_VALUES = 100_000


class OversizedYamlError(yaml.YAMLError):
    """YAML whose aliases expand past MAX_YAML_VALUES values or refer to themselves, or that nests too deeply."""


def _check_expansion(root) -> None:
    sizes: dict[int, int] = {}  # node -> values it expands to, each shared node counted once per use
    open_nodes: set[int] = set()

    def size(node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_nodes:
            raise OversizedYamlError("an alias refers to the node that contains it (a recursive structure)")
        open_nodes.add(id(node))
        children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                    else node.value if isinstance(node, yaml.SequenceNode) else [])
        total = 1 + sum(size(child) for child in children)
        if total > MAX_YAML_VALUES:
            raise OversizedYamlError(f"its aliases expand to more than {MAX_YAML_VALUES:,} values")
        open_nodes.discard(id(node))
        sizes[id(node)] = total
        return total

    size(root)


MAX_YAML_DEPTH = 100  # PyYAML reads flow collections ([...], {...}) in time quadratic in their depth


def _check_flow_depth(text: str) -> None:
    depth = deepest = 0
    for ch in text:  # brackets inside quoted strings count too: no config has a hundred of them open
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(depth - 1, 0)
    if deepest > MAX_YAML_DEPTH:
        raise OversizedYamlError(f"it nests lists or mappings more than {MAX_YAML_DEPTH} deep")


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses a key given twice in one mapping (:class:`DuplicateKeyError`) and aliases
    that expand past MAX_YAML_VALUES values (:class:`OversizedYamlError`). Every config a user or a run wrote (config
    files, frozen configs, --set values) is read with it."""
    _check_flow_depth(text)
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        _check_unique_keys(node)
        return loader.construct_document(node)
    except RecursionError:  # the composer, the checks and the constructor all recurse per level
        raise OversizedYamlError("it nests lists or mappings too deeply to be read") from None
    finally:
        loader.dispose()


def duplicate_key_error(path: str, err: DuplicateKeyError) -> ConfigError:
    section = "." not in err.key
    fix = f"merge the two {err.key}: sections into one" if section else "keep one of them"
    return ConfigError(f"{path}:{err.line}: {err.key} is given twice (first on line {err.first_line}); {fix}")


def apply_overrides(tree: dict, overrides: list[str] | None) -> dict:
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set train.lr=1e-5")
        key, raw = item.split("=", 1)
        try:
            value = load_yaml(raw) if raw != "" else None
        except DuplicateKeyError as err:
            raise ConfigError(f"--set {key.strip()}: {err.key} is given twice in the value; keep one of them") from None
        except OversizedYamlError as err:
            raise ConfigError(f"--set {key.strip()}: {err}; write the value out") from None
        except yaml.YAMLError:
            value = raw
        _set_path(tree, key.strip(), value)
    return tree


def _explain(err: ValidationError, source: str) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    msg = e["msg"]
    if e["type"] == "extra_forbidden":
        parent = e["loc"][:-1]
        known = _known_keys(parent)
        hint = f"; known keys here: {', '.join(known)}" if known else ""
        return f"{source}: unknown key '{loc}'{hint}"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
        return f"{source}: {msg}" if not loc else f"{source}: {loc}: {msg}"
    inp = e.get("input")
    shown = f" (got {_shown(inp)})" if inp is not None and not isinstance(inp, dict) else ""
    fix = "; give a finite number" if e["type"] == "finite_number" else ""
    return f"{source}: {loc}: {msg}{shown}{fix}"


def _shown(value: Any, limit: int = 80) -> str:
    """A wrong value as the error line quotes it: its repr, cut (a list built by YAML aliases can be megabytes)."""
    from runtime.secrets import redact_value
    text = repr(redact_value(value))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _known_keys(loc: tuple) -> list[str]:
    model: type[BaseModel] = GrpoConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return sorted(model.model_fields)


def config_from_dict(tree: dict, source: str = "config") -> GrpoConfig:
    try:
        return GrpoConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_explain(err, source)) from None


def config_with_overrides(tree: dict, overrides: list[str] | None, source: str) -> GrpoConfig:
    """The config of ``tree`` (read from ``source``) with ``--set`` overrides applied. An error that the
    overrides brought in is reported against ``--set``, not against a file that is fine without them."""
    if not overrides:
        return config_from_dict(tree, source)
    import copy
    merged = apply_overrides(copy.deepcopy(tree), overrides)
    try:
        return GrpoConfig.model_validate(merged)
    except ValidationError as err:
        try:
            GrpoConfig.model_validate(tree)
        except ValidationError:
            raise ConfigError(_explain(err, source)) from None
        raise ConfigError(_explain(err, _blamed_override(err, overrides))) from None


def _blamed_override(err: ValidationError, overrides: list[str]) -> str:
    """`--set KEY=VALUE` of the override an error is about (all of them when it cannot tell)."""
    loc = ".".join(str(p) for p in err.errors()[0]["loc"])
    hits = [o for o in overrides if loc and (o.split("=", 1)[0].strip() == loc
                                             or loc.startswith(o.split("=", 1)[0].strip() + "."))]
    return " ".join(f"--set {o}" for o in (hits or overrides))


def load_config(path: str | Path, overrides: list[str] | None = None) -> GrpoConfig:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a directory; give the path of a YAML config file, e.g. configs/tiny.yaml")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path} (give the path of a YAML config, e.g. configs/tiny.yaml)")
    try:
        tree = load_yaml(path.read_text())
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; give a YAML config file") from None
    except DuplicateKeyError as err:
        raise duplicate_key_error(str(path), err) from None
    except OversizedYamlError as err:
        raise ConfigError(f"{path}: {err}; write the values out instead of nesting aliases") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}{where}: YAML syntax error: {problem}; fix the file") from None
    if tree is None:
        raise ConfigError(f"{path}: the file is empty; a config needs at least its sections (model:, data:, "
                          f"train:, ...), e.g. copy configs/tiny.yaml")
    if not isinstance(tree, dict) or not tree:
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, data:, ...), "
                          f"got {type(tree).__name__ if tree != {} else 'an empty mapping'}")
    tree.setdefault("name", path.stem)
    return config_with_overrides(tree, overrides, str(path))


def dump_config(cfg: GrpoConfig) -> str:
    """The frozen config of a run, as YAML, secrets masked (runtime.secrets)."""
    from runtime.secrets import mask_tree
    return yaml.safe_dump(mask_tree(cfg.model_dump(mode="json")), sort_keys=False)
