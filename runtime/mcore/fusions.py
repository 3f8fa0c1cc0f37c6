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
            mscale and packed ``thd`` sequences elsewhere; ``thd`` with the fusion on would assert:
            we never pass ``packed_seq_params``). An installed TE kernel is left in place.
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

``GRPOFLOW_TRAINER_FUSIONS`` picks them: ``all`` (the default), ``none``, or a comma list of the names
above (e.g. ``rope,swiglu``). CUDA only: on CPU nothing is switched on and nothing is compiled,
whatever the variable says, so CPU results (and CI) stay exactly as before.
"""
from __future__ import annotations

import os
import warnings

import torch

ENV = "GRPOFLOW_TRAINER_FUSIONS"
FUSIONS = ("rope", "swiglu", "bda", "gqa")


def active(device: str) -> tuple[str, ...]:
    """The fusions switched on for ``device`` ("cpu" -> none; "cuda" -> per $GRPOFLOW_TRAINER_FUSIONS)."""
    if str(device) != "cuda" and not str(device).startswith("cuda:"):
        return ()
    raw = os.environ.get(ENV)
    if raw is None or raw.strip().lower() == "all":
        return FUSIONS
    raw = raw.strip().lower()
    if raw in ("", "none", "0", "off", "false"):
        return ()
    names = [x.strip() for x in raw.split(",") if x.strip()]
    unknown = sorted(set(names) - set(FUSIONS))
    if unknown:
        raise ValueError(f"{ENV}: unknown fusion(s) {unknown}; use 'all', 'none' or a comma list of {FUSIONS}")
    return tuple(f for f in FUSIONS if f in names)


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
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a compiler failure: the same math eagerly, from now on
        _ROPE["compiled"], _ROPE["error"] = None, f"{type(e).__name__}: {e}"[:500]
        warnings.warn(f"grpoflow fused RoPE: torch.compile failed, using eager RoPE ({_ROPE['error']})")
        return apply_rope(t, freqs, interleaved)


fused_apply_rotary_pos_emb._grpoflow = True  # type: ignore[attr-defined]


def install_rope_fusion() -> str:
    """Put :func:`fused_apply_rotary_pos_emb` into megatron's ``rope_utils`` unless TE's is there.
    Returns which implementation megatron's fused path now calls: "grpoflow" or "te"."""
    from megatron.core.models.common.embeddings import rope_utils
    current = rope_utils.fused_apply_rotary_pos_emb
    if current is not None and not getattr(current, "_grpoflow", False):
        return "te"
    rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
    return "grpoflow"


# ---- the config --------------------------------------------------------------------------------

def config_kwargs(device: str, arch: dict) -> dict:
    """The ``TransformerConfig`` fusion fields for ``device`` given the family's architecture kwargs
    (``arch``: activation, gated linear unit, rotary_interleaved). All False on CPU."""
    import torch.nn.functional as F

    on = active(device)
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
    """What the built model actually runs (for benchmark records): the env value and, per fusion,
    whether it is on (read from the model's config and core attention, not from the env)."""
    while hasattr(model, "module"):
        model = model.module
    cfg = model.config
    out = {"env": os.environ.get(ENV), "rope": False, "swiglu": bool(cfg.bias_activation_fusion),
           "bda": bool(cfg.bias_dropout_fusion), "gqa": None}
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


__all__ = ["ENV", "FUSIONS", "active", "apply_rope", "fused_apply_rotary_pos_emb", "install_rope_fusion",
           "config_kwargs", "sdpa_supports_gqa", "report"]
