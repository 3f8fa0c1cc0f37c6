"""Everything megatron-core needs to run, in one place: process groups, the CPU shims, and the
GPTModel builder.

megatron-core assumes CUDA in a few places (``torch.cuda.current_device()`` used as a device,
``torch.cuda.synchronize()`` in the torch_dist writer, ``device='cuda'`` scalars in its optimizer
wrappers, a CUDA RNG tracker). On CPU we patch exactly those and nothing else; on CUDA nothing is
patched. The shims are installed by :func:`init_parallel` and removed by :func:`destroy_parallel`.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import queue
import warnings
from typing import Any

# megatron warns at import time that TE/apex are missing; on CPU that is the expected state.
warnings.filterwarnings("ignore", message=r".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=r".*Apex is not installed.*")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from megatron.core import parallel_state as mpu  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402

from runtime.mcore import varlen_attention  # noqa: E402
from runtime.placement.ports import free_port  # noqa: E402  (re-exported: callers set up ranks with it)

_state: dict[str, Any] = {"device": None, "saved_cuda_fns": None}


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', not {device!r}")
    return device


def _install_cpu_shims() -> None:
    if _state["saved_cuda_fns"] is not None:
        return
    rng = tensor_parallel.random
    _state["saved_cuda_fns"] = (torch.cuda.current_device, torch.cuda.synchronize,
                                rng._get_cuda_rng_state, rng._set_cuda_rng_state)
    # megatron passes current_device() as a device argument (RoPE buffers, DDP grad buffers,
    # optimizer scalars); "cpu" makes those land on CPU.
    torch.cuda.current_device = lambda: "cpu"
    # the torch_dist writer synchronises after device-to-host copies
    torch.cuda.synchronize = lambda *a, **k: None
    # activation recomputation (tensor_parallel.checkpoint, CheckpointWithoutOutput) saves and restores
    # the CPU, CUDA and tracker RNG states around the recomputed forward; on CPU the CPU state (which it
    # saves itself) is the device's, so the CUDA one is an empty stand-in.
    rng._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    rng._set_cuda_rng_state = lambda *a, **k: None


def _remove_cpu_shims() -> None:
    saved = _state["saved_cuda_fns"]
    if saved is not None:
        rng = tensor_parallel.random
        torch.cuda.current_device, torch.cuda.synchronize, rng._get_cuda_rng_state, rng._set_cuda_rng_state = saved
        _state["saved_cuda_fns"] = None


def save_results_in_this_process() -> None:
    """Before a torch_dist save: megatron's writer hands its write results back through a queue it keeps
    per process, by default a ``multiprocessing`` Manager — a server process, started with spawn on the
    first save and stopped only by a clean exit — so that an async save's writer process could report.
    Our writer reports from this process (a thread of it: runtime/trainer/checkpoint_writer.py), so a plain
    queue does the same with no process. That Manager outlived every process killed without its exit handlers: a trainer actor on a
    removed Ray node left it (and its resource tracker) running, orphaned, ~430 MB each."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:  # not made yet (and the name still exists)
        filesystem_async._results_queue = queue.Queue()


def parallel_device() -> str | None:
    """The device :func:`init_parallel` set up for ("cpu"/"cuda"), None before it ran."""
    return _state["device"] if dist.is_initialized() else None


