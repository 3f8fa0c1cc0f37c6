"""The HF model's forward as pure functions over fused weights: what the engine's decoders run.

`FusedModel` takes a Qwen3 / Qwen2 / LLaMA / GLM4-family HF causal LM and binds its weights (no HF
forward): q/k/v and gate/up are fused into one buffer each and the HF parameters re-pointed to views of them,
so the engine's `update_weights` (which copies into `model.state_dict()` tensors) updates the
decoder in place and captured CUDA graphs stay valid. The per-layer pieces (norm + fused QKV +
q/k-norm + RoPE; o-proj + residual + norm + fused gate/up + SwiGLU + down) go through torch.compile
on CUDA (dynamic shapes: one compile serves prefill and every decode batch size; a failure inside a compiled
piece is raised as the "compile" feature's, `speed_features`). They are compiled on a shape of their own before
any real call (`settle_compiled`): Inductor picks a reduction's blocks and warps from the sizes it compiles on, so a
piece compiled on whatever call came first would give other bits to the same call in an engine whose first call was
another (a rebuilt engine against the one it replaces). GLM4 differs in three
places, each a setting of the same pieces: RoPE on the first `partial_rotary_factor` of each head with
interleaved pairs, a norm after the attention and after the MLP (before each residual add), and q/k/v
biases (which Qwen2 has too). Qwen3-MoE's MLP is a mixture of experts (`_routed_experts`: top-k routing and
grouped GEMMs over transformers' fused expert weights).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from runtime.devices import is_out_of_memory
from runtime.rollout.base import routes_dtype
from runtime.rollout.fp8_weights import (WEIGHTS_DTYPES, fp8_linear, fp8_shape_reason, fp8_swiglu_linear,
                                         quantize_activation_rows, quantize_rows, quantize_rows_into, scaled_product)
from runtime.rollout.keyed_sampling import compiled_gumbel_noise, gumbel_noise, sample_next, uniform_noise
from runtime.rollout.speed_features import guarded
from runtime.rollout.lora_forward import EngineAdapters, add_lora

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "glm4", "qwen3_moe")


def unsupported_config_reason(cfg) -> str | None:
    """None when an HF config's architecture fits the fast path, else why not (one line). The memory
    estimate (runtime/plan/memory.py) uses it to know which decode path the engine will take."""
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        return f"model_type {mt!r} is not one of {SUPPORTED_MODEL_TYPES}"
    rp = getattr(cfg, "rope_parameters", None)
    rope_type = (rp or {}).get("rope_type", "default") if isinstance(rp, dict) else "default"
    if rope_type != "default":
        return f"rope_type {rope_type!r} (only the default RoPE is implemented)"
    if getattr(cfg, "use_sliding_window", False) or any(
            t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window layers are not implemented"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    if getattr(cfg, "mlp_bias", False):
        return "mlp_bias is not implemented"
    if mt == "qwen3_moe" and (int(getattr(cfg, "decoder_sparse_step", 1) or 1) != 1 or getattr(cfg, "mlp_only_layers", None)):
        return "dense MLP layers between the MoE layers (decoder_sparse_step, mlp_only_layers) are not implemented"
    return None


def unsupported_reason(model) -> str | None:
    """None when `model` (an HF causal LM) fits the fast path, else why not (one line)."""
    reason = unsupported_config_reason(model.config)
    if reason:
        return reason
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(getattr(inner, "rotary_emb", None), "inv_freq"):
        return "unexpected module layout (model.model.layers / rotary_emb.inv_freq)"
    return None


# ---- the math (pure functions; compiled on CUDA) ---------------------------------------------------------

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # exactly HF's Qwen3RMSNorm / LlamaRMSNorm
    dt = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dt)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., d:], x[..., :d]), dim=-1) * sin


def _rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # GLM4's: pairs (0, 1), (2, 3), ... of the first cos.shape[-1] dims rotate; the rest pass through
    rot = cos.shape[-1]
    xr = x[..., :rot]
    turned = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat((xr * cos + turned * sin, x[..., rot:]), dim=-1)


def _linear(x, w, w_scales, b=None):
    """A projection: bf16 (``w_scales`` None) or FP8 (``w`` e4m3 with a scale per output row: fp8_weights.py)."""
    return F.linear(x, w, b) if w_scales is None else fp8_linear(x, w, w_scales, b)


def _pre_attn(h, ln_w, qkv_w, qkv_b, qn_w, kn_w, cos, sin, eps: float, nh: int, nkv: int, hd: int,
              interleaved: bool = False, grouped: bool = False, qkv_s=None, qkv_a=None, qkv_lb=None,
              lscale: float = 1.0):
    """[T, H] -> q [T, nh, hd], k, v [T, nkv, hd] (RoPE applied). ``grouped``: the fused qkv's rows are megatron's
    per-group order ([the group's q heads, its k, its v] per key-value group; a base shared with the trainer),
    else HF's (all q, all k, all v). ``qkv_s``: the FP8 weight's scales (None: bf16). ``qkv_a``/``qkv_lb``: a LoRA
    adapter on the projection (runtime/rollout/lora_forward.py), in the activation dtype beside an FP8 base."""
    x = _rms(h, ln_w, eps)
    qkv = add_lora(_linear(x, qkv_w, qkv_s, qkv_b), x, qkv_a, qkv_lb, lscale)
    if grouped:  # a reshape of the projection's output: q heads come out in HF's order (group-major)
        per = nh // nkv
        g = qkv.view(-1, nkv, per + 2, hd)
        q, k, v = g[:, :, :per].reshape(-1, nh, hd), g[:, :, per], g[:, :, per + 1]
    else:
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = q.reshape(-1, nh, hd)
        k = k.reshape(-1, nkv, hd)
    if qn_w is not None:
        q = _rms(q, qn_w, eps)
        k = _rms(k, kn_w, eps)
    rope = _rope_interleaved if interleaved else _rope
    return rope(q, cos, sin), rope(k, cos, sin), v.reshape(-1, nkv, hd).contiguous()


def _post_attn(h, attn, o_w, o_b, ln_w, gu_w, down_w, pa_w, pm_w, eps: float, ffn: int,
               o_s=None, gu_s=None, dn_s=None, o_a=None, o_lb=None, gu_a=None, gu_lb=None, dn_a=None, dn_lb=None,
               lscale: float = 1.0):
    """o-proj, residual, norm, SwiGLU MLP, residual; `pa_w` / `pm_w` (GLM4): norms of the attention's and
    the MLP's output before each residual add (None: none); `*_s`: the FP8 weights' scales of the o, gate/up and
    down projections (None: bf16); `*_a`/`*_lb`: their LoRA adapters (None: none)."""
    a = add_lora(_linear(attn, o_w, o_s, o_b), attn, o_a, o_lb, lscale)
    h = h + (a if pa_w is None else _rms(a, pa_w, eps))
    x = _rms(h, ln_w, eps)
    gu = add_lora(_linear(x, gu_w, gu_s), x, gu_a, gu_lb, lscale)
    if dn_s is not None and dn_a is None:  # FP8 down: the activation made and quantised in one pass
        m = fp8_swiglu_linear(gu, ffn, down_w, dn_s)
    else:
        g, u = gu.split([ffn, ffn], dim=-1)
        act = F.silu(g) * u
        m = add_lora(_linear(act, down_w, dn_s), act, dn_a, dn_lb, lscale)
    return h + (m if pm_w is None else _rms(m, pm_w, eps))


def _grouped_mm(x, w, offs):
    """Rows ``offs[e-1]:offs[e]`` of ``x`` times ``w[e]``: one grouped GEMM (any dtype on the CPU, bf16 on CUDA), else
    a loop over the experts (CUDA in another dtype; it reads the offsets on the host)."""
    if not x.is_cuda or x.dtype == torch.bfloat16:
        return F.grouped_mm(x, w, offs=offs)
    ends = offs.tolist()  # rows past the last group (a shard's copies routed elsewhere) come out zero
    return torch.cat([x[s:e] @ w[i] for i, (s, e) in enumerate(zip([0] + ends[:-1], ends))]
                     + [x.new_zeros(x.shape[0] - ends[-1], w.shape[-1])])


def _fp8_grouped_mm(x, w8, w_scales, offs):
    """`_grouped_mm` with FP8 experts: ``w8`` [E, N, K] e4m3 with a scale per (expert, output row) (``w_scales``
    [E, N]), ``x`` quantised per row on the way in (fp8_weights.py). On CUDA one `torch._scaled_grouped_mm` (sm90's
    rowwise grouped kernel: scales [rows] and [E, N], offsets on the device); on the CPU, which has no grouped kernel,
    the scaled product per expert (it reads the offsets on the host)."""
    xq, xs = quantize_activation_rows(x)
    if x.is_cuda:
        return torch._scaled_grouped_mm(xq, w8.transpose(-2, -1), xs[:, 0], w_scales, offs=offs, out_dtype=x.dtype)
    ends = offs.tolist()
    return torch.cat([scaled_product(xq[s:e], xs[s:e], w8[i], w_scales[i][None], x.dtype) if e > s
                      else x.new_zeros(0, w8.shape[1])
                      for i, (s, e) in enumerate(zip([0] + ends[:-1], ends))]
                     + [x.new_zeros(x.shape[0] - ends[-1], w8.shape[1])])


def _route(x, router_w, topk: int, norm_topk: bool):
    """HF's Qwen3-MoE routing of [T, H]: (weights [T, k] fp32, experts [T, k]): softmax over every expert in fp32, the
    top-k, renormalised to sum 1 when ``norm_topk``; the router's linear in fp32, as the trainer's megatron router."""
    probs = F.linear(x.float(), router_w.float()).softmax(dim=-1)
    weights, experts = probs.topk(topk, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _experts_mlp(x, weights, experts, gu_w, down_w, ffn: int, gu_s=None, dn_s=None, first: int | None = None):
    """The experts' SwiGLU on [T, H] routed to ``experts`` [T, k] with ``weights``: two grouped GEMMs over the routed
    copies sorted by expert (``gu_w`` [E, 2F, H] = cat(gate, up), ``down_w`` [E, H, F]: transformers' fused layout;
    with ``gu_s`` / ``dn_s`` [E, rows] they are e4m3, `_fp8_grouped_mm`). No host sync on CUDA, no atomics: each
    copy's output goes back to its (token, slot) and a token's k slots are summed in slot order.
    ``first`` (an engine holding one shard of the experts, runtime/rollout/expert_shards.py): ``gu_w`` and ``down_w``
    are global experts ``first ..`` only; the copies routed elsewhere sort last, past the grouped GEMMs' last group,
    and count zero: the result is this shard's part of the sum."""
    t, h = x.shape
    topk = experts.shape[1]
    flat = experts.reshape(-1)
    mine = None
    if first is not None:
        local = flat - first
        mine = (local >= 0) & (local < gu_w.shape[0])
        flat = torch.where(mine, local, gu_w.shape[0])  # the others: one group past the last expert
    order = flat.argsort(stable=True)  # the routed copies grouped by expert
    # each group's end: a search of the sorted experts. bincount reads its largest index on the host (torch.compile
    # breaks its graph there and runs it eager), which a CUDA graph's capture refuses
    bounds = torch.arange(1, gu_w.shape[0] + 1, device=flat.device, dtype=flat.dtype)
    offs = torch.searchsorted(flat.index_select(0, order), bounds).to(torch.int32)
    xs = x.index_select(0, order // topk)
    if gu_s is None:
        gu = _grouped_mm(xs, gu_w.transpose(-2, -1), offs)
        g, u = gu.split([ffn, ffn], dim=-1)
        y = _grouped_mm(F.silu(g) * u, down_w.transpose(-2, -1), offs)
    else:
        g, u = _fp8_grouped_mm(xs, gu_w, gu_s, offs).split([ffn, ffn], dim=-1)
        y = _fp8_grouped_mm(F.silu(g) * u, down_w, dn_s, offs)
    y = y * weights.to(x.dtype).reshape(-1).index_select(0, order)[:, None]
    if mine is not None:  # the rows past the last group hold whatever the GEMM left there: selected away, not scaled
        y = torch.where(mine.index_select(0, order)[:, None], y, 0)
    slots = torch.empty_like(y).index_copy_(0, order, y)
    return slots.view(t, topk, h).sum(dim=1)


def _routed_experts(x, router_w, gu_w, down_w, ffn: int, topk: int, norm_topk: bool):
    """A mixture of experts' MLP on [T, H]: `_route`, then `_experts_mlp`."""
    weights, experts = _route(x, router_w, topk, norm_topk)
    return _experts_mlp(x, weights, experts, gu_w, down_w, ffn)


def _post_attn_moe(h, attn, o_w, o_b, ln_w, gu_w, down_w, router_w, eps: float, ffn: int, topk: int,
                   norm_topk: bool, o_s=None, gu_s=None, dn_s=None):
    """`_post_attn` with a mixture of experts for the MLP (Qwen3-MoE: no post-norms, no LoRA); also returns each
    token's experts [T, k] (what rollout.routing_replay records). ``*_s``: FP8 weights' scales (the router stays in
    the model's dtype: it picks the experts, and its scores are fp32)."""
    h, moe, experts = _post_attn_moe_parts(h, attn, o_w, o_b, ln_w, gu_w, down_w, router_w, eps, ffn, topk, norm_topk,
                                           None, o_s, gu_s, dn_s)
    return h + moe, experts


def _post_attn_moe_parts(h, attn, o_w, o_b, ln_w, gu_w, down_w, router_w, eps: float, ffn: int, topk: int,
                         norm_topk: bool, first: int | None, o_s=None, gu_s=None, dn_s=None):
    """`_post_attn_moe` before its last residual add: (the hidden states after the attention's residual, the experts'
    output, each token's experts); with ``first`` (one shard of the experts, global ``first ..``) that shard's part of
    the experts' output, which the caller adds up over the shards."""
    h = h + _linear(attn, o_w, o_s, o_b)
    x = _rms(h, ln_w, eps)
    weights, experts = _route(x, router_w, topk, norm_topk)
    return h, _experts_mlp(x, weights, experts, gu_w, down_w, ffn, gu_s, dn_s, first), experts


def _logits(h, norm_w, lm_w, eps: float):
    return F.linear(_rms(h, norm_w, eps), lm_w)


def _cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype, interleaved: bool = False):
    # exactly HF's rotary embedding: fp32 angles, cos/sin scaled, cast to the activation dtype; GLM4 takes
    # each angle twice in a row (its pairs are interleaved), over its rotary dims only
    f = pos.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = f.repeat_interleave(2, dim=-1) if interleaved else torch.cat((f, f), dim=-1)
    return (emb.cos() * scale).to(dtype)[:, None, :], (emb.sin() * scale).to(dtype)[:, None, :]


def plain_sample(logits: torch.Tensor, key_hash: torch.Tensor, position: torch.Tensor, temperature: float):
    """`sample_next` without top-k/top-p (temperature > 0), as one compilable function."""
    scaled = logits.to(torch.float32) / temperature
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    tokens = torch.argmax(scaled + gumbel_noise(key_hash, position, scaled.shape[-1]), dim=-1)
    return tokens, logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)


# ---- attention ----------------------------------------------------------------------------------------

def _flash(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float, seqused_k=None):
    kw = {"scale": scale}
    if seqused_k is not None:
        kw["seqused_k"] = seqused_k
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, **kw)[0]


