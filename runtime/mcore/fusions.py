"""Pure-PyTorch fusions for megatron-core's local layer spec on CUDA (no TransformerEngine, no apex).

Why: without TE megatron runs RoPE, SwiGLU and the residual add as chains of eager kernels. An H100
profile of one training step (128 x 768 tokens, Qwen3-0.6B shape, bf16) spent 7.8% of its
kernel time in ``CatArrayBatchedCopy`` alone (RoPE's ``_rotate_half`` cat and its final
``cat((t, t_pass))``, the unfused SwiGLU's backward), ~26% in small elementwise kernels and ~16% in
copies (part of them the ``repeat_interleave`` of K/V for GQA in ``SdpaCoreAttention``). The switches:

``rope``    megatron's ``apply_rotary_pos_emb`` calls the module global
            ``rope_utils.fused_apply_rotary_pos_emb`` when ``config.apply_rope_fusion`` is set (TE's
            kernel; None without TE). We install :func:`fused_apply_rotary_pos_emb` there: megatron's
            own ``_apply_rotary_pos_emb_bshd`` math, ``torch.compile``d into one kernel forward and one
            backward. Only for rotate-half RoPE: megatron's config refuses ``rotary_interleaved`` with
            ``apply_rope_fusion`` unless TE >= 2.3 is installed, so GLM4 keeps the unfused path. The
            fused path is only taken for the bshd layout with ``mscale == 1`` (megatron routes yarn's
            mscale elsewhere). Packed micro-batches (``thd``, ``train.max_tokens_per_micro_batch``) go
            to ``rope_utils.fused_apply_rotary_pos_emb_thd``: we install
            :func:`fused_apply_rotary_pos_emb_thd` there, the same kernel on angles gathered at each
            token's position within its own sample (positions restart at 0 per sample, as megatron's
            unfused ``_apply_rotary_pos_emb_thd`` does, without its per-sample loop and host sync).
            An installed TE kernel is left in place.
``swiglu``  ``bias_activation_fusion``: megatron's ``bias_swiglu_impl`` (``fusions/fused_bias_swiglu.py``,
            a ``torch.autograd.Function`` over ``jit_fuser`` = ``torch.compile``; pure PyTorch). It also
            saves only the fc1 output for the backward instead of the silu output besides it.
``bda``     ``bias_dropout_fusion``: megatron's ``bias_dropout_add_fused_train/inference`` (also
            ``torch.compile``, pure PyTorch). With no linear bias and dropout 0 (every model we build)
            the unfused path is already a single add kernel (``F.dropout`` with p=0 returns its input),
            so this is expected to be neutral; it is a switch so the benchmark can show it.
``gqa``     ``SdpaCoreAttention`` hands K/V with fewer heads to ``F.scaled_dot_product_attention(...,
            enable_gqa=True)`` (torch >= 2.5) instead of ``repeat_interleave``-ing them to every query
            head (a copy forward, a reduction backward, and the expanded K/V kept for the backward).
            torch's cuDNN backend (the one H100 picks; with ``enable_gqa`` since pytorch PRs 149976 and
            150337, spring 2025) and its flash backend both take it natively (``sdp_utils.cpp``:
            ``check_batch_size_and_num_heads_dense<supports_gqa=true>``); the memory-efficient
            backend only in recent torch. The value is read when the model is built.

``norm``    every ``torch.nn.RMSNorm`` of the model (the local spec's pre-norms, Qwen3's per-head q/k norms,
            GLM4's post-norms, the final norm) becomes :class:`CompiledRMSNorm`: torch's own RMSNorm math (fp32
            inside, weight multiplied in fp32, one cast; bitwise equal to ``F.rms_norm`` eagerly)
            ``torch.compile``d into one kernel forward and one backward. An H100 profile of a packed step
            with FA4's attention put ~9 % of its kernel time in torch's norm kernels (forward and input
            gradient) beside their weight-gradient reductions. Same parameters, so checkpoints load as before.

``train.fusions`` picks them (passed here as ``setting``): ``auto`` (all of them, the default), ``none``,
or a list of the names above (e.g. ``[rope, swiglu]``). CUDA only: on CPU nothing is switched on and nothing
is compiled, whatever the setting says, so CPU results (and CI) stay exactly as before.
"""
from __future__ import annotations

