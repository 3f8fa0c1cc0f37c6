"""The built-in rollout engine: HF transformers forward passes with our own keyed decode loop.

It is the rollout path wherever SGLang cannot run (CPU, and the GPU machine here). HF's
`generate` is not used because its sampling draws from the global RNG, which would make a
sample depend on its batch neighbours and on process history; our loop draws every token from
`keyed_sampling`, so a request's output depends only on its prompt, key, sampling params and
the weights.

Where the model family has it (`decode_model.unsupported_reason`), `generate` takes the paged decoder
(`paged_decode`): a paged KV cache with shared prompt pages, continuous batching, preemption by
recompute, and on CUDA CUDA-graph decode and the Triton kernel, with the same keyed sampling. HF's
forward with a dynamic cache (`_generate_batch`, `rollout.decode_path: hf`) stays the reference and the
path for model families the paged one lacks.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import Generator
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from runtime.errors import ConfigError, ModelError
from runtime.rollout.base import (GroupsDone, RolloutEngine, SampleRequest, SampleResult, SamplingParams,
                                  drive_generation)
from runtime.rollout.hf_weights import update_targets
from runtime.rollout.keyed_sampling import compiled_gumbel_noise, gumbel_noise, sample_key_hash, sample_next
from runtime.rollout.kv_pages import DEFAULT_PAGE_SIZE

_ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
DECODE_PATHS = ("auto", "paged", "hf")

log = logging.getLogger(__name__)


def _as_id_set(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


@dataclass
class _GenerationCall:
    """A generate call under way: its step generator, the last check point's per-request done flags
    (None before the first), and its results once it ended."""
    run: Generator
    done: list[bool] | None = None
    results: list[SampleResult] | None = None


class BuiltinEngine(RolloutEngine):
    """Batched incremental decoding of an HF causal LM with keyed sampling.

    Requests are cut into batches of at most `max_batch_size`, left-padded (position ids come
    from the attention mask, so padding does not shift RoPE), prefilled once and decoded with a
    `DynamicCache`. Rows that stop are dropped from the batch (and from the cache) at once.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 64,
        attn_implementation: str = "sdpa",
        compile_sampling: bool = False,
        decode_path: str = "auto",
        kv_cache_gb: float | None = None,
        cuda_graphs: bool | None = None,
        compile_decode: bool | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        sync_every: int = 16,
        gpu_memory_gb: float | None = None,
        lora=None,
        shared_base: dict[str, torch.Tensor] | None = None,
        deterministic: bool = True,
        weights_dtype: str = "bf16",
        routing_replay: bool = False,
        cascade_attention: bool = False,
        true_on_policy: bool = False,
        expert_shard=None,
    ):
        """decode_path: "auto" = the paged decoder (`paged_decode`) where the model family has it, else HF's
        forward; "paged" insists (error if the family lacks it); "hf" = HF's forward with a dynamic cache
        (the reference). kv_cache_gb: the paged pool's size in GiB; None: `kv_pages.kv_pool_bytes`'s default. cuda_graphs / compile_decode: None = on for CUDA.
        gpu_memory_gb: the card the run's plan is for (`cluster.gpu_memory_gb`), named if the device runs out of memory.
        deterministic (``rollout.deterministic``): the paged decoder's compiled kernels without timed configurations.
        lora (``train.lora``): the paged decoder applies the adapters in its forward, from buffers of the
        configured rank that weight updates copy into (runtime/rollout/lora_forward.py). shared_base: the
        trainer's frozen base tensors (LoRA, trainer and engine in this process at TP 1): decoded from as they
        are, no weights are loaded from `model_dir` (its config, tokenizer and generation config are read).
        weights_dtype (``rollout.weights_dtype``): "fp8" runs the paged decoder's linear layers in rowwise e4m3
        (runtime/rollout/fp8_weights.py), re-quantised from the trainer's weights at each update (timed:
        `last_quantize_s`); the engine's log-probs (`logprobs_of`) are then its own forward's.
        routing_replay (``rollout.routing_replay``): the paged decoder records each token's experts (a mixture of
        experts; nothing for a dense model), returned as `SampleResult.routed_experts`.
        cascade_attention (``rollout.cascade_attention``): the paged decoder reads a group's prompt pages once per step
        for all its samples (`paged_decode`); on HF's path (hf, or a family without the paged decoder) refused.
        true_on_policy (``rollout.true_on_policy``): the paged decoder's batch-invariant forward, the trainer's
        (runtime/kernels/batch_invariant.py); refused where the paged decoder is not taken.
        expert_shard (``rollout.expert_shards``, an `expert_shards.ShardSpec`): this engine holds one shard of a mixture's
        experts and runs in step with the other engines of its replica (runtime/rollout/expert_shards.py); it joins
        their group here, so they are built at once."""
        if max_batch_size < 1:
            raise ConfigError(f"rollout max_batch_size must be >= 1, got {max_batch_size}: fix rollout.max_batch_size")
        if attn_implementation not in _ATTN_IMPLEMENTATIONS:
            raise ConfigError(f"rollout attn_implementation must be one of {_ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}")
        if decode_path not in DECODE_PATHS:
            raise ConfigError(f"rollout.decode_path must be one of {DECODE_PATHS}, got {decode_path!r}")
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise ModelError(f"no HF model at {model_dir} (config.json missing): point the engine at an HF checkpoint directory")
        if true_on_policy:  # the trainer's cuBLAS workspace, before this process's first handle (in a process of
            # its own the engine would otherwise get the default, and the workspace can steer which GEMM kernel a shape
            # gets)
            from runtime.mcore.determinism import fix_cublas_workspace
            fix_cublas_workspace()
        self.model_dir = str(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch_size = int(max_batch_size)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.lora, self.shares_base = lora, shared_base is not None
        self.expert_shard = None
        if expert_shard is not None:
            from transformers import AutoConfig

            from runtime.rollout.expert_shards import ExpertShard, local_expert_model
            config = AutoConfig.from_pretrained(model_dir)
            if not int(getattr(config, "num_experts", 0) or 0):
                raise ConfigError(f"rollout.expert_shards={expert_shard.count}: {model_dir} is not a mixture of experts; "
                                  f"set rollout.expert_shards: 1")
            if decode_path == "hf" or lora is not None or shared_base is not None:
                raise ConfigError("rollout.expert_shards runs in the paged decoder, without LoRA: set "
                                  "rollout.decode_path: auto (or paged), or rollout.expert_shards: 1")
            self.expert_shard = ExpertShard(expert_shard, int(config.num_experts), self.device)
            self.model = local_expert_model(model_dir, dtype, attn_implementation, self.expert_shard, self.device)
        elif shared_base is not None:
            self.model = _skeleton(model_dir, dtype, attn_implementation)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                              attn_implementation=attn_implementation)
            self.model.to(self.device).eval()
        self.eos_token_ids = _as_id_set(self.tokenizer.eos_token_id) | _as_id_set(
            getattr(self.model.generation_config, "eos_token_id", None)
        )
        if not self.eos_token_ids:
            raise ModelError(f"{model_dir}: neither the tokenizer nor generation_config.json names an eos token; set eos_token")
        pad = self.tokenizer.pad_token_id
        # The pad id only fills masked positions; any valid id works, eos is the usual fallback.
        self.pad_token_id = int(pad) if pad is not None else min(self.eos_token_ids)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        # The keyed noise is ~12 int64 ops per logit; eager that is ~4 ms a step at batch 256 on an
        # H100, compiled ~0.1 ms with the same bits. Off by default: compiling needs a compiler.
        self._gumbel_fn = compiled_gumbel_noise() if compile_sampling else gumbel_noise
        self._weight_version = 0
        self._closed = False
        self._call: _GenerationCall | None = None
        self.decoder = None  # PagedDecoder; None: HF's forward (`_generate_batch`)
        if (lora is not None or shared_base is not None) and decode_path == "hf":
            raise ConfigError("train.lora is applied by the paged decoder: set rollout.decode_path: auto (or paged)")
        if cascade_attention and decode_path == "hf":
            raise ConfigError("rollout.cascade_attention runs in the paged decoder: set rollout.decode_path: auto (or "
                              "paged), or rollout.cascade_attention: false")
        if true_on_policy and decode_path == "hf":
            raise ConfigError("rollout.true_on_policy runs in the paged decoder: set rollout.decode_path: auto "
                              "(or paged)")
        if weights_dtype != "bf16" and decode_path == "hf":
            raise ConfigError(f"rollout.weights_dtype {weights_dtype} runs in the paged decoder: set "
                              f"rollout.decode_path: auto (or paged), or rollout.weights_dtype: bf16")
        self.weights_dtype = weights_dtype
        self.last_quantize_s: float | None = None  # the last weight update's quantisation (fp8)
        if decode_path != "hf":
            from runtime.rollout.decode_model import unsupported_config_reason, unsupported_reason

            reason = unsupported_config_reason(self.model.config) if shared_base is not None \
                else unsupported_reason(self.model)
            if reason is None:
                from runtime.rollout.paged_decode import PagedDecoder
                self.decoder = PagedDecoder(self.model, max_rows=self.max_batch_size, kv_cache_gb=kv_cache_gb,
                                            page_size=page_size, cuda_graphs=cuda_graphs, compile=compile_decode,
                                            sync_every=sync_every, gpu_memory_gb=gpu_memory_gb, lora=lora,
                                            shared_base=shared_base, deterministic=deterministic,
                                            weights_dtype=weights_dtype, record_routes=routing_replay,
                                            cascade=cascade_attention, true_on_policy=true_on_policy,
                                            expert_shard=self.expert_shard)
            elif self.expert_shard is not None:
                raise ConfigError(f"rollout.expert_shards needs the built-in engine's paged decoder, which {model_dir} "
                                  f"lacks: {reason}; set rollout.expert_shards: 1")
            elif lora is not None or shared_base is not None:
                raise ConfigError(f"train.lora needs the built-in engine's paged decoder, which {model_dir} lacks: "
                                  f"{reason}")
            elif true_on_policy:
                raise ConfigError(f"rollout.true_on_policy needs the built-in engine's paged decoder, which "
                                  f"{model_dir} lacks: {reason}; set rollout.true_on_policy: false")
            elif routing_replay:
                raise ConfigError(f"rollout.routing_replay needs the built-in engine's paged decoder, which {model_dir} "
                                  f"lacks: {reason}; set rollout.routing_replay: false")
            elif cascade_attention:
                raise ConfigError(f"rollout.cascade_attention needs the built-in engine's paged decoder, which "
                                  f"{model_dir} lacks: {reason}; set rollout.cascade_attention: false")
            elif weights_dtype != "bf16":
                raise ConfigError(f"rollout.weights_dtype {weights_dtype} needs the built-in engine's paged decoder, "
                                  f"which {model_dir} lacks: {reason}; set rollout.weights_dtype: bf16")
            elif decode_path != "auto":
                raise ConfigError(f"rollout.decode_path {decode_path!r} asked for, but {model_dir}: {reason}; "
                                  f"set rollout.decode_path: hf")
            else:
                log.info("built-in engine: HF decode path (%s)", reason)

    # ---- RolloutEngine ------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def generate(self, requests: list[SampleRequest], sampling: SamplingParams,
                 until: GroupsDone | None = None) -> list[SampleResult]:
        try:
            return drive_generation(self, requests, sampling, until)
        finally:
            self._abandon_generation()

    # ---- a generate call one check point at a time (RolloutEngine.start_generation) ------------------
    # The paged decoder checks before each round of its loop (an admission or a decode chunk of
    # `sync_every` steps), HF's path before each batch and after each step.

    def start_generation(self, requests: list[SampleRequest], sampling: SamplingParams) -> None:
        self._check_open()
        self._abandon_generation()
        from runtime.testing.moments import moment
        moment("generate")  # a rollout's (or an eval's) sampling starts
        requests = list(requests)
        if self.decoder is not None and requests:
            run = self._decoder_steps(requests, sampling)
        else:
            run = self._hf_steps(requests, sampling)
        self._call = _GenerationCall(run)

    def advance_generation(self) -> list[bool] | None:
        call = self._current_call()
        if call.results is not None:
            return None
        try:
            call.done = next(call.run) if call.done is None else call.run.send(False)
        except StopIteration as end:
            call.results = end.value
            return None
        return call.done

    def finish_generation(self) -> list[SampleResult]:
        call = self._current_call()
        if call.results is None:
            try:
                if call.done is None:
                    next(call.run)
                call.run.send(True)
                raise RuntimeError("the built-in engine's generate did not stop when told to")
            except StopIteration as end:
                call.results = end.value
        self._call = None
        return call.results

    def _current_call(self) -> _GenerationCall:
        call = self._call
        if call is None:
            raise RuntimeError("no generate call under way: start_generation first")
        return call

    def _abandon_generation(self) -> None:
        """Drop a call left midway (its KV pages go back)."""
        call, self._call = self._call, None
        if call is not None:
            call.run.close()

    def _hf_steps(self, requests: list[SampleRequest], sampling: SamplingParams):
        """HF's path: batches one after another, a check point before each batch and after each step; the
        requests of the batches not begun when told to stop come back as they were given."""
        done = [False] * len(requests)
        results: list[SampleResult] = []
        stopped = False
        for start in range(0, len(requests), self.max_batch_size):
            batch = requests[start: start + self.max_batch_size]
            if not stopped:
                stopped = bool((yield list(done)))
            if stopped:
                results.extend(self._result(r, list(r.prefix_ids), list(r.prefix_logprobs), "abort") for r in batch)
                continue
            batch_results, stopped = yield from self._generate_batch(batch, sampling, done, start)
            results.extend(batch_results)
        return results

    def _result(self, request: SampleRequest, ids: list[int], logprobs: list[float], finish: str,
                routes: torch.Tensor | None = None) -> SampleResult:
        return SampleResult(prompt_ids=list(request.prompt_ids), response_ids=ids, response_logprobs=logprobs,
                            text=self.tokenizer.decode(ids, skip_special_tokens=True), finish_reason=finish,
                            routed_experts=routes)

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Copy HF-named tensors into the model in place (dtype/device converted); all-or-nothing checks first.
        With LoRA: the trainer's adapters (``MegatronTrainer.engine_weights``), copied into the decoder's buffers."""
        self._check_open()
        if self.lora is not None:
            self._update_adapters(named_tensors, version)
            return
        state = self._update_targets()  # tensors share storage with the parameters
        named_tensors = {k: v for k, v in named_tensors.items() if not self._others_expert(k)}
        unknown = sorted(name for name in named_tensors if name not in state)
        if unknown:
            raise ValueError(f"update_weights: {len(unknown)} name(s) not in the model, e.g. {unknown[:3]}")
        mismatched = [
            f"{name} {tuple(t.shape)} vs {tuple(state[name].shape)}"
            for name, t in named_tensors.items()
            if tuple(t.shape) != tuple(state[name].shape)
        ]
        if mismatched:
            raise ValueError(f"update_weights: shape mismatch for {len(mismatched)} tensor(s), e.g. {mismatched[:3]}")
        quantized = self._fp8_targets()
        with torch.no_grad(), self._timing_quantization():
            for name, tensor in named_tensors.items():
                if name in quantized:
                    self.decoder.load_linear(name, tensor)
                else:
                    state[name].copy_(tensor)
        self._weight_version = int(version)

    def _update_targets(self) -> dict[str, torch.Tensor]:
        return update_targets(self.model, 0 if self.expert_shard is None else self.expert_shard.first)

    def _others_expert(self, name: str) -> bool:
        """Whether ``name`` is an expert's weight another shard of this replica holds (passed over here)."""
        if self.expert_shard is None:
            return False
        from runtime.rollout.expert_shards import hub_expert
        hub = hub_expert(name)
        return hub is not None and self.expert_shard.others(hub[1])

    def _fp8_targets(self) -> dict:
        return self.decoder.fp8_targets if self.decoder is not None else {}

    @contextlib.contextmanager
    def _timing_quantization(self):
        """Time a weight update's FP8 quantisation (`last_quantize_s`; nothing with bf16 weights)."""
        if not self._fp8_targets():
            yield
            return
        t0 = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_quantize_s = time.perf_counter() - t0
        log.info("built-in engine: weights quantised to fp8 in %.3f s", self.last_quantize_s)

    # ---- weight sync over a torch.distributed group (runtime/placement/weight_sync.py) --------------------

    def weight_sync_ranks(self) -> int:
        return 1

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, group_name: str) -> None:
        from runtime.placement import weight_sync
        self._check_open()
        self._leave_weight_sync()
        self._sync_group = weight_sync.init_group(host, port, rank_offset, world_size, group_name=group_name,
                                                  backend=weight_sync.backend_for(self.device.type))

    def _leave_weight_sync(self) -> None:
        from runtime.placement import weight_sync
        if getattr(self, "_sync_group", None) is not None:
            weight_sync.destroy_group(self._sync_group)
            self._sync_group = None

    def weight_sync_ready(self) -> bool:
        return getattr(self, "_sync_group", None) is not None

    def receive_weights(self, metadata, version: int) -> None:
        """Receive the trainer's broadcast straight into the parameters (same dtype), else via a copy.
        Everything is received before any check, so a bad name never leaves the sender blocked."""
        from runtime.placement import weight_sync
        self._check_open()
        metadata = weight_sync.as_metadata(metadata)
        if self.lora is not None:  # the adapters: received whole, then copied into the decoder's buffers
            self._update_adapters(weight_sync.receive(self._sync_group, metadata, self.device), version)
            return
        state = self._update_targets()
        quantized = self._fp8_targets()
        if quantized or self.expert_shard is not None:
            # one tensor at a time, quantised as it comes (the bf16 weights are never all here at once); a shard
            # receives the other shards' experts too (one broadcast for all) and drops each as it comes
            bad = [f"{name} {tuple(shape)}" for name, _, shape in metadata if not self._others_expert(name)
                   and (name not in state or tuple(shape) != tuple(state[name].shape))]
            with torch.no_grad(), self._timing_quantization():
                for item in metadata:  # a bad update is received whole (the sender is not left blocked), not applied
                    name, t = next(iter(weight_sync.receive(self._sync_group, [item], self.device,
                                                            into=None if bad else state).items()))
                    if bad or self._others_expert(name):
                        continue
                    if name in quantized:
                        self.decoder.load_linear(name, t)
                    elif t.data_ptr() != state[name].data_ptr():
                        state[name].copy_(t)
            if bad:
                raise ValueError(f"receive_weights: {len(bad)} tensor(s) not in the model or of another shape, "
                                 f"e.g. {bad[:3]}")
            self._weight_version = int(version)
            return
        got = weight_sync.receive(self._sync_group, metadata, self.device, into=state)
        unknown = sorted(name for name in got if name not in state)
        if unknown:
            raise ValueError(f"receive_weights: {len(unknown)} name(s) not in the model, e.g. {unknown[:3]}")
        with torch.no_grad():
            for name, tensor in got.items():
                if tensor.data_ptr() != state[name].data_ptr():
                    state[name].copy_(tensor)
        self._weight_version = int(version)

    def _update_adapters(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        from runtime.rollout.lora_forward import is_adapter_name
        others = sorted(n for n in named_tensors if not is_adapter_name(n))
        if others:
            raise ValueError(f"update_weights: a LoRA engine takes the trainer's adapters only; got {len(others)} "
                             f"other tensor(s), e.g. {others[:3]}")
        self.decoder.adapters.load(named_tensors)
        self._weight_version = int(version)

    def health(self) -> dict:
        return {
            "ok": not self._closed,
            "engine": "builtin",
            "weight_version": self._weight_version,
            "model_dir": self.model_dir,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "max_batch_size": self.max_batch_size,
            "decode_path": self.decode_path,
            "lora_rank": None if self.lora is None else self.lora.rank,
            "shares_base": self.shares_base,
            "weights_dtype": self.weights_dtype,
            "records_routes": bool(self.decoder is not None and self.decoder.record_routes),  # rollout.routing_replay
            "cascade_attention": bool(self.decoder is not None and self.decoder.cascade),  # rollout.cascade_attention
            "weight_bytes": None if self.decoder is None else self.decoder.weight_bytes,  # the paged decoder's weights
            # rollout.expert_shards: (this engine's shard, the replica's shards)
            "expert_shard": None if self.expert_shard is None else [self.expert_shard.index, self.expert_shard.count],
        }

    def shutdown(self) -> None:
        if self._closed:
            return
        self._abandon_generation()
        self._closed = True
        # before the trainer's side goes: NCCL's watchdog polls the store rank 0 hosts, and warns each second
        self._leave_weight_sync()
        if self.expert_shard is not None:
            self.expert_shard.close()
        if self.decoder is not None:
            self.decoder.release()
            self.decoder = None
        del self.model
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- memory hand-off with a colocated trainer ------------------------------------------------

    def release_memory(self) -> None:
        """Free the KV cache (the paged pool) and the captured CUDA graphs while the trainer trains; the
        weights stay (weight updates still land). `resume_memory` (or the next `generate`) makes them again."""
        self._check_open()
        self._abandon_generation()
        if self.decoder is not None:
            self.decoder.release()
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """Allocate the KV pool again, before the next `generate` (graphs are captured again at their first
        step). Sized as at the first call: `kv_cache_gb`, or its share of what is free now."""
        self._check_open()
        if self.decoder is not None:
            self.decoder.ensure_pool()

    # ---- extras -------------------------------------------------------------------------------

    @property
    def decode_path(self) -> str:
        """Which decoder `generate` takes: "paged" or "hf"."""
        return "hf" if self.decoder is None else "paged"

    @torch.inference_mode()
    def logprobs_of(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Teacher-forced log-probs of response_ids given prompt_ids, under log_softmax(logits / temperature).

        The same quantity `generate` returns per token (temperature 0 is treated as 1, as there);
        used to check that weights reached the engine and that rollout and trainer agree.
        """
        self._check_open()
        if not response_ids:
            return []
        ids = torch.tensor([list(prompt_ids) + list(response_ids)], dtype=torch.long, device=self.device)
        self._check_token_range(ids)
        if self.lora is not None or self.shares_base or self.weights_dtype != "bf16" or self.expert_shard is not None:
            # the decoder's own forward holds the adapters (and the base), the FP8 weights, or the replica's sum
            logits = self.decoder.sequence_logits(ids[0]).float()
        else:
            logits = self.model(input_ids=ids, use_cache=False).logits[0].float()
        scale = temperature if temperature > 0 else 1.0
        predicting = logits[len(prompt_ids) - 1 : -1] / scale  # position t predicts token t + 1
        logprobs = torch.log_softmax(predicting, dim=-1)
        targets = torch.tensor(response_ids, dtype=torch.long, device=self.device)
        return logprobs.gather(-1, targets[:, None]).squeeze(-1).tolist()

    # ---- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("BuiltinEngine was shut down; build a new one")

    def _check_token_range(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got range [{int(ids.min())}, {int(ids.max())}]")

    def _stop_ids(self, sampling: SamplingParams) -> set[int]:
        return set(self.eos_token_ids) | set(sampling.stop_token_ids)

    def _decoder_steps(self, requests: list[SampleRequest], sampling: SamplingParams):
        """The paged decoder's `steps` over the requests (checked here, before the first step); the
        generator returns the results."""
        for r in requests:
            if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= self.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.vocab_size}), got range "
                                 f"[{min(r.prompt_ids)}, {max(r.prompt_ids)}]")
        key_hash = sample_key_hash(torch.tensor([r.key for r in requests], dtype=torch.long, device=self.device))
        prefixes = [(list(r.prefix_ids), list(r.prefix_logprobs)) for r in requests] \
            if any(r.prefix_ids for r in requests) else None
        prefix_routes = [r.prefix_routes for r in requests] if any(r.prefix_routes is not None for r in requests) \
            else None
        steps = self.decoder.steps([list(r.prompt_ids) for r in requests], key_hash, sampling,
                                   self._stop_ids(sampling), prefixes=prefixes, prefix_routes=prefix_routes)

        def run():
            ids, lps, finish = yield from steps
            routes = self.decoder.last_routes
            return [self._result(r, i, lp, f, rt) for r, i, lp, f, rt in zip(requests, ids, lps, finish, routes)]
        return run()

    @torch.inference_mode()
    def _generate_batch(self, batch: list[SampleRequest], sampling: SamplingParams, done: list[bool], first: int):
        """HF's forward with a dynamic cache over one batch of requests (done[first + i] is request i's
        flag in the whole call). A continued request is prefilled with its prompt and its prefix. A
        generator (`_hf_steps`' check points); returns (results, whether told to stop)."""
        cap = sampling.max_new_tokens
        stop_set = self._stop_ids(sampling)
        response_ids = [list(r.prefix_ids[:cap]) for r in batch]
        response_logprobs = [list(r.prefix_logprobs[:cap]) for r in batch]
        finish_reason = ["stop" if ids and ids[-1] in stop_set else "length" for ids in response_ids]
        for row, ids in enumerate(response_ids):
            done[first + row] = finish_reason[row] == "stop" or len(ids) >= cap
        live_rows = [row for row in range(len(batch)) if not done[first + row]]
        stopped = False
        if live_rows:
            stopped = yield from self._decode_rows(batch, live_rows, sampling, stop_set, response_ids,
                                                   response_logprobs, finish_reason, done, first)
        return [self._result(r, response_ids[row], response_logprobs[row],
                             finish_reason[row] if done[first + row] else "abort") for row, r in enumerate(batch)], stopped

    def _decode_rows(self, batch, live_rows, sampling, stop_set, response_ids, response_logprobs, finish_reason,
                     done, first):
        """Decode the live rows of a batch; a check point after every step. Returns whether told to stop."""
        device = self.device
        cap = sampling.max_new_tokens
        inputs = [list(batch[row].prompt_ids) + response_ids[row] for row in live_rows]
        width = max(len(x) for x in inputs)
        input_ids = torch.full((len(inputs), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(inputs), width), dtype=torch.long)
        for i, ids in enumerate(inputs):
            input_ids[i, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, width - len(ids):] = 1
        self._check_token_range(input_ids)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        key_hash = sample_key_hash(torch.tensor([batch[row].key for row in live_rows], dtype=torch.long,
                                                device=device))
        stop_ids = torch.tensor(sorted(stop_set), dtype=torch.long, device=device)
        # the noise position of each row's next token: its index in the response (padding cannot shift it)
        decode_position = torch.tensor([len(response_ids[row]) for row in live_rows], dtype=torch.long, device=device)

        cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1, :]
        next_position = position_ids[:, -1] + 1
        while True:
            tokens, logprobs = sample_next(logits, key_hash, decode_position, sampling, self._gumbel_fn)
            stopped = torch.isin(tokens, stop_ids)
            ended = []
            for row, token, logprob, is_stop in zip(live_rows, tokens.tolist(), logprobs.tolist(), stopped.tolist()):
                response_ids[row].append(token)
                response_logprobs[row].append(logprob)
                if is_stop:
                    finish_reason[row] = "stop"
                if is_stop or len(response_ids[row]) >= cap:
                    done[first + row] = True
                ended.append(done[first + row])
            if all(ended):
                return False
            if (yield list(done)):
                return True
            if any(ended):
                keep = torch.tensor([i for i, e in enumerate(ended) if not e], dtype=torch.long, device=device)
                cache.batch_select_indices(keep)
                attention_mask, key_hash, next_position, tokens, decode_position = (
                    attention_mask[keep], key_hash[keep], next_position[keep], tokens[keep], decode_position[keep]
                )
                live_rows = [row for row, e in zip(live_rows, ended) if not e]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(live_rows), 1))], dim=1)
            logits = self.model(
                input_ids=tokens[:, None],
                attention_mask=attention_mask,
                position_ids=next_position[:, None],
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1, :]
            next_position = next_position + 1
            decode_position = decode_position + 1


def _skeleton(model_dir: str, dtype: torch.dtype, attn_implementation: str):
    """The HF model of `model_dir` without weights (meta device): config, sizes and generation config, for an
    engine that decodes with a base it does not own."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    try:
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json: the one made from config.json stays
        pass
    return model.eval()