def _sdpa_prefill(q, k, v, lens: list[int], scale: float):
    out, start = [], 0
    rep = q.shape[1] // k.shape[1]
    for n in lens:
        qi = q[start:start + n].transpose(0, 1)[None]
        ki = k[start:start + n].transpose(0, 1).repeat_interleave(rep, 0)[None]
        vi = v[start:start + n].transpose(0, 1).repeat_interleave(rep, 0)[None]
        out.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)[0].transpose(0, 1))
        start += n
    return torch.cat(out, 0)


SETTLE_TOKENS = 2048  # the token count the per-layer pieces are compiled on (`FusedModel.settle_compiled`)


def settled_shapes():
    """Dynamo without duck sizing, for a compile on `settle_compiled`'s shape: with it, a token count equal to one of
    the weights' sizes (a prefill of exactly nh * hd tokens) would be taken for that size and fixed in the graph."""
    import torch.fx.experimental._config as fx_config
    return fx_config.patch(use_duck_shape=False)


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    qn: torch.Tensor | None
    kn: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    ln2: torch.Tensor
    gu_w: torch.Tensor
    down_w: torch.Tensor
    pa: torch.Tensor | None = None  # GLM4's norm after the attention
    pm: torch.Tensor | None = None  # and after the MLP
    pre_lora: tuple = (None, None)  # LoRA (A, B) of the qkv projection
    post_lora: tuple = (None,) * 6  # of the o, gate/up and down projections
    # FP8 weights (rollout.weights_dtype: fp8): the scales [1, out] of qkv_w, o_w, gu_w, down_w (then e4m3)
    qkv_s: torch.Tensor | None = None
    o_s: torch.Tensor | None = None
    gu_s: torch.Tensor | None = None
    down_s: torch.Tensor | None = None

    router: torch.Tensor | None = None  # a mixture of experts: gu_w [E, 2F, H] and down_w [E, H, F] then

    @property
    def post_scales(self) -> tuple:
        return self.o_s, self.gu_s, self.down_s

    def post_args(self) -> tuple:
        """The weights `FusedModel._post` takes after the hidden states and the attention output."""
        if self.router is not None:
            return self.o_w, self.o_b, self.ln2, self.gu_w, self.down_w, self.router, *self.post_scales
        return self.o_w, self.o_b, self.ln2, self.gu_w, self.down_w, self.pa, self.pm, *self.post_scales, *self.post_lora