import warnings

import torch

from runtime.devices import is_out_of_memory

FUSIONS = ("rope", "swiglu", "bda", "gqa", "norm")


def active(device: str, setting: str | list | tuple = "auto") -> tuple[str, ...]:
    """The fusions switched on for ``device`` ("cpu" -> none; "cuda" -> per ``setting``, ``train.fusions``)."""
    if str(device) != "cuda" and not str(device).startswith("cuda:"):
        return ()
    if isinstance(setting, str):
        name = setting.strip().lower()
        if name in ("auto", "all"):
            return FUSIONS
        if name == "none":
            return ()
        raise ValueError(f"fusions: unknown setting {setting!r}; use 'auto', 'none' or a list of {FUSIONS}")
    unknown = sorted(set(setting) - set(FUSIONS))
    if unknown:
        raise ValueError(f"fusions: unknown fusion(s) {unknown}; use 'auto', 'none' or a list of {FUSIONS}")
    return tuple(f for f in FUSIONS if f in setting)


# ---- RoPE ---------------------------------------------------------------------------------------

def apply_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False, rotate=None) -> torch.Tensor:
    """megatron-core 0.16's ``_apply_rotary_pos_emb_bshd(t, freqs, interleaved)`` for ``mscale == 1``
    and no multi-latent attention, op for op (the same casts, the same order of multiply and add), so
    eager it is bitwise equal; the one difference: no final ``cat`` with an empty pass-through part
    when the rotary dim is the whole head (``rot_dim < head_dim`` still appends the unrotated rest).

    t: [s, b, h, d]; freqs: [s, 1, 1, rot_dim] (fp32 angles, what megatron's RotaryEmbedding returns).
    cos/sin are taken here, on the [s, 1, 1, rot_dim] angles: inside a compiled kernel they would be
    recomputed for every element of ``t`` (measured on the H100: 5x the time of the memory traffic).
    ``rotate``: the function doing the rest (:func:`_rotate`, or its compiled form).
    """
    cos_ = torch.cos(freqs).to(t.dtype)
    sin_ = torch.sin(freqs).to(t.dtype)
    return (rotate or _rotate)(t, cos_, sin_, interleaved)


