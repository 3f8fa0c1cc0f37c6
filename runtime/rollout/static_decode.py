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
from typing import Callable

import torch
import torch.nn.functional as F

from runtime.rollout.decode_attention import (decode_attention, reference_decode_attention, split_tokens_for,
                                              triton_available)
from runtime.rollout.decode_model import (SUPPORTED_MODEL_TYPES, FusedModel, _cos_sin, _cumsum, _flash, _round_up,
                                          _sdpa_prefill, plain_sample, unsupported_config_reason, unsupported_reason)

log = logging.getLogger(__name__)

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


class StaticDecoder(FusedModel):
    """Generates for many requests at once with a bounded static KV cache (see the module doc)."""

    def __init__(self, model, *, max_slots: int = 256, kv_cache_gb: float | None = None,
                 cuda_graphs: bool | None = None, compile: bool | None = None, sync_every: int = 16,
                 prefill_tokens: int = 16384):
        super().__init__(model, compile=compile)
        cuda = self.device.type == "cuda"
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
        self.k_cache = self.v_cache = None
        self.slots = self.slot_len = self.prefix_region = 0
        self.graphs: dict = {}
        self.stats: dict = {}
        self.trace: list | None = None  # set to [] to record every decode chunk

    # ---- memory ----------------------------------------------------------------------------------------
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
    def generate(self, prompts: list[list[int]], key_hash: torch.Tensor, sampling, stop_ids: set[int],
                 stop_at: list[int] | None = None):
        """Returns (response ids, response log-probs, finish reasons), one per prompt, in order.

        If a speed feature fails at run time (the compiler, graph capture, the Triton or flash kernel),
        it is switched off, the failure is kept in `stats["fallbacks"]`, and the call is redone: every
        sample is a pure function of its key, so the redone call returns what the first would have.
        """
        while True:
            try:
                return self._generate(prompts, key_hash, sampling, stop_ids, stop_at)
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
    def _generate(self, prompts: list[list[int]], key_hash: torch.Tensor, sampling, stop_ids: set[int], stop_at):
        n = len(prompts)
        max_new = int(sampling.max_new_tokens)
        # stop_at (benchmarks, as PagedDecoder.generate): a forced stop at that response length
        cap = [max_new if stop_at is None else max(1, min(max_new, int(stop_at[r]))) for r in range(n)]
        forced_stop = min(stop_ids) if stop_ids else 0
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
                if len(out_ids[row]) + 1 == cap[row] and cap[row] < max_new:
                    t = forced_stop
                out_ids[row].append(t)
                out_lp[row].append(lp)
                if t in stop_ids or len(out_ids[row]) == cap[row] and cap[row] < max_new:
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
            steps = min(self.sync_every, max(cap[slot_req[s]] - len(out_ids[slot_req[s]]) for s in active))
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



__all__ = ["StaticDecoder", "unsupported_reason", "unsupported_config_reason", "plain_sample", "SUPPORTED_MODEL_TYPES",
           "kv_slot_len", "kv_budget_bytes", "kv_slots"]