# the engine's linear layers by their _Layer field; embeddings, the head and the norms stay in the model's dtype
_LINEARS = (("qkv_w", "qkv_s"), ("o_w", "o_s"), ("gu_w", "gu_s"), ("down_w", "down_s"))


def _fuse(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """cat along dim 0, then make each parameter a view of its rows (in-place weight updates reach the fused copy)."""
    fused = torch.cat([p.data for p in params], dim=0).contiguous()
    start = 0
    for p in params:
        n = p.shape[0]
        p.data = fused[start:start + n]
        start += n
    return fused



class FusedModel:
    """The model's sizes and fused weights, and the (optionally compiled) forward pieces over them.

    ``shared_base`` (LoRA, the trainer in this process at TP 1): the trainer's frozen megatron tensors by
    state-dict name, used as they are (``model`` is then only the HF skeleton, on the meta device: config and
    sizes). Their fused qkv is megatron's per-group row order, and the forward splits the projection's output
    per group (``grouped``) instead of reordering the weight: a [q; k; v] copy would be a second copy of those
    weights, and HF-order views of the grouped rows do not exist (a group's q rows are not contiguous with the
    next group's). fc1 is cat(gate, up), the engine's gate/up order already. An engine with a base of its own
    keeps HF's order: its HF modules (``logprobs_of`` on the HF path, ``update_weights`` by HF name) are views
    of row ranges of its fused buffers, which only that order allows.
    ``lora`` (``train.lora``): the adapters' buffers (runtime/rollout/lora_forward.py), added in the forward.
    ``weights_dtype`` (``rollout.weights_dtype``): "fp8" quantises the linear layers (q/k/v, o, gate/up, down) to
    rowwise e4m3 (runtime/rollout/fp8_weights.py) at build, into buffers of their own that `load_linear` updates in
    place; the embeddings, the head and the norms stay in the model's dtype (a row lookup reads one row per token,
    the head's logits feed the sampler and the log-probs TIS compares, and both are a small share of a decode
    step's bytes at these shapes). An engine with a base of its own then drops its bf16 linears (``drop_bf16``;
    the HF modules keep shapes on the meta device), so its weights are half; a shared base (LoRA) is the
    trainer's and stays, the FP8 copy beside it, quantised once (frozen)."""

    def __init__(self, model, *, compile: bool | None = None, lora=None, shared_base: dict | None = None,
                 deterministic: bool = True, settle_rows: int = 64, weights_dtype: str = "bf16",
                 drop_bf16: bool = True, record_routes: bool = False, true_on_policy: bool = False,
                 expert_shard=None):
        reason = unsupported_config_reason(model.config) if shared_base is not None else unsupported_reason(model)
        if reason:
            raise ValueError(f"fast decode path: {reason}")
        if weights_dtype not in WEIGHTS_DTYPES:
            raise ValueError(f"rollout.weights_dtype must be one of {WEIGHTS_DTYPES}, got {weights_dtype!r}")
        self.model = model
        cfg = model.config
        p = shared_base["embedding.word_embeddings.weight"] if shared_base is not None else next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        cuda = self.device.type == "cuda"
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # a mixture of experts (Qwen3-MoE): each expert's ffn, the experts a token is routed to, renormalised or not
        self.moe = cfg.model_type == "qwen3_moe"
        self.ffn = cfg.moe_intermediate_size if self.moe else cfg.intermediate_size
        self.topk = int(cfg.num_experts_per_tok) if self.moe else 0
        self.norm_topk = bool(getattr(cfg, "norm_topk_prob", False))
        # rollout.routing_replay: the decoder keeps each token's experts per layer (`_layer_post`), one byte an
        # index up to 256 experts; a dense model has nothing to record
        self.record_routes = bool(record_routes) and self.moe
        self.routes_dtype = routes_dtype(int(cfg.num_experts)) if self.moe else None
        # rollout.expert_shards: this engine holds one shard of the experts (runtime/rollout/expert_shards.py); each
        # MoE layer's output is the replica's sum of the shards' parts
        self.expert_shard = expert_shard if self.moe else None
        if self.moe and (lora is not None or shared_base is not None):
            raise ValueError("fast decode path: LoRA on a mixture of experts is not implemented")
        self.eps = float(cfg.rms_norm_eps)
        self.scale = self.hd ** -0.5
        self.n_layers = cfg.num_hidden_layers
        # rollout.true_on_policy: the batch-invariant pieces the trainer runs too (runtime/kernels/batch_invariant.py),
        # eager (a compiled piece may fuse the norm with its neighbours and drop the roundings between them)
        self.true_on_policy = bool(true_on_policy)
        if self.true_on_policy:
            why = "a mixture of experts" if self.moe else "FP8 weights" if weights_dtype != "bf16" else None
            if why:
                raise ValueError(f"rollout.true_on_policy: {why} is out of scope (issue 61); set "
                                 f"rollout.true_on_policy: false")
        self.compiled = (cuda if compile is None else bool(compile)) and not self.true_on_policy
        # the rows the head and the samplers are compiled on (`settle_compiled`): a decode step's most
        self.settle_rows = max(int(settle_rows), 2)  # 0 and 1 would be fixed in the graph
        self._settled: set = set()
        # inductor's deterministic mode: one configuration per kernel, none timed (rollout.deterministic)
        self.compile_options = {"deterministic": True} if deterministic else None
        inner = model.model
        # the skeleton of a shared base is on the meta device: its RoPE tables are made again on the host
        rotary = inner.rotary_emb if shared_base is None else type(inner.rotary_emb)(cfg)
        self.inv_freq = rotary.inv_freq.to(self.device, torch.float32)
        if self.true_on_policy:  # the host's table, the trainer's too (megatron computes its own on the GPU)
            from runtime.kernels.batch_invariant import rope_inv_freq
            from runtime.models.base import rope_parameters
            self.inv_freq = rope_inv_freq(rope_parameters(cfg)["rope_theta"], 2 * self.inv_freq.numel()).to(self.device)
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        # the engine's own weights, or (a shared base) the trainer's it decodes with: named when memory runs out
        self.weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
        self.interleaved = cfg.model_type == "glm4"
        self.qkv_grouped = shared_base is not None
        self._hf_linears: list[dict] = []  # per layer: the HF parameters whose rows make each fused linear
        if shared_base is not None:
            self._bind_shared(shared_base, cfg)
        else:
            self._bind_hf(model)
        self.weights_dtype = weights_dtype
        # HF name -> (e4m3 rows, their scales) in the fused FP8 buffers (`load_linear`); empty with bf16
        self.fp8_targets: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if weights_dtype == "fp8":
            self._quantize_linears(drop_bf16 and shared_base is None)
        self.vocab = int(self.lm.shape[0])
        self.adapters: EngineAdapters | None = None
        self.lora_scale = 1.0
        if lora is not None:
            self.adapters = EngineAdapters(lora, n_layers=self.n_layers, hidden=cfg.hidden_size, heads=self.nh,
                                           kv_heads=self.nkv, head_dim=self.hd, ffn=self.ffn, device=self.device,
                                           dtype=self.dtype, qkv_grouped=self.qkv_grouped)
            self.lora_scale = self.adapters.scale
            for i, w in enumerate(self.layers):
                ad = self.adapters
                w.pre_lora = ad.pair(i, "linear_qkv")
                w.post_lora = (*ad.pair(i, "linear_proj"), *ad.pair(i, "linear_fc1"), *ad.pair(i, "linear_fc2"))
        self._eager_fns()
        self.compile_error: str | None = None
        if self.compiled:
            try:
                from torch import _dynamo
                _dynamo.config.cache_size_limit = max(_dynamo.config.cache_size_limit, 64)
                uniform_noise(torch.zeros(1, dtype=torch.long, device=self.device),
                              torch.zeros(1, dtype=torch.long, device=self.device), self.vocab)  # counters cached
                # torch.compile compiles at a piece's first call: what fails there is the compiler's
                def compiled(fn):
                    return guarded("compile", torch.compile(fn, dynamic=True, options=self.compile_options))
                self._pre, self._post, self._head = compiled(self._pre), compiled(self._post), compiled(self._head)
                self._plain = compiled(plain_sample)
                self._gumbel = guarded("compile", compiled_gumbel_noise())
            except Exception as e:  # noqa: BLE001 - no compiler: eager is correct, only slower
                if is_out_of_memory(e):
                    raise
                self.compile_error = f"{type(e).__name__}: {e}"
                self.compiled = False
                self._eager_fns()

    def _bind_hf(self, model) -> None:
        """The HF model's weights: q/k/v and gate/up fused (its parameters re-pointed into the fused buffers)."""
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm = model.get_output_embeddings().weight
        self.layers = []
        with torch.no_grad():
            for layer in inner.layers:
                a, m = layer.self_attn, layer.mlp
                qkv_b = _fuse([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None
                router = None
                if self.moe:  # transformers' fused experts, as they are
                    router, gate_up, down = m.gate.weight, m.experts.gate_up_proj, m.experts.down_proj
                    self._hf_linears.append({"qkv_w": [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight],
                                             "o_w": [a.o_proj.weight], "gu_w": [gate_up], "down_w": [down]})
                else:
                    gate_up = m.gate_up_proj.weight if hasattr(m, "gate_up_proj") else \
                        _fuse([m.gate_proj.weight, m.up_proj.weight])
                    down = m.down_proj.weight
                    self._hf_linears.append({
                        "qkv_w": [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], "o_w": [a.o_proj.weight],
                        "gu_w": [m.gate_up_proj.weight] if hasattr(m, "gate_up_proj") else [m.gate_proj.weight,
                                                                                            m.up_proj.weight],
                        "down_w": [m.down_proj.weight]})
                self.layers.append(_Layer(
                    ln1=layer.input_layernorm.weight, qkv_w=_fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                    qkv_b=qkv_b, qn=getattr(getattr(a, "q_norm", None), "weight", None),
                    kn=getattr(getattr(a, "k_norm", None), "weight", None), o_w=a.o_proj.weight, o_b=a.o_proj.bias,
                    ln2=layer.post_attention_layernorm.weight, gu_w=gate_up, down_w=down,
                    pa=getattr(getattr(layer, "post_self_attn_layernorm", None), "weight", None),
                    pm=getattr(getattr(layer, "post_mlp_layernorm", None), "weight", None), router=router))

    def _quantize_linears(self, drop_bf16: bool) -> None:
        """Each layer's linears to rowwise e4m3 in buffers of their own (`fp8_targets` names their HF row ranges);
        ``drop_bf16``: the HF parameters they came from go to the meta device (same shapes, no memory)."""
        names = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        fp8_bytes = 0
        for i, w in enumerate(self.layers):
            for attr, scale_attr in _LINEARS:
                src = getattr(w, attr)  # [out, in]; a mixture's experts [E, out, in]: each expert's rows
                rows = src.reshape(-1, src.shape[-1])
                if self.device.type == "cuda":
                    reason = fp8_shape_reason(f"layer {i} {attr.removesuffix('_w')}", src[0] if src.dim() == 3 else src)
                    if reason:
                        raise ValueError(f"rollout.weights_dtype fp8: {reason}; use rollout.weights_dtype: bf16")
                w8, scales = quantize_rows(rows)
                setattr(w, attr, w8.view(src.shape))
                setattr(w, scale_attr, scales.view(src.shape[0], -1) if src.dim() == 3 else scales)
                fp8_bytes += w8.numel() + scales.numel() * 4
                start = 0
                for p in (self._hf_linears[i][attr] if self._hf_linears else ()):
                    n = p.numel() // p.shape[-1]
                    self.fp8_targets[names[id(p)]] = (w8[start:start + n], scales[:, start:start + n])
                    start += n
        self.weight_bytes += fp8_bytes
        if drop_bf16:
            with torch.no_grad():
                for name in self.fp8_targets:
                    module_name, _, attr = name.rpartition(".")
                    module = self.model.get_submodule(module_name)
                    p = getattr(module, attr)
                    self.weight_bytes -= p.numel() * p.element_size()
                    setattr(module, attr, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                             requires_grad=False))
        self._hf_linears = []

    @torch.no_grad()
    def load_linear(self, name: str, tensor: torch.Tensor) -> None:
        """Quantise one HF-named linear weight from the trainer into its FP8 rows and scales, in place (the captured
        graphs read these buffers)."""
        quantize_rows_into(tensor.reshape(-1, tensor.shape[-1]), *self.fp8_targets[name])

    def _bind_shared(self, base: dict, cfg) -> None:
        """The trainer's megatron tensors (local-spec names), used as they are."""
        from runtime.models.base import normalize_mcore_state_dict
        sd = normalize_mcore_state_dict(base)

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise ValueError(f"shared base: the trainer's model has no {name!r}")
            return sd[name]

        self.embed = take("embedding.word_embeddings.weight")
        self.norm = take("decoder.final_layernorm.weight")
        self.lm = self.embed if cfg.tie_word_embeddings else take("output_layer.weight")
        self.layers = []
        for i in range(self.n_layers):
            p = f"decoder.layers.{i}."
            self.layers.append(_Layer(
                ln1=take(p + "input_layernorm.weight"), qkv_w=take(p + "self_attention.linear_qkv.weight"),
                qkv_b=sd.get(p + "self_attention.linear_qkv.bias"), qn=sd.get(p + "self_attention.q_layernorm.weight"),
                kn=sd.get(p + "self_attention.k_layernorm.weight"), o_w=take(p + "self_attention.linear_proj.weight"),
                o_b=None, ln2=take(p + "pre_mlp_layernorm.weight"), gu_w=take(p + "mlp.linear_fc1.weight"),
                down_w=take(p + "mlp.linear_fc2.weight"), pa=sd.get(p + "post_self_attn_layernorm.weight"),
                pm=sd.get(p + "post_mlp_layernorm.weight")))

    def _eager_fns(self) -> None:
        """The per-layer pieces with the model's sizes bound (constants to the compiler, not inputs)."""
        nh, nkv, hd, ffn, eps, interleaved = self.nh, self.nkv, self.hd, self.ffn, self.eps, self.interleaved
        grouped, lscale = self.qkv_grouped, self.lora_scale

        def pre(h, ln_w, qkv_w, qkv_b, qn_w, kn_w, cos, sin, qkv_s=None, qkv_a=None, qkv_lb=None):
            return _pre_attn(h, ln_w, qkv_w, qkv_b, qn_w, kn_w, cos, sin, eps, nh, nkv, hd, interleaved, grouped,
                             qkv_s, qkv_a, qkv_lb, lscale)

        def post(h, attn, o_w, o_b, ln_w, gu_w, down_w, pa_w, pm_w, o_s=None, gu_s=None, dn_s=None, o_a=None,
                 o_lb=None, gu_a=None, gu_lb=None, dn_a=None, dn_lb=None):
            return _post_attn(h, attn, o_w, o_b, ln_w, gu_w, down_w, pa_w, pm_w, eps, ffn, o_s, gu_s, dn_s, o_a, o_lb,
                              gu_a, gu_lb, dn_a, dn_lb, lscale)

        def head(h, norm_w, lm_w):
            return _logits(h, norm_w, lm_w, eps)

        topk, norm_topk = self.topk, self.norm_topk
        first = None if self.expert_shard is None else self.expert_shard.first  # rollout.expert_shards

        def post_moe(h, attn, o_w, o_b, ln_w, gu_w, down_w, router_w, o_s=None, gu_s=None, dn_s=None):
            if first is None:
                return _post_attn_moe(h, attn, o_w, o_b, ln_w, gu_w, down_w, router_w, eps, ffn, topk, norm_topk,
                                      o_s, gu_s, dn_s)
            return _post_attn_moe_parts(h, attn, o_w, o_b, ln_w, gu_w, down_w, router_w, eps, ffn, topk, norm_topk,
                                        first, o_s, gu_s, dn_s)

        self._pre, self._post, self._head, self._plain = pre, post_moe if self.moe else post, head, plain_sample
        self._gumbel = gumbel_noise
        if self.true_on_policy:
            self._pre, self._post, self._head = _batch_invariant_pieces(nh, nkv, hd, ffn, eps, interleaved, grouped,
                                                                        lscale)

    @torch.inference_mode()
    def settle_compiled(self, samplers: tuple = ()) -> None:
        """Compile the per-layer pieces on `SETTLE_TOKENS` tokens of zeros, the head and each of ``samplers``
        (``(key, fn)``, a sampler as `_sampler` makes it, once per key) on `settle_rows` rows, before their first
        real call, so that every engine of the same model and settings runs the same kernels whatever it is asked
        first (nothing when not compiled: eager kernels do not depend on it). The layers' size is a prefill's, the
        head's a decode step's (a prefill's logits would take GiBs). On an H100 (Qwen3-0.6B) a decode step at the
        recipe's points took as long as when compiled on the first call, within 0.5 % (bench/results/
        rollout_bench_*_settle.json)."""
        todo = [("layers", None)] if "layers" not in self._settled else []
        todo += [(key, fn) for key, fn in samplers if key not in self._settled]
        if not self.compiled or not todo:
            return
        dev = self.device
        head_in = torch.zeros(self.settle_rows, self.embed.shape[1], dtype=self.dtype, device=dev)
        # the samplers' key hashes and positions: two tensors, as a real call passes (one for both would be an alias
        # that dynamo guards on, and a real call would recompile)
        key_hash, position = (torch.zeros(self.settle_rows, dtype=torch.long, device=dev) for _ in range(2))
        with settled_shapes():
            for key, fn in todo:
                if fn is None:
                    self._settle_layers()
                logits = self._head(head_in, self.norm, self.lm)
                if fn is not None:
                    fn(logits, key_hash, position)
                self._settled.add(key)

    def _settle_layers(self) -> None:
        n, w, dev = SETTLE_TOKENS, self.layers[0], self.device
        h = torch.zeros(n, self.embed.shape[1], dtype=self.dtype, device=dev)
        cos, sin = self.rope_tables(torch.arange(n, device=dev))
        self._pre(h, w.ln1, w.qkv_w, w.qkv_b, w.qn, w.kn, cos, sin, w.qkv_s, *w.pre_lora)
        self._layer_post(h, torch.zeros(n, self.nh * self.hd, dtype=self.dtype, device=dev), w)

    def _layer_post(self, h, attn, w):
        """`_post` of one layer: (hidden states, each token's experts [T, k] for a mixture of experts, else None)."""
        out = self._post(h, attn, *w.post_args())
        if not self.moe:
            return out, None
        if self.expert_shard is None:
            return out
        h, part, experts = out  # this shard's part of the experts' output: the replica's sum added (an all-reduce)
        return h + self.expert_shard.sum_(part), experts

    def rope_tables(self, pos: torch.Tensor):
        return _cos_sin(pos, self.inv_freq, self.rope_scale, self.dtype, self.interleaved)

    @torch.inference_mode()
    def sequence_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] of one sequence (positions from 0) by this forward, adapters included: the
        engine's teacher-forced log-probs where HF's forward would miss them (LoRA, a shared base)."""
        self.settle_compiled()
        cos, sin = self.rope_tables(torch.arange(ids.shape[0], device=self.device))
        h = F.embedding(ids, self.embed)
        for w in self.layers:
            q, k, v = self._pre(h, w.ln1, w.qkv_w, w.qkv_b, w.qn, w.kn, cos, sin, w.qkv_s, *w.pre_lora)
            a = _sdpa_prefill(q, k, v, [ids.shape[0]], self.scale)
            h, _ = self._layer_post(h, a.reshape(h.shape[0], -1), w)
        return self._head(h, self.norm, self.lm)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.nkv * self.hd * torch.finfo(self.dtype).bits // 8

    def _sampler(self, sampling) -> tuple[Callable, tuple, Callable]:
        """(decode-step sampler, its graph key, prefill sampler). With ``true_on_policy`` the token is the sampler's
        and its log-prob the batch-invariant one the trainer computes (`batch_invariant.token_logprobs`)."""
        step, skey, prefill = self._own_sampler(sampling)
        if not self.true_on_policy:
            return step, skey, prefill
        from runtime.kernels.batch_invariant import token_logprobs
        temp = float(sampling.temperature) if sampling.temperature > 0 else 1.0

        def with_logprob(fn):
            def draw(logits, kh, sp):
                t, _ = fn(logits, kh, sp)
                return t, token_logprobs(logits, t, temp)[0]
            return draw
        return with_logprob(step), (*skey, "true_on_policy"), with_logprob(prefill)

    def _own_sampler(self, sampling) -> tuple[Callable, tuple, Callable]:
        def slow(logits, kh, sp):
            return sample_next(logits, kh, sp, sampling, self._gumbel)
        skey = (sampling.temperature, sampling.top_p, sampling.top_k)
        plain = sampling.temperature > 0 and sampling.top_p >= 1.0 and not (0 < sampling.top_k < self.vocab)
        if plain and self.compiled:
            temp = float(sampling.temperature)
            return (lambda logits, kh, sp: self._plain(logits, kh, sp, temp)), skey, slow
        return slow, skey, slow


def _batch_invariant_pieces(nh: int, nkv: int, hd: int, ffn: int, eps: float, interleaved: bool, grouped: bool,
                            lscale: float):
    """`_pre_attn`, `_post_attn` and `_logits` (bf16 weights) over the batch-invariant kernels the trainer runs under
    ``rollout.true_on_policy``: the norm with the trainer's rounding, every GEMM by `fixed_shape_mm` (a bias added to
    its rounded output), a LoRA adapter's up-projection by `fixed_shape_addmm`. RoPE, SwiGLU and the residual adds are
    the same eager ops as megatron's unfused ones (the trainer's fusions are off under the setting)."""
    from runtime.kernels.batch_invariant import fixed_shape_addmm as addmm, fixed_shape_mm as mm, rms_norm as norm
    rope = _rope_interleaved if interleaved else _rope

    def proj(x, w, b=None, a=None, lb=None):
        out = mm(x, w, b)
        return out if a is None else addmm(out, mm(x, a), lb, lscale)

    def pre(h, ln_w, qkv_w, qkv_b, qn_w, kn_w, cos, sin, qkv_s=None, qkv_a=None, qkv_lb=None):
        qkv = proj(norm(h, ln_w, eps), qkv_w, qkv_b, qkv_a, qkv_lb)
        if grouped:  # a shared base's rows: megatron's per-group order (as `_pre_attn`)
            per = nh // nkv
            g = qkv.view(-1, nkv, per + 2, hd)
            q, k, v = g[:, :, :per].reshape(-1, nh, hd), g[:, :, per], g[:, :, per + 1]
        else:
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q, k = q.reshape(-1, nh, hd), k.reshape(-1, nkv, hd)
        if qn_w is not None:
            q, k = norm(q, qn_w, eps), norm(k, kn_w, eps)
        return rope(q, cos, sin), rope(k, cos, sin), v.reshape(-1, nkv, hd).contiguous()

    def post(h, attn, o_w, o_b, ln_w, gu_w, down_w, pa_w, pm_w, o_s=None, gu_s=None, dn_s=None, o_a=None, o_lb=None,
             gu_a=None, gu_lb=None, dn_a=None, dn_lb=None):
        a = proj(attn, o_w, o_b, o_a, o_lb)
        h = h + (a if pa_w is None else norm(a, pa_w, eps))
        g, u = proj(norm(h, ln_w, eps), gu_w, None, gu_a, gu_lb).split([ffn, ffn], dim=-1)
        m = proj(F.silu(g) * u, down_w, None, dn_a, dn_lb)
        return h + (m if pm_w is None else norm(m, pm_w, eps))

    def head(h, norm_w, lm_w):
        return mm(norm(h, norm_w, eps), lm_w)
    return pre, post, head


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total