def _rotate(t: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor, interleaved: bool) -> torch.Tensor:
    rot_dim = cos_.shape[-1]
    whole = rot_dim == t.shape[-1]
    x = t if whole else t[..., :rot_dim]
    if interleaved:  # megatron's _rotate_half(x, True): [-x2, x1] per adjacent pair
        x1, x2 = x[..., ::2], x[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:            # megatron's _rotate_half(x, False): [-second half, first half]
        x1, x2 = torch.chunk(x, 2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    out = (x * cos_) + (rotated * sin_)
    return out if whole else torch.cat((out, t[..., rot_dim:]), dim=-1)


_ROPE: dict = {"compiled": None, "error": None}


def _compiled_rope():
    if _ROPE["compiled"] is None and _ROPE["error"] is None:
        # dynamic=True: q and k differ in heads, micro-batches and sequences in length; symbolic
        # sizes from the first call instead of a recompile per new shape, which would soon reach
        # dynamo's recompile limit (8 per function) and fall back to eager. What still recompiles
        # (measured with the CPU backend on the trainer's call sequence: 5 graphs in all): grad
        # mode (log-prob pass / training), a first call where two sizes happened to be equal
        # (dynamo's duck sizing, e.g. micro-batch 16 = 16 heads), a micro-batch of one.
        _ROPE["compiled"] = torch.compile(_rotate, dynamic=True, fullgraph=True)
    return _ROPE["compiled"]


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """What megatron calls as ``fused_apply_rotary_pos_emb(t, freqs, interleaved=...)``:
    :func:`apply_rope` compiled on CUDA tensors (eager elsewhere, or for good after a compile error)."""
    fn = _compiled_rope() if t.is_cuda else None
    if fn is None:
        return apply_rope(t, freqs, interleaved)
    try:
        return apply_rope(t, freqs, interleaved, rotate=fn)
    except Exception as e:  # noqa: BLE001 - a compiler failure: the same math eagerly, from now on
        if is_out_of_memory(e):  # also one the compiler wrapped: memory, not the compiler
            raise
        _ROPE["compiled"], _ROPE["error"] = None, f"{type(e).__name__}: {e}"[:500]
        warnings.warn(f"grpoflow fused RoPE: torch.compile failed, using eager RoPE ({_ROPE['error']})")
        return apply_rope(t, freqs, interleaved)


fused_apply_rotary_pos_emb._grpoflow = True  # type: ignore[attr-defined]


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each packed token's position within its own sample ([total] int64, on ``cu_seqlens``' device):
    0, 1, ..., n0-1, 0, 1, ..., n1-1, ... for ``cu_seqlens`` = [0, n0, n0+n1, ...]. No host sync."""
    idx = torch.arange(total, device=cu_seqlens.device)
    cu = cu_seqlens.to(torch.int64)
    sample = torch.searchsorted(cu[1:], idx, right=True)
    return idx - cu[sample]


# One forward hands every layer the same cu_seqlens and angle table: gather the packed angles once.
_PACKED_FREQS: dict = {"key": None, "freqs": None}


def _packed_freqs(cu_seqlens: torch.Tensor, freqs: torch.Tensor, total: int) -> torch.Tensor:
    key = _PACKED_FREQS["key"]
    if key is not None and key[0] is cu_seqlens and key[1] is freqs and key[2] == total:
        return _PACKED_FREQS["freqs"]
    packed = freqs[packed_positions(cu_seqlens, total)]  # [total, 1, 1, rot_dim]
    _PACKED_FREQS.update(key=(cu_seqlens, freqs, total), freqs=packed)
    return packed


def fused_apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                                   cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """What megatron calls as ``fused_apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_size, cp_rank)``
    for packed sequences: t [total, h, d]; freqs [max_seqlen, 1, 1, rot_dim]. Rotate-half RoPE at each
    token's position within its sample, through :func:`fused_apply_rotary_pos_emb`'s kernel."""
    if cp_size != 1:
        raise NotImplementedError("grpoflow's packed RoPE has no context parallelism")
    packed = _packed_freqs(cu_seqlens, freqs, t.shape[0])
    return fused_apply_rotary_pos_emb(t.unsqueeze(1), packed, interleaved=False).squeeze(1)


fused_apply_rotary_pos_emb_thd._grpoflow = True  # type: ignore[attr-defined]


def install_rope_fusion() -> str:
    """Put :func:`fused_apply_rotary_pos_emb` (and its packed ``thd`` form) into megatron's ``rope_utils``
    unless TE's is there. Returns which implementation megatron's fused path now calls: "grpoflow" or "te"."""
    from megatron.core.models.common.embeddings import rope_utils
    current = rope_utils.fused_apply_rotary_pos_emb
    if current is not None and not getattr(current, "_grpoflow", False):
        return "te"
    rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
    rope_utils.fused_apply_rotary_pos_emb_thd = fused_apply_rotary_pos_emb_thd
    return "grpoflow"


# ---- RMSNorm ------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm``'s math: mean of squares and the weight in fp32, one cast at the end."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm` and each row's reciprocal root mean square (fp32), kept for the backward."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * rstd * weight.float()).to(x.dtype), rstd


def _norm_grad_input(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """d(loss)/dx of :func:`rms_norm`: rstd * (w*g - x_hat * mean(w*g * x_hat)) over each row."""
    x_hat, wg = x.float() * rstd, grad.float() * weight.float()
    return (rstd * (wg - x_hat * (wg * x_hat).mean(-1, keepdim=True))).to(x.dtype)


def _norm_weight_terms(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """Each token's share of d(loss)/d(weight), fp32: summed over the tokens by torch, not by the compiled code."""
    return grad.float() * (x.float() * rstd)


