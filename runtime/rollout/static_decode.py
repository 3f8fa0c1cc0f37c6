"""The built-in engine's fast path: a static KV cache, continuous batching and CUDA-graph decode.

`StaticDecoder` runs the forward pass of a Qwen3 / Qwen2 / LLaMA-family HF model itself (the HF
modules' weights, no HF forward), so that one decode step is a fixed sequence of kernels over
preallocated buffers that a CUDA graph can replay:

* KV cache: one slab per layer, laid out [slot, position, kv_head, head_dim]. A slot's first
  `prefix_region` positions hold a prompt (a *prefix slot*), the rest one row's response. Rows with
  the same prompt (a GRPO group) share one prefix slot: the prompt is prefilled once and its KV read
  from one place (`decode_attention`). The number of slots is bounded by a memory budget
  (`kv_cache_gb`), so the KV memory is bounded whatever the request count and length.
* Continuous batching: requests wait in a queue; a slot whose sequence finished is refilled with
  the next request (packed prefill of the prompts not already cached), while the other slots keep
  decoding. A prefix slot is reused once no active row points at it.
* Decode attention: on CUDA a split-KV Triton kernel (`decode_attention`) that reads the per-row
  lengths and prefix slots on the GPU, so one CUDA graph per batch bucket serves every step; CPU
  (and any GPU without Triton) uses the same function in SDPA with a mask. Prefill uses
  FlashAttention-2's varlen kernel on CUDA.
* The per-layer pieces (norm + fused QKV + q/k-norm + RoPE; o-proj + residual + norm + fused
  gate/up + SwiGLU + down) go through torch.compile on CUDA (dynamic shapes: one compile serves
  prefill and every decode bucket).
* Sampling is `keyed_sampling` on the GPU inside the graph: the token of a row depends only on its
  key hash and response position, exactly as on the slow path; the sampled token and its log-prob
  land in a device buffer. The host reads that buffer once per `sync_every` steps (no host sync
  per token); a row that stopped inside a chunk is cut at its stop token on the host.

The HF model's q/k/v and gate/up weights are re-pointed to views of fused buffers, so the engine's
`update_weights` (which copies into `model.state_dict()` tensors) updates the fast path in place
and the captured graphs stay valid.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from runtime.rollout.decode_attention import (decode_attention, reference_decode_attention, split_tokens_for,
                                              triton_available)
from runtime.rollout.keyed_sampling import compiled_gumbel_noise, gumbel_noise, sample_next, uniform_noise

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")


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


def _pre_attn(h, ln_w, qkv_w, qkv_b, qn_w, kn_w, cos, sin, eps: float, nh: int, nkv: int, hd: int):
    """[T, H] -> q [T, nh, hd], k, v [T, nkv, hd] (RoPE applied)."""
    x = _rms(h, ln_w, eps)
    qkv = F.linear(x, qkv_w, qkv_b)
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    q = q.reshape(-1, nh, hd)
    k = k.reshape(-1, nkv, hd)
    if qn_w is not None:
        q = _rms(q, qn_w, eps)
        k = _rms(k, kn_w, eps)
    return _rope(q, cos, sin), _rope(k, cos, sin), v.reshape(-1, nkv, hd).contiguous()


def _post_attn(h, attn, o_w, o_b, ln_w, gu_w, down_w, eps: float, ffn: int):
    h = h + F.linear(attn, o_w, o_b)
    gu = F.linear(_rms(h, ln_w, eps), gu_w)
    g, u = gu.split([ffn, ffn], dim=-1)
    return h + F.linear(F.silu(g) * u, down_w)


def _logits(h, norm_w, lm_w, eps: float):
    return F.linear(_rms(h, norm_w, eps), lm_w)


def _cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype):
    # exactly HF's rotary embedding: fp32 angles, cos/sin scaled, cast to the activation dtype
    f = pos.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((f, f), dim=-1)
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


def _fuse(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """cat along dim 0, then make each parameter a view of its rows (in-place weight updates reach the fused copy)."""
    fused = torch.cat([p.data for p in params], dim=0).contiguous()
    start = 0
    for p in params:
        n = p.shape[0]
        p.data = fused[start:start + n]
        start += n
    return fused


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# ---- the KV cache's size policy (pure functions: runtime/plan/memory.py's estimate uses the same ones) -----

KV_FREE_FRACTION = 0.5        # without kv_cache_gb, on CUDA: this share of the free GPU memory (+ the current cache)
CPU_KV_BUDGET_BYTES = 2 * 10**9
SLOT_ALIGN = 64               # slot lengths are rounded up to a multiple of this


def kv_slot_len(tokens: int) -> int:
    """The slot length the cache is built with for sequences of up to `tokens` (prompt + response)."""
    return _round_up(int(tokens), SLOT_ALIGN)


def kv_budget_bytes(kv_cache_gb: float | None, device_type: str, free_bytes: int = 0, cache_bytes: int = 0) -> int:
    """The KV cache's memory budget: `kv_cache_gb` (10^9 bytes) when given; else on CUDA half of what
    is free on the device at that moment plus the cache already held; else (CPU) 2 GB."""
    if kv_cache_gb is not None:
        return int(kv_cache_gb * 1e9)
    if device_type == "cuda":
        return int(KV_FREE_FRACTION * (free_bytes + cache_bytes))
    return CPU_KV_BUDGET_BYTES


def kv_slots(per_slot_bytes: int, budget_bytes: int, rows: int, max_slots: int) -> int:
    """Slots the cache gets: as many as the rows of the call, at most `max_slots`, within the budget (>= 1)."""
    return max(1, min(int(max_slots), int(rows), int(budget_bytes) // int(per_slot_bytes)))


class StaticDecoder:
    """Generates for many requests at once with a bounded static KV cache (see the module doc)."""

    def __init__(self, model, *, max_slots: int = 256, kv_cache_gb: float | None = None,
                 cuda_graphs: bool | None = None, compile: bool | None = None, sync_every: int = 16,
                 prefill_tokens: int = 16384):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"fast decode path: {reason}")
        self.model = model
        cfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        cuda = self.device.type == "cuda"
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.ffn = cfg.intermediate_size
        self.eps = float(cfg.rms_norm_eps)
        self.scale = self.hd ** -0.5
        self.n_layers = cfg.num_hidden_layers
        self.max_slots = int(max_slots)
        self.kv_cache_gb = kv_cache_gb
        self.sync_every = int(sync_every)
        self.prefill_tokens = int(prefill_tokens)
        self.use_flash = cuda and self.dtype in (torch.bfloat16, torch.float16)  # prefill
        # decode; the kernel tiles the head dimension whole (a power of two, >= 16 for tensor-core dots)
        self.use_triton = self.use_flash and triton_available() and self.hd >= 16 and self.hd & (self.hd - 1) == 0
        self.split_tokens: int | None = None  # decode kernel's tokens per split; None: chosen per chunk
        self._chunk_split_tokens = 4096
        self.use_graphs = cuda if cuda_graphs is None else bool(cuda_graphs and cuda)
        self.compiled = cuda if compile is None else bool(compile)
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm = model.get_output_embeddings().weight
        self.inv_freq = inner.rotary_emb.inv_freq.to(self.device, torch.float32)
        self.rope_scale = float(getattr(inner.rotary_emb, "attention_scaling", 1.0))
        self.vocab = int(self.lm.shape[0])
        self.layers = []
        with torch.no_grad():
            for layer in inner.layers:
                a, m = layer.self_attn, layer.mlp
                qkv_b = _fuse([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None
                self.layers.append(_Layer(
                    ln1=layer.input_layernorm.weight, qkv_w=_fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                    qkv_b=qkv_b, qn=getattr(getattr(a, "q_norm", None), "weight", None),
                    kn=getattr(getattr(a, "k_norm", None), "weight", None), o_w=a.o_proj.weight, o_b=a.o_proj.bias,
                    ln2=layer.post_attention_layernorm.weight,
                    gu_w=_fuse([m.gate_proj.weight, m.up_proj.weight]), down_w=m.down_proj.weight))
        self._eager_fns()
        self.compile_error: str | None = None
        if self.compiled:
            try:
                from torch import _dynamo
                _dynamo.config.cache_size_limit = max(_dynamo.config.cache_size_limit, 64)
                uniform_noise(torch.zeros(1, dtype=torch.long, device=self.device),
                              torch.zeros(1, dtype=torch.long, device=self.device), self.vocab)  # counters cached
                self._pre = torch.compile(self._pre, dynamic=True)
                self._post = torch.compile(self._post, dynamic=True)
                self._head = torch.compile(self._head, dynamic=True)
                self._plain = torch.compile(plain_sample, dynamic=True)
                self._gumbel = compiled_gumbel_noise()
            except Exception as e:  # noqa: BLE001 - no compiler: eager is correct, only slower
                self.compile_error = f"{type(e).__name__}: {e}"
                self.compiled = False
        self.k_cache = self.v_cache = None
        self.slots = self.slot_len = self.prefix_region = 0
        self.graphs: dict = {}
        self.stats: dict = {}
        self.trace: list | None = None  # set to [] to record every decode chunk

    def _eager_fns(self) -> None:
        """The per-layer pieces with the model's sizes bound (constants to the compiler, not inputs)."""
        nh, nkv, hd, ffn, eps = self.nh, self.nkv, self.hd, self.ffn, self.eps

        def pre(h, ln_w, qkv_w, qkv_b, qn_w, kn_w, cos, sin):
            return _pre_attn(h, ln_w, qkv_w, qkv_b, qn_w, kn_w, cos, sin, eps, nh, nkv, hd)

        def post(h, attn, o_w, o_b, ln_w, gu_w, down_w):
            return _post_attn(h, attn, o_w, o_b, ln_w, gu_w, down_w, eps, ffn)

        def head(h, norm_w, lm_w):
            return _logits(h, norm_w, lm_w, eps)

        self._pre, self._post, self._head, self._plain = pre, post, head, plain_sample
        self._gumbel = gumbel_noise

    # ---- memory ----------------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.nkv * self.hd * torch.finfo(self.dtype).bits // 8

    def _budget_bytes(self) -> int:
        free = 0
        if self.kv_cache_gb is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        return kv_budget_bytes(self.kv_cache_gb, self.device.type, free, self.kv_cache_bytes())

    def _ensure_cache(self, prompt_len: int, max_new: int, rows: int) -> None:
        """Slots with a prefix region of at least `prompt_len` and a response region of at least `max_new`
        tokens (the slot length rounded up as `kv_slot_len`), as many as `rows` asks for within the budget
        and `max_slots`."""
        fits = (self.k_cache is not None and self.prefix_region >= prompt_len
                and self.slot_len - self.prefix_region >= max_new)
        if fits:
            if self.slots >= min(rows, self.max_slots):
                return
            if min(rows, self.max_slots, self._budget_bytes() // (self.slot_len * self.kv_bytes_per_token())) <= self.slots:
                return
        prefix_region = max(prompt_len, self.prefix_region if fits else 0)
        slot_len = kv_slot_len(prefix_region + max(max_new, self.slot_len - self.prefix_region if fits else 0))
        self.release()
        per_slot = slot_len * self.kv_bytes_per_token()
        budget = self._budget_bytes()
        if per_slot > budget:
            raise MemoryError(f"KV cache: one slot of {slot_len} tokens needs {per_slot / 1e9:.2f} GB, over the "
                              f"budget {budget / 1e9:.2f} GB; raise kv_cache_gb or shorten max_new_tokens")
        want = kv_slots(per_slot, budget, rows, self.max_slots)
        shape = (self.n_layers, want, slot_len, self.nkv, self.hd)
        dev = self.device
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=dev)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=dev)
        self.slots, self.slot_len, self.prefix_region = want, slot_len, prefix_region
        n, ch = want, self.sync_every
        self.tok = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)       # absolute position of the input token
        self.plen = torch.zeros(n, dtype=torch.long, device=dev)      # prompt length of the row
        self.pslot = torch.zeros(n, dtype=torch.long, device=dev)     # the slot holding the row's prompt
        self.spos = torch.zeros(n, dtype=torch.long, device=dev)
        self.live = torch.zeros(n, dtype=torch.long, device=dev)      # 1 while the row decodes, 0 idle
        self.key_hash = torch.zeros(n, dtype=torch.long, device=dev)
        self.out_tok = torch.zeros(n, ch, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(n, ch, dtype=torch.float32, device=dev)
        self.chunk_i = torch.zeros(1, dtype=torch.long, device=dev)
        self.rows = torch.arange(n, dtype=torch.long, device=dev)
        self.prefix_h = torch.zeros(n, self.embed.shape[1], dtype=self.dtype, device=dev)  # a prompt's last hidden state

    def release(self) -> None:
        """Drop the KV cache and the captured graphs (they point into it)."""
        self.graphs.clear()
        self.k_cache = self.v_cache = None
        self.slots = self.slot_len = self.prefix_region = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def kv_cache_bytes(self) -> int:
        return 0 if self.k_cache is None else 2 * self.k_cache.numel() * self.k_cache.element_size()

    # ---- forward pieces --------------------------------------------------------------------------------
    def _prefill(self, ids: torch.Tensor, lens: list[int], slots: list[int]) -> torch.Tensor:
        """Packed prompts -> KV written into the prefix regions of `slots`; returns each prompt's last hidden state."""
        dev = self.device
        pos = torch.cat([torch.arange(n, device=dev) for n in lens])
        widx = torch.cat([torch.arange(n, device=dev) + s * self.slot_len for n, s in zip(lens, slots)])
        cu = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.int32, device=dev)
        cos, sin = _cos_sin(pos, self.inv_freq, self.rope_scale, self.dtype)
        h = F.embedding(ids, self.embed)
        for li, w in enumerate(self.layers):
            q, k, v = self._pre(h, w.ln1, w.qkv_w, w.qkv_b, w.qn, w.kn, cos, sin)
            self.k_cache[li].view(-1, self.nkv, self.hd).index_copy_(0, widx, k)
            self.v_cache[li].view(-1, self.nkv, self.hd).index_copy_(0, widx, v)
            if self.use_flash:
                a = _flash(q, k, v, cu, cu, max(lens), max(lens), True, self.scale)
            else:
                a = _sdpa_prefill(q, k, v, lens, self.scale)
            h = self._post(h, a.reshape(h.shape[0], -1), w.o_w, w.o_b, w.ln2, w.gu_w, w.down_w)
        return h.index_select(0, cu[1:].long() - 1)

    def _step(self, b: int, sample_fn: Callable) -> None:
        """One decode step for slots [0, b): every tensor it touches is a static buffer (graph-safe)."""
        S, P = self.slot_len, self.prefix_region
        tok, pos = self.tok[:b], self.pos[:b]
        own = pos - self.plen[:b]  # the input token's place in the row's response
        own_len = torch.clamp(own + 1, max=S - P)
        widx = self.rows[:b] * S + P + torch.clamp(own, max=S - P - 1)
        pslot, plen = self.pslot[:b], self.plen[:b]
        cos, sin = _cos_sin(pos, self.inv_freq, self.rope_scale, self.dtype)
        h = F.embedding(tok, self.embed)
        for li, w in enumerate(self.layers):
            q, k, v = self._pre(h, w.ln1, w.qkv_w, w.qkv_b, w.qn, w.kn, cos, sin)
            kc, vc = self.k_cache[li], self.v_cache[li]
            kc.view(-1, self.nkv, self.hd).index_copy_(0, widx, k)
            vc.view(-1, self.nkv, self.hd).index_copy_(0, widx, v)
            if self.use_triton:
                a = decode_attention(q, kc, vc, pslot, plen, own_len, P, self.scale,
                                     split_tokens=self._chunk_split_tokens)
            else:
                a = reference_decode_attention(q, kc, vc, pslot, plen, own_len, P, self.scale)
            h = self._post(h, a.reshape(b, -1), w.o_w, w.o_b, w.ln2, w.gu_w, w.down_w)
        logits = self._head(h, self.norm, self.lm)
        t, lp = sample_fn(logits, self.key_hash[:b], self.spos[:b])
        self.out_tok[:b].index_copy_(1, self.chunk_i, t[:, None])
        self.out_lp[:b].index_copy_(1, self.chunk_i, lp.to(torch.float32)[:, None])
        tok.copy_(t)
        # an idle row stays at one token of its own (its length would otherwise grow with every step
        # the bucket runs, and so would the attention work for it)
        live = self.live[:b]
        pos.add_(live)
        self.spos[:b].add_(live)
        self.chunk_i.add_(1)

    def _buckets(self) -> list[int]:
        out, b = [], 8
        while b < self.slots:
            out.append(b)
            b = b * 2 if b < 64 else b + 64
        return out + [self.slots]

    def _run_step(self, b: int, sample_fn: Callable, skey) -> None:
        if not self.use_graphs:
            self._step(b, sample_fn)
            return
        key = (b, skey, self._chunk_split_tokens if self.use_triton else None)
        g = self.graphs.get(key)
        if g is not None:
            g.replay()
            return
        # first step of this shape: run it for real on a side stream (compiles, warms cuBLAS), then capture
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            self._step(b, sample_fn)
        torch.cuda.current_stream(self.device).wait_stream(s)
        t0 = time.perf_counter()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle()):  # a fresh pool per capture
            self._step(b, sample_fn)
        self.graphs[key] = g
        self.stats["graph_capture_s"] = self.stats.get("graph_capture_s", 0.0) + time.perf_counter() - t0
        self.stats["graphs"] = len(self.graphs)

    # ---- the loop --------------------------------------------------------------------------------------
    def _sampler(self, sampling) -> tuple[Callable, tuple, Callable]:
        """(decode-step sampler, its graph key, prefill sampler)."""
        def slow(logits, kh, sp):
            return sample_next(logits, kh, sp, sampling, self._gumbel)
        skey = (sampling.temperature, sampling.top_p, sampling.top_k)
        plain = sampling.temperature > 0 and sampling.top_p >= 1.0 and not (0 < sampling.top_k < self.vocab)
        if plain and self.compiled:
            temp = float(sampling.temperature)
            return (lambda logits, kh, sp: self._plain(logits, kh, sp, temp)), skey, slow
        return slow, skey, slow

    def generate(self, prompts: list[list[int]], key_hash: torch.Tensor, sampling, stop_ids: set[int]):
        """Returns (response ids, response log-probs, finish reasons), one per prompt, in order.

        If a speed feature fails at run time (the compiler, graph capture, the Triton or flash kernel),
        it is switched off, the failure is kept in `stats["fallbacks"]`, and the call is redone: every
        sample is a pure function of its key, so the redone call returns what the first would have.
        """
        while True:
            try:
                return self._generate(prompts, key_hash, sampling, stop_ids)
            except MemoryError:
                raise
            except Exception as e:  # noqa: BLE001
                feature = ("compile" if self.compiled else "cuda_graphs" if self.use_graphs
                           else "triton" if self.use_triton else "flash" if self.use_flash else None)
                if feature is None:
                    raise
                log.warning("fast decode: %s failed (%s: %s); retrying without it", feature, type(e).__name__, e)
                self.stats.setdefault("fallbacks", []).append(f"{feature}: {type(e).__name__}: {str(e)[:300]}")
                if feature == "compile":
                    self.compiled = False
                    self._eager_fns()
                elif feature == "cuda_graphs":
                    self.use_graphs = False
                elif feature == "triton":
                    self.use_triton = False
                else:
                    self.use_flash = False
                self.graphs.clear()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], key_hash: torch.Tensor, sampling, stop_ids: set[int]):
        n = len(prompts)
        max_new = int(sampling.max_new_tokens)
        t_start = time.perf_counter()
        self._ensure_cache(max(len(p) for p in prompts), max_new, n)
        for buf in (self.pos, self.plen, self.live):  # every row idle (an earlier call may have stopped midway)
            buf.zero_()
        slots = self.slots
        dev = self.device
        step_fn, skey, prefill_fn = self._sampler(sampling)
        key_hash = key_hash.to(dev)
        out_ids: list[list[int]] = [[] for _ in range(n)]
        out_lp: list[list[float]] = [[] for _ in range(n)]
        finish = ["length"] * n
        slot_req = [-1] * slots
        queue = list(range(n))
        queue.reverse()  # pop() from the end takes requests in order
        # prefix slots: which prompt each holds (valid for this call only: the weights change between calls)
        prefix_of: dict[tuple, int] = {}
        prefix_key: list[tuple | None] = [None] * slots
        prefix_refs = [0] * slots
        row_prefix = [0] * slots
        stats = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "row_steps": 0, "chunks": 0,
                 "slots": slots, "slot_len": self.slot_len, "prefix_region": self.prefix_region, "max_active": 0,
                 "prefills": 0, "prefill_tokens": 0}

        def take(row: int, toks: list[int], lps: list[float]) -> bool:
            """Append tokens to a request until it stops; True when it finished."""
            for t, lp in zip(toks, lps):
                out_ids[row].append(t)
                out_lp[row].append(lp)
                if t in stop_ids:
                    finish[row] = "stop"
                    return True
                if len(out_ids[row]) >= max_new:
                    return True
            return False

        def release_row(s: int) -> None:
            slot_req[s] = -1
            prefix_refs[row_prefix[s]] -= 1

        def make_idle(rows: list[int]) -> None:
            """Rows that finished attend to one token of their own until refilled, not to their old length."""
            if rows:
                idx = torch.tensor(rows, dtype=torch.long, device=dev)
                for buf in (self.pos, self.plen, self.live):
                    buf.index_fill_(0, idx, 0)

        def free_prefix_slot() -> int:
            # exists: the prefix slots in use are at most the active rows, fewer than the slots
            j = next(j for j in range(slots) if prefix_refs[j] == 0)
            if prefix_key[j] is not None:
                del prefix_of[prefix_key[j]]
                prefix_key[j] = None
            return j

        while queue or any(r >= 0 for r in slot_req):
            # refill free slots with queued requests; prompts not cached yet get one packed prefill
            free = [s for s in range(slots) if slot_req[s] < 0]
            if queue and free:
                t0 = time.perf_counter()
                assign: list[tuple[int, int, int]] = []  # (slot, request, prefix slot)
                new_prefixes: list[tuple[int, list[int]]] = []
                budget = self.prefill_tokens
                while queue and len(assign) < len(free):
                    r = queue[-1]
                    key = tuple(prompts[r])
                    j = prefix_of.get(key)
                    if j is None:
                        if new_prefixes and len(prompts[r]) > budget:
                            break
                        j = free_prefix_slot()
                        prefix_of[key], prefix_key[j] = j, key
                        new_prefixes.append((j, prompts[r]))
                        budget -= len(prompts[r])
                    queue.pop()
                    prefix_refs[j] += 1
                    assign.append((free[len(assign)], r, j))
                if new_prefixes:
                    ids = torch.tensor([t for _, p in new_prefixes for t in p], dtype=torch.long, device=dev)
                    lens = [len(p) for _, p in new_prefixes]
                    js = [j for j, _ in new_prefixes]
                    self.prefix_h.index_copy_(0, torch.tensor(js, dtype=torch.long, device=dev),
                                              self._prefill(ids, lens, js))
                    stats["prefills"] += len(new_prefixes)
                    stats["prefill_tokens"] += sum(lens)
                s_idx = torch.tensor([s for s, _, _ in assign], dtype=torch.long, device=dev)
                r_idx = torch.tensor([r for _, r, _ in assign], dtype=torch.long, device=dev)
                j_idx = torch.tensor([j for _, _, j in assign], dtype=torch.long, device=dev)
                p_len = torch.tensor([len(prompts[r]) for _, r, _ in assign], dtype=torch.long, device=dev)
                logits = self._head(self.prefix_h.index_select(0, j_idx), self.norm, self.lm)
                kh = key_hash.index_select(0, r_idx)
                t, lp = prefill_fn(logits, kh, torch.zeros_like(kh))
                self.tok.index_copy_(0, s_idx, t)
                self.pos.index_copy_(0, s_idx, p_len)
                self.plen.index_copy_(0, s_idx, p_len)
                self.pslot.index_copy_(0, s_idx, j_idx)
                self.spos.index_copy_(0, s_idx, torch.ones_like(s_idx))
                self.key_hash.index_copy_(0, s_idx, kh)
                self.live.index_fill_(0, s_idx, 1)
                first_done = []
                for (s, r, j), ti, li in zip(assign, t.tolist(), lp.float().tolist()):
                    slot_req[s], row_prefix[s] = r, j
                    if take(r, [ti], [li]):
                        release_row(s)
                        first_done.append(s)
                make_idle(first_done)
                stats["prefill_s"] += time.perf_counter() - t0
                continue  # slots may have freed at once (stop on the first token): refill again
            active = [s for s in range(slots) if slot_req[s] >= 0]
            if not active:
                continue
            hi = max(active) + 1
            b = next(x for x in self._buckets() if x >= hi)
            steps = min(self.sync_every, max(max_new - len(out_ids[slot_req[s]]) for s in active))
            longest = max(len(prompts[slot_req[s]]) + len(out_ids[slot_req[s]]) for s in active) + steps
            self._chunk_split_tokens = self.split_tokens or split_tokens_for(len(active), self.nkv, longest, dev)
            t0 = time.perf_counter()
            self.chunk_i.zero_()
            for _ in range(steps):
                self._run_step(b, step_fn, skey)
            toks = self.out_tok[:b, :steps].tolist()  # the one host sync of the chunk
            lps = self.out_lp[:b, :steps].tolist()
            dt = time.perf_counter() - t0
            stats["decode_s"] += dt
            if self.trace is not None:  # (active rows, batch bucket, steps, ms per step, max length, split tokens)
                self.trace.append((len(active), b, steps, round(1e3 * dt / steps, 3), longest - steps,
                                   self._chunk_split_tokens))
            stats["decode_steps"] += steps
            stats["row_steps"] += steps * b
            stats["chunks"] += 1
            stats["max_active"] = max(stats["max_active"], len(active))
            done = []
            for s in active:
                if take(slot_req[s], toks[s], lps[s]):
                    release_row(s)
                    done.append(s)
            make_idle(done)
        stats["total_s"] = time.perf_counter() - t_start
        stats["new_tokens"] = sum(len(x) for x in out_ids)
        stats["graphs"] = len(self.graphs)
        stats["compiled"] = self.compiled
        stats["cuda_graphs"] = self.use_graphs
        stats["attention"] = "triton_split_kv" if self.use_triton else "sdpa"
        stats["prefill_attention"] = "flash_varlen" if self.use_flash else "sdpa"
        if self.compile_error:
            stats["compile_error"] = self.compile_error
        self.stats.update(stats)
        return out_ids, out_lp, finish


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


__all__ = ["StaticDecoder", "unsupported_reason", "unsupported_config_reason", "plain_sample", "SUPPORTED_MODEL_TYPES",
           "kv_slot_len", "kv_budget_bytes", "kv_slots"]