def init_parallel(rank: int = 0, world_size: int = 1, tp: int = 1, master_addr: str = "127.0.0.1",
                  master_port: int | None = None, device: str = "cpu", seed: int = 1234, ep: int = 1) -> None:
    """Start torch.distributed (gloo on CPU, nccl on CUDA) and megatron's model-parallel groups.

    Idempotent: when torch.distributed is already up with the same rank and world size, only the
    model-parallel state is (re)built for ``tp`` and ``ep`` (expert parallelism: megatron's expert groups of ``ep``
    ranks cut from the data-parallel ones, the experts' TP that of the dense layers). ``master_port=None`` uses $MASTER_PORT, or a free
    port for a single process. ``seed`` seeds megatron's CUDA RNG tracker (CUDA only; on CPU the
    inference tracker is used, whose ``fork()`` is a no-op: dropout is 0 in every model we build).
    """
    device = _resolve_device(device)
    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {world_size}")
        if _state["device"] is None:  # initialised by someone else (torchrun, a test harness)
            _state["device"] = "cuda" if dist.get_backend() == "nccl" else "cpu"
        if _state["device"] != device:  # a model built for one device on the other's state runs wrong, silently
            raise RuntimeError(f"init_parallel: this process's parallel state is for {_state['device']}, not "
                               f"{device} (a CPU job left it up? see runtime/mcore/cpu_job.py)")
    else:
        if master_port is None:
            if os.environ.get("MASTER_PORT"):
                master_port = int(os.environ["MASTER_PORT"])
            elif world_size == 1:
                master_port = free_port(master_addr)
            else:
                raise ValueError("init_parallel: master_port (or $MASTER_PORT) is required for world_size > 1")
        if device == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
            torch.cuda.set_device(local_rank)
        dist.init_process_group(
            backend="nccl" if device == "cuda" else "gloo",
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=30))
        _state["device"] = device

    if device == "cpu":
        _install_cpu_shims()
    if mpu.model_parallel_is_initialized():
        if mpu.get_tensor_model_parallel_world_size() == tp and mpu.get_expert_model_parallel_world_size() == ep:
            return
        mpu.destroy_model_parallel()
    if world_size % (tp * ep):
        raise ValueError(f"init_parallel: world_size {world_size} is not a multiple of tp {tp} × ep {ep}")
    mpu.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    if device == "cpu":
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def ensure_parallel(device: str = "cpu") -> None:
    """``init_parallel()`` for a single process unless torch.distributed is already up."""
    if not dist.is_initialized():
        init_parallel(device=device)
    elif not mpu.model_parallel_is_initialized():
        init_parallel(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)


def destroy_parallel() -> None:
    """Tear down model-parallel groups and torch.distributed, and remove the CPU shims."""
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _remove_cpu_shims()
    _state["device"] = None


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device='cuda'`` (or ``'cuda:N'``, or an int) in every torch call to CPU.

    megatron's optimizer wrappers allocate scalars on a hard-coded CUDA device and assert that
    parameters are ``torch.cuda.FloatTensor``; both are answered here without touching real CUDA.
    """

    @staticmethod
    def _fix(device):
        if isinstance(device, str) and device.startswith("cuda"):
            return "cpu"
        if isinstance(device, torch.device) and device.type == "cuda":
            return torch.device("cpu")
        if isinstance(device, int) and not isinstance(device, bool):
            return "cpu"
        return device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], self._fix(args[1]), *args[2:])
        if "device" in kwargs:
            kwargs["device"] = self._fix(kwargs["device"])
        return func(*args, **kwargs)


def cuda_to_cpu() -> contextlib.AbstractContextManager:
    """Context for megatron calls that hard-code CUDA (``get_megatron_optimizer``,
    ``optimizer.step()``, ``sharded_state_dict``, dist_checkpointing save/load). A no-op on CUDA."""
    device = parallel_device() or ("cuda" if torch.cuda.is_available() else "cpu")
    return _CudaToCpuMode() if device == "cpu" else contextlib.nullcontext()


def _patch_checkpoint_without_output() -> None:
    """megatron-core's ``CheckpointWithoutOutput`` (selective "layernorm" recompute) sets
    ``self.fp8 = fp8 is not None``, True for its default ``fp8=False``, and then calls TE's FP8 state
    manager, a NameError without TE (0.16.1). Without TE there is no FP8: its ``fp8`` is made False."""
    rng = tensor_parallel.random
    cls = rng.CheckpointWithoutOutput
    if getattr(rng, "HAVE_TE", False) or getattr(cls, "_grpoflow_no_fp8", False):
        return
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.fp8 = False

    cls.__init__ = __init__
    cls._grpoflow_no_fp8 = True


def _patch_router_gemm() -> None:
    """megatron-core's MoE router gating (``RouterGatingLinearFunction``) tests ``te_general_gemm is not None``,
    a name its module leaves undefined when Transformer Engine is missing (0.16.1): a NameError at the first
    routed token. Without TE the name is None, and the router's own torch GEMM runs."""
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def recompute_kwargs(recompute: str = "none", modules=("layernorm", "mlp"), num_layers: int | None = None,
                     total_layers: int | None = None) -> dict:
    """``TransformerConfig`` fields for ``train.recompute`` / ``recompute_modules`` / ``recompute_num_layers``.
    full: megatron's "block" method over the first ``num_layers`` layers (None: all ``total_layers``),
    each of which keeps only its input and runs again in the backward."""
    if recompute == "none":
        return {}
    if recompute == "selective":
        if "layernorm" in modules:
            _patch_checkpoint_without_output()
        return dict(recompute_granularity="selective", recompute_modules=list(modules))
    if recompute == "full":
        n = num_layers if num_layers is not None else total_layers
        if n is None:
            raise ValueError("full recompute needs num_layers or total_layers")
        return dict(recompute_granularity="full", recompute_method="block",
                    recompute_num_layers=min(int(n), int(total_layers or n)))
    raise ValueError(f"recompute must be none, selective or full, not {recompute!r}")