class NormKernels:
    """The deterministic norm's compiled pieces. None of them reduces over the tokens: inductor sizes a reduction over
    a dynamic dimension (how many parts it is split into) from the token count of the call it was compiled on, and
    its graph cache hands that kernel to every process that traces the same graph, whatever token count they met
    first: which kernel a DP rank runs can depend on which rank compiled first. On 2 x H100 (2026-11-27, issue 37)
    two runs from empty caches differed in the gradients of 4 norm weights at step 0 (Adam's moments 1.5e-9 apart)
    while one process alone, run twice, was bitwise. Each row's own reductions run over the hidden size, whose
    kernel does not depend on the token count; inductor's deterministic mode keeps timing from choosing them."""

    def __init__(self, compile_fn):
        self.forward = compile_fn(_norm_forward)
        self.grad_input = compile_fn(_norm_grad_input)
        self.weight_terms = compile_fn(_norm_weight_terms)


class _NormWithWeightSumInTorch(torch.autograd.Function):
    """:func:`rms_norm` on rows [tokens, hidden] whose weight gradient is summed over the tokens by torch's own
    reduction: its order is a function of the shape alone, in every process."""

    @staticmethod
    def forward(ctx, x, weight, eps, kernels: NormKernels):
        y, rstd = kernels.forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.kernels = kernels
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        grad_x = ctx.kernels.grad_input(grad, x, weight, rstd) if ctx.needs_input_grad[0] else None
        grad_w = ctx.kernels.weight_terms(grad, x, rstd).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None


def deterministic_norm(compile_fn=None):
    """The norm as ``fn(rows, weight, eps)`` with its weight gradient summed by torch; ``compile_fn`` compiles each
    piece (default: inductor, dynamic, in its deterministic mode)."""
    compile_fn = compile_fn or (lambda fn: torch.compile(fn, dynamic=True, fullgraph=True,
                                                         options={"deterministic": True}))
    kernels = NormKernels(compile_fn)
    return lambda x, weight, eps: _NormWithWeightSumInTorch.apply(x, weight, eps, kernels)


_NORM: dict = {"compiled": {}, "error": None}


def _compiled_norm():
    """The compiled norm for the mode the caller runs in. Under ``train.deterministic`` (torch's deterministic mode,
    on while the trainer computes): :func:`deterministic_norm`, whose bits do not depend on which token count, in
    which process, compiled it. Outside it (an engine in the same process, train.deterministic off): the whole norm
    in one compiled graph."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    if deterministic not in _NORM["compiled"] and _NORM["error"] is None:
        # dynamic: one kernel for every token count (packed micro-batches change it at each call)
        _NORM["compiled"][deterministic] = (
            deterministic_norm() if deterministic else torch.compile(rms_norm, dynamic=True, fullgraph=True))
    return _NORM["compiled"].get(deterministic)


def rowwise(fn, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``fn`` (the compiled norm) on ``x`` as rows [tokens, hidden]: one graph for every layout. Megatron hands the
    first norm a [s, 1, h] view of the embeddings' [1, s, h] output, whose size-1 dim has stride s x h; torch 2.11's
    dynamo guarded on that stride, so each new token count compiled again, and past its limit (8) the norm ran
    eagerly for the shapes it had not compiled: which ones depended on the process's history. On an H100
    (2026-11-26, deterministic kernels on) an update rerun in the same process was bitwise equal, the same update in
    a fresh process that loaded the same checkpoint was not (1.4e-4). As rows the input's strides are fixed (the
    reshape is a view here), so every process runs the same graph."""
    return fn(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


class CompiledRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose forward is :func:`rms_norm` compiled on CUDA tensors (eager elsewhere, or for
    good after a compile error)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        fn = _compiled_norm() if x.is_cuda else None
        if fn is not None:
            try:
                return rowwise(fn, x, self.weight, eps)
            except Exception as e:  # noqa: BLE001 - a compiler failure: the same math eagerly, from now on
                _NORM["compiled"], _NORM["error"] = {}, f"{type(e).__name__}: {e}"[:500]
                warnings.warn(f"grpoflow fused RMSNorm: torch.compile failed, using eager ({_NORM['error']})")
        return rms_norm(x, self.weight, eps)


def use_compiled_norms(model: torch.nn.Module, on: bool = True) -> int:
    """Every ``torch.nn.RMSNorm`` of ``model`` switched to :class:`CompiledRMSNorm` (``on``) or back, in place;
    returns how many. Only the class changes: parameters, state dict and hooks stay."""
    n = 0
    for m in model.modules():
        if isinstance(m, torch.nn.RMSNorm) and m.elementwise_affine:
            m.__class__ = CompiledRMSNorm if on else torch.nn.RMSNorm
            n += 1
    return n


# ---- the config --------------------------------------------------------------------------------

def config_kwargs(device: str, arch: dict, setting: str | list | tuple = "auto") -> dict:
    """The ``TransformerConfig`` fusion fields for ``device`` given the family's architecture kwargs
    (``arch``: activation, gated linear unit, rotary_interleaved) and ``setting`` (``train.fusions``).
    All False on CPU."""
    import torch.nn.functional as F

    on = active(device, setting)
    swiglu_ok = arch.get("gated_linear_unit", False) and arch.get("activation_func") is F.silu \
        and not arch.get("use_te_activation_func", False)
    rope = "rope" in on and not arch.get("rotary_interleaved", False)
    if rope:
        install_rope_fusion()  # megatron's config checks the global at construction
    return dict(apply_rope_fusion=rope, bias_activation_fusion="swiglu" in on and bool(swiglu_ok),
                bias_dropout_fusion="bda" in on)


def sdpa_supports_gqa() -> bool:
    """``F.scaled_dot_product_attention(..., enable_gqa=True)`` exists (torch >= 2.5)."""
    return torch.__version__ >= "2.5"


def report(model) -> dict:
    """What the built model actually runs (for benchmark records): per fusion, whether it is on (read
    from the model's config and core attention, not from the setting)."""
    while hasattr(model, "module"):
        model = model.module
    cfg = model.config
    out = {"rope": False, "swiglu": bool(cfg.bias_activation_fusion),
           "bda": bool(cfg.bias_dropout_fusion), "gqa": None,
           "norm": any(isinstance(m, CompiledRMSNorm) for m in model.modules())}
    if _NORM["error"]:
        out["norm_compile_error"] = _NORM["error"]
    if cfg.apply_rope_fusion:
        from megatron.core.models.common.embeddings import rope_utils
        fn = rope_utils.fused_apply_rotary_pos_emb
        out["rope"] = ("grpoflow-eager-fallback" if _ROPE["error"] else "grpoflow-compiled") \
            if getattr(fn, "_grpoflow", False) else "te"
        if _ROPE["error"]:
            out["rope_compile_error"] = _ROPE["error"]
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    if layers:
        core = layers[0].self_attention.core_attention
        out["gqa"] = getattr(core, "native_gqa", None)
    return out


__all__ = ["FUSIONS", "active", "apply_rope", "fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_thd",
           "packed_positions", "install_rope_fusion", "rms_norm", "deterministic_norm", "CompiledRMSNorm", "use_compiled_norms",
           "config_kwargs", "sdpa_supports_gqa", "report"]