def build_transformer_config(hf_config, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                             init_weights: bool = True, fusions: str | list = "auto", recompute: str = "none",
                             recompute_modules=("layernorm", "mlp"), recompute_num_layers: int | None = None,
                             **overrides):
    """megatron ``TransformerConfig`` for an HF config: the family's architecture fields plus the
    settings RL post-training wants (no dropout, none of the fusions that need TE/apex). On CUDA the
    pure-PyTorch fusions of :mod:`runtime.mcore.fusions` (RoPE, SwiGLU, bias-dropout-add) per
    ``fusions`` (``train.fusions``); on CPU all are off. ``recompute*``: :func:`recompute_kwargs`."""
    from megatron.core.transformer import TransformerConfig

    from runtime.mcore import fusions as megatron_fusions
    from runtime.models import get_adapter

    kwargs = get_adapter(hf_config).transformer_config_kwargs(hf_config)
    if kwargs.get("num_moe_experts"):
        _patch_router_gemm()
        # the experts split as the process's groups are (init_parallel's ep): each rank builds its own experts
        if mpu.model_parallel_is_initialized():
            kwargs["expert_model_parallel_size"] = mpu.get_expert_model_parallel_world_size()
    device = _resolve_device(device)
    kwargs.update(
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=device == "cpu",
        perform_initialization=init_weights,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    # apply_rope_fusion, bias_activation_fusion, bias_dropout_fusion: False on CPU
    kwargs.update(megatron_fusions.config_kwargs(device, {**kwargs, **overrides}, fusions))
    kwargs.update(recompute_kwargs(recompute, recompute_modules, recompute_num_layers, kwargs["num_layers"]))
    if "cuda_graph_scope" in TransformerConfig.__dataclass_fields__:
        # 0.16's default "full" warns as deprecated on every build; [] means the same thing.
        kwargs["cuda_graph_scope"] = []
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def uses_sdpa_attention(device: str, core_attention: str = "auto", packed: bool = False) -> bool:
    """Whether the trainer's model gets :class:`SdpaCoreAttention` (``train.core_attention``): auto = on
    CUDA, and on CPU for packed micro-batches (megatron's own refuses them)."""
    if core_attention == "sdpa":
        return True
    if core_attention == "megatron":
        return False
    if core_attention != "auto":
        raise ValueError(f"core_attention must be auto, sdpa or megatron, not {core_attention!r}")
    return _resolve_device(device) == "cuda" or packed


def build_gpt_model(hf_config, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                    init_weights: bool = True, parallel_output: bool = True, fusions: str | list = "auto",
                    core_attention: str = "auto", packed: bool = False, packed_attention: str = "flash2",
                    batch_invariant: bool = False, grouped_experts: bool = False, **config_overrides):
    """A megatron ``GPTModel`` with the architecture of ``hf_config`` and its family's layer spec
    (``adapter.layer_spec``: megatron-core's local spec unless the family needs its own), its core
    attention per :func:`uses_sdpa_attention` (``packed``: the model will see packed micro-batches, through the
    ``packed_attention`` kernel of runtime/mcore/varlen_attention.py on CUDA).

    ``init_weights=False`` skips the random init (the weights are garbage until loaded): use it
    when a checkpoint is loaded right after. Calls :func:`ensure_parallel` first.
    ``grouped_experts``: a mixture of experts' experts as grouped GEMMs (runtime/mcore/grouped_experts.py).
    ``config_overrides``: :func:`build_transformer_config`'s keywords (recompute, TransformerConfig fields).
    ``batch_invariant`` (``rollout.true_on_policy``): no fusions, and the core attention, norms and linear layers
    the engine runs too (runtime/mcore/batch_invariant.py).
    """
    from megatron.core.models.gpt import GPTModel

    from runtime.mcore import fusions as megatron_fusions
    from runtime.models import get_adapter

    device = _resolve_device(device)
    ensure_parallel(device)
    if batch_invariant:  # the fused RoPE / SwiGLU / norm kernels drop roundings the engine's eager ops make
        fusions = "none"
    config = build_transformer_config(hf_config, dtype=dtype, device=device, init_weights=init_weights,
                                      fusions=fusions, **config_overrides)
    adapter = get_adapter(hf_config)
    spec = adapter.layer_spec(hf_config)
    if grouped_experts:
        from runtime.mcore.grouped_experts import with_grouped_experts
        spec = with_grouped_experts(spec)
    if uses_sdpa_attention(device, core_attention, packed):
        native_gqa = "gqa" in megatron_fusions.active(device, fusions) and megatron_fusions.sdpa_supports_gqa()
        spec = _with_sdpa_core_attention(spec, native_gqa, packed_attention)
    if batch_invariant:
        from runtime.mcore.batch_invariant import with_batch_invariant_core_attention
        spec = with_batch_invariant_core_attention(spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        pre_process=True,
        post_process=True,
        parallel_output=parallel_output,
        **adapter.gpt_model_kwargs(hf_config),
    )
    if not init_weights:
        _mark_tensor_parallel_params(model)
    if "norm" in megatron_fusions.active(device, fusions):
        megatron_fusions.use_compiled_norms(model)
    if batch_invariant:
        from runtime.mcore.batch_invariant import (use_batch_invariant_linears, use_batch_invariant_norms,
                                                   use_host_rope_table)
        use_batch_invariant_norms(model)
        use_batch_invariant_linears(model)
        use_host_rope_table(model)
    if device == "cuda":
        model = model.cuda(torch.cuda.current_device())
    if dtype in (torch.bfloat16, torch.float16):
        # What megatron's Float16Module does to the model it wraps: every parameter (and floating
        # buffer) in the low-precision dtype. The local spec builds its norms in fp32 otherwise, and
        # megatron's mixed-precision optimizer then has fp32 params that its sharded state dict
        # cannot place ("Param id N does not match any model sharded param" at save).
        model = model.to(dtype=dtype)
    return model


def _mark_tensor_parallel_params(model) -> None:
    """Set the TP attributes megatron's init would have set (it skips them with perform_initialization
    off on CPU); grad-norm de-duplication and our TP gathers read them."""
    from megatron.core.tensor_parallel import layers as tpl
    for module in model.modules():
        if isinstance(module, (tpl.ColumnParallelLinear, tpl.VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, tpl.RowParallelLinear):
            dim = 1
        else:
            continue
        w = getattr(module, "weight", None)
        if w is not None and not getattr(w, "tensor_model_parallel", False):
            tpl.set_tensor_model_parallel_attributes(w, True, dim, 1)
        b = getattr(module, "bias", None)
        if dim == 0 and b is not None and not getattr(b, "tensor_model_parallel", False):
            tpl.set_tensor_model_parallel_attributes(b, True, 0, 1)
    for p in model.parameters():
        tpl.set_defaults_if_not_set_tensor_model_parallel_attributes(p)


def _with_sdpa_core_attention(spec, native_gqa: bool, packed_attention: str = "flash2"):
    """The layer spec with megatron's unfused ``DotProductAttention`` (it materialises [b, h, s, s]
    scores and refuses packed sequences) replaced by :class:`SdpaCoreAttention`."""
    import copy

    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    attn = getattr(getattr(spec, "submodules", None), "self_attention", None)
    sub = getattr(attn, "submodules", None)
    if sub is None or getattr(sub, "core_attention", None) is not DotProductAttention:
        return spec
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=SdpaCoreAttention, params={"native_gqa": native_gqa, "packed_attention": packed_attention})
    return spec


class SdpaCoreAttention(MegatronModule):
    """Drop-in for megatron's local ``DotProductAttention``: the same [s, b, h, d] in and
    [s, b, h*d] out, computed by ``F.scaled_dot_product_attention`` (flash kernel on CUDA); and
    packed sequences (``packed_seq_params`` in megatron's ``thd`` layout: [t, h, d] in, [t, h*d] out,
    ``cu_seqlens`` marking where each sample starts), which megatron's refuses without TE.

    For the causal mask type (every self-attention layer we build) the causal structure is
    applied by the kernel and the passed mask is not read: the trainer's mask is exactly the
    causal one, and right padding never reaches a real token under it. Other mask types use the
    mask (True = masked out, megatron's convention).

    Packed: on CUDA in half precision the variable-length kernel ``packed_attention`` names
    (runtime/mcore/varlen_attention.py, with ``cu_seqlens``: every sample attends causally to
    itself only, no [t, t] mask, K/V at their own heads); elsewhere (CPU, fp32) SDPA with a
    block-causal mask built from ``cu_seqlens`` (key j is seen by query i iff same sample and j <= i).

    Grouped-query attention: K/V keep their own (fewer) heads and SDPA broadcasts them
    (``enable_gqa=True``, cuDNN and flash take it natively) when ``native_gqa`` (the ``gqa`` fusion of
    ``train.fusions``, torch >= 2.5); else they are ``repeat_interleave``-d to every query head first.
    No copies otherwise: q/k/v go in as permuted views of megatron's [s, b, h, d], and the output
    comes back as a view when the kernel wrote it in that layout (cuDNN allocates it like the query)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, native_gqa: bool = False,
                 packed_attention: str = "flash2", **_ignored):
        super().__init__(config=config)
        tp = pg_collection.tp.size() if pg_collection is not None else mpu.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = max(config.num_query_groups // tp, 1)
        self.head_dim = config.kv_channels
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.head_dim ** -0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.native_gqa = bool(native_gqa)
        self.packed_kernel = varlen_attention.KERNELS[packed_attention]

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert attention_bias is None
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d] views
        gqa = {}
        if self.heads != k.shape[1]:
            if self.native_gqa:
                gqa = {"enable_gqa": True}
            else:
                rep = self.heads // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        mask = None if causal or attention_mask is None else ~attention_mask
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale,
            dropout_p=self.dropout if self.training else 0.0, **gqa)
        # [b, h, s, d] -> [s, b, h*d]: a view when `out` is laid out as [s, b, h, d], else one copy
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)

    def _packed(self, query, key, value, params):
        if params.qkv_format != "thd":
            raise ValueError(f"SdpaCoreAttention: packed sequences in the thd layout only, not {params.qkv_format!r}")
        if self.training and self.dropout > 0:
            raise ValueError("SdpaCoreAttention: packed sequences without attention dropout only")
        t = query.shape[0]
        cu_q, cu_k = params.cu_seqlens_q, params.cu_seqlens_kv
        if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
            out = self.packed_kernel(query, key, value, cu_q, cu_k, int(params.max_seqlen_q),
                                         int(params.max_seqlen_kv), self.softmax_scale)
            return out.reshape(t, self.heads * self.head_dim)
        q, k, v = (x.unsqueeze(0).transpose(1, 2) for x in (query, key, value))  # [1, h, t, d]
        if self.heads != k.shape[1]:
            rep = self.heads // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=block_causal_mask(cu_q, t), scale=self.softmax_scale)
        return out[0].transpose(0, 1).reshape(t, self.heads * self.head_dim)


def block_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total, total] bool, True = attend: query i sees key j iff both are in one sample and j <= i."""
    cu = cu_seqlens.to(torch.int64)
    idx = torch.arange(total, device=cu_seqlens.device)
    sample = torch.searchsorted(cu[1:], idx, right=True)
    return (sample[:, None] == sample[None, :]) & (idx[None, :] <= idx[:, None])


def causal_attention_mask(batch: int, seq_len: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """megatron's mask convention: True = masked out, shape [b, 1, s, s]."""
    mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)
    return mask.view(1, 1, seq_len, seq_len).expand(batch, 1, seq_len, seq_len)


def unwrap_model(model):
    """The GPTModel inside DDP/Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


__all__ = [
    "init_parallel", "ensure_parallel", "destroy_parallel", "parallel_device", "cuda_to_cpu",
    "build_transformer_config", "build_gpt_model", "causal_attention_mask", "unwrap_model", "free_port",
    "recompute_kwargs", "uses_sdpa_attention", "block_causal_mask",
]
