"""The built-in engine's decode path: a paged KV cache, continuous batching and CUDA-graph decode.

`PagedDecoder` runs the model's forward itself (`decode_model.FusedModel`) over a KV cache kept in
pages (`kv_pages`): one pool of `page_size`-token pages per layer, K and V laid out [page, token,
kv_head, head_dim]. A sequence holds pages for the tokens it has, so memory follows the lengths the
responses actually reach, not the longest they could reach.

* Prompt pages are shared: the samples of a GRPO group point at one set of prompt pages (prefilled
  once). A row's page table has `prefix_cols` columns for its prompt's pages and the rest for its own
  (response) pages, so a prompt page is never written by a sample and needs no copy.
* Continuous batching: requests wait in a queue and are admitted into free rows while pages are free
  (after what the rows already running need for their next chunk of steps).
* Decode steps run in chunks of `sync_every` steps with one host sync per chunk, over the smallest
  batch bucket that holds the active rows (rows are moved down when rows below them finished). Before a chunk, the
  host reserves the pages each row will write in it and writes them into the page table, a static
  device buffer; every length lives on the device, so one CUDA graph per batch bucket replays every
  step.
* While nothing waits to be admitted and the bucket stays, the next chunk is queued before the last one's
  tokens are read, with pages for its rows as if none stopped; so the device never waits while the host
  reads tokens, finds stops and reserves pages. A row that stopped makes one more chunk of tokens that
  nobody takes, and sampling is keyed, so the tokens are those of a call that waits every chunk.
* Preemption: when the pool cannot hold the next chunk, the row that has made the fewest tokens gives
  up its pages and goes back to the queue, ahead of every later request, with the tokens it made. When it is admitted again its prompt and
  those tokens are prefilled again (recompute) and it continues. Sampling is keyed by (request,
  response position) (`keyed_sampling`), so the tokens it makes after that are the ones it would have
  made uninterrupted.
* Attention: on CUDA the split-KV Triton kernel reading through the page table
  (`decode_attention.paged_decode_attention`); elsewhere its PyTorch reference. Prefill uses
  FlashAttention-2's varlen kernel on CUDA, SDPA elsewhere.
* Cascade attention (`cascade`, ``rollout.cascade_attention``): each chunk the host writes a group table (a
  static [rows, group_rows] buffer: the live rows sharing a prompt, `group_rows` to a line) and the step's
  attention reads each group's prompt pages once for all its rows, merged with each row's own pages by
  log-sum-exp (`decode_attention.cascade_decode_attention`, its reference off CUDA; docs/cascade-attention.md).
* `release()` frees the pool and the captured graphs (the trainer trains meanwhile); the next call
  makes them again.
* Speed features (`speed_features`): a failure inside the compiler, a graph capture, the Triton or the
  flash kernel switches that feature off and the call is redone (`steps`). Running out of device memory
  switches nothing off: it is one `MemoryPlanError` naming the pool, what else was allocated, the card and
  the settings to change.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from runtime.devices import is_out_of_memory, out_of_memory_error
from runtime.errors import ConfigError, MemoryPlanError
from runtime.rollout.decode_attention import (cascade_decode_attention, group_rows_for, paged_decode_attention,
                                              reference_cascade_decode_attention, reference_paged_decode_attention,
                                              split_tokens_for, triton_available)
from runtime.rollout.decode_model import FusedModel, _cumsum, _flash, _sdpa_prefill
from runtime.rollout.kv_pages import (NULL_PAGE, DEFAULT_PAGE_SIZE, KV_FREE_FRACTION, PagePool, kv_pool_bytes,
                                      pages_for)
from runtime.rollout.speed_features import SpeedFeatureFailed, as_feature_failure, guarded
from runtime.testing.moments import moment

log = logging.getLogger("grpoflow.rollout")


@dataclass
class _Chunk:
    """A queued chunk of decode steps: the (row, request) pairs it runs and where its tokens land."""
    rows: list[tuple[int, int]]
    bucket: int
    steps: int
    tok: torch.Tensor  # [bucket, steps] on the host (CUDA: filled once `event` has passed)
    lp: torch.Tensor
    event: "torch.cuda.Event | None"
    launched: float
    first_step: int  # decode steps before it
    pages_used: int
    routes: torch.Tensor | None = None  # [bucket, steps, layers, k]: each step's input token's experts (record_routes)


class PagedDecoder(FusedModel):
    """Generates for many requests at once over a paged KV cache (see the module doc)."""

    def __init__(self, model, *, max_rows: int = 256, kv_cache_gb: float | None = None,
                 page_size: int = DEFAULT_PAGE_SIZE, cuda_graphs: bool | None = None, compile: bool | None = None,
                 sync_every: int = 16, prefill_tokens: int = 16384, attention: str = "auto",
                 overlap_chunks: bool = True, gpu_memory_gb: float | None = None, lora=None,
                 shared_base: dict | None = None, deterministic: bool = True, weights_dtype: str = "bf16",
                 drop_bf16: bool = True, record_routes: bool = False, cascade: bool = False,
                 true_on_policy: bool = False, expert_shard=None):
        """attention: "auto" (the Triton kernel on CUDA where it applies, else the PyTorch reference),
        "triton" or "reference". overlap_chunks: queue the next decode chunk before reading the last one
        (the tokens are the same either way; off only to measure what it saves). gpu_memory_gb: the card
        the run's plan is for (`cluster.gpu_memory_gb`), named when the device runs out of memory. lora,
        shared_base, weights_dtype, drop_bf16: `FusedModel`'s (the adapters' buffers and the FP8 weights are static:
        the captured graphs read them as they are updated). record_routes (``rollout.routing_replay``): each token's
        experts per MoE layer come back with the tokens (`routes`). cascade (``rollout.cascade_attention``): a group's
        prompt pages read once per step for all its live rows (the module doc). true_on_policy
        (``rollout.true_on_policy``): the batch-invariant forward, attention and log-prob the trainer computes too
        (runtime/kernels/batch_invariant.py): decode and prefill attention both by `common_decode` / `common_prefill`;
        not with cascade (another order of sums). expert_shard (``rollout.expert_shards``): this engine's shard of
        the experts (runtime/rollout/expert_shards.py); the replica's engines run this loop in step, so its pool is the
        smallest engine's and a failed speed feature is raised, not switched off here alone."""
        super().__init__(model, compile=compile, lora=lora, shared_base=shared_base, deterministic=deterministic,
                         settle_rows=max_rows, weights_dtype=weights_dtype, drop_bf16=drop_bf16,
                         record_routes=record_routes, true_on_policy=true_on_policy, expert_shard=expert_shard)
        self.last_routes: list[torch.Tensor | None] = []  # per request of the last call (`_generate`)
        cuda = self.device.type == "cuda"
        self.max_rows = int(max_rows)
        self.kv_cache_gb = kv_cache_gb
        self.page_size = int(page_size)
        self.sync_every = int(sync_every)
        self.prefill_tokens = int(prefill_tokens)
        self.overlap_chunks = bool(overlap_chunks)
        self.use_flash = cuda and self.dtype in (torch.bfloat16, torch.float16)  # prefill
        # the kernel tiles the head dimension whole (a power of two, >= 16 for tensor-core dots)
        fits_kernel = triton_available() and self.hd >= 16 and self.hd & (self.hd - 1) == 0
        if attention not in ("auto", "triton", "reference"):
            raise ValueError(f"attention must be auto, triton or reference, got {attention!r}")
        self.use_triton = fits_kernel and (attention == "triton" or (attention == "auto" and self.use_flash))
        self.split_tokens: int | None = None  # the kernel's tokens per split; None: chosen per chunk
        self._chunk_split_tokens = 4096
        self._chunk_prompt_split_tokens = 4096  # cascade: the prompt pass's (`set_groups`)
        self.use_graphs = cuda if cuda_graphs is None else bool(cuda_graphs and cuda)
        self.gpu_memory_gb = gpu_memory_gb
        self._paged_attention = guarded("triton", paged_decode_attention)
        if cascade and true_on_policy:
            raise ConfigError("rollout.cascade_attention sums a row's attention in another order than the trainer: "
                              "set rollout.cascade_attention: false with rollout.true_on_policy")
        self.cascade = bool(cascade)
        self.group_rows = group_rows_for(self.nh // self.nkv)
        self._cascade_attention = guarded("triton", cascade_decode_attention)
        self._flash = guarded("flash", _flash)
        if self.true_on_policy:  # the attention the trainer runs, whatever the rows: one per side would differ
            from runtime.kernels.batch_invariant import common_decode, common_prefill
            self._paged_attention, self.use_triton = common_decode, True
            self._flash, self.use_flash = common_prefill, True
        self._pool_budget = 0  # bytes the pool was last made with (or was being made with)
        self.pool: PagePool | None = None
        self.k_pool = self.v_pool = None
        self.rows = self.prefix_cols = self.own_cols = 0
        self.graphs: dict = {}
        self.stats: dict = {}
        self.trace: list | None = None  # set to [] to record every decode chunk

    # ---- memory ----------------------------------------------------------------------------------------
    def page_bytes(self) -> int:
        return self.page_size * self.kv_bytes_per_token()

    def kv_cache_bytes(self) -> int:
        return 0 if self.k_pool is None else 2 * self.k_pool.numel() * self.k_pool.element_size()

    def ensure_pool(self) -> None:
        """Make the page pool if there is none: `kv_cache_gb` GiB, or (None) its default (`kv_pool_bytes`).
        All or nothing: a pool that could not be made whole leaves none behind."""
        if self.pool is not None:
            return
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        self._pool_budget = kv_pool_bytes(self.kv_cache_gb, self.device.type, free)
        pages = self._pool_budget // self.page_bytes()
        if self.expert_shard is not None:  # the replica's engines admit and preempt alike: the same pages each
            pages = self.expert_shard.smallest(pages)
        if pages < 2:
            raise MemoryPlanError(f"KV page pool: {self._pool_budget / 2**30:.3f} GiB holds no page of {self.page_size} "
                                  f"tokens ({self.page_bytes()} bytes); raise rollout.kv_cache_gb")
        shape = (self.n_layers, int(pages), self.page_size, self.nkv, self.hd)
        self.graphs.clear()  # they point into the old pool
        try:
            k_pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v_pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        except Exception as e:  # noqa: BLE001 - out of memory is reported with the plan's numbers
            k_pool = v_pool = None  # a half that was made is not this engine's "else allocated" in the report
            if is_out_of_memory(e):
                raise self.out_of_memory(e) from e
            raise
        self.k_pool, self.v_pool, self.pool = k_pool, v_pool, PagePool(int(pages), self.page_size)

    def release(self) -> None:
        """Drop the page pool and the captured graphs (made again by the next call)."""
        self.graphs.clear()
        self.k_pool = self.v_pool = None
        self.pool = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _ensure_rows(self, prefix_cols: int, own_cols: int) -> None:
        """The per-row device buffers (static: CUDA graphs read them), with a page table wide enough."""
        if self.rows == self.max_rows and self.prefix_cols >= prefix_cols and self.own_cols >= own_cols:
            return
        self.graphs.clear()
        n, dev = self.max_rows, self.device
        self.prefix_cols = max(prefix_cols, self.prefix_cols)
        self.own_cols = max(own_cols, self.own_cols)
        self.rows = n
        self.table = torch.zeros(n, self.prefix_cols + self.own_cols, dtype=torch.int32, device=dev)  # NULL_PAGE
        self.tok = torch.zeros(n, dtype=torch.long, device=dev)       # the input token of the next step
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)       # its absolute position
        self.plen = torch.zeros(n, dtype=torch.long, device=dev)      # prompt length of the row
        self.spos = torch.zeros(n, dtype=torch.long, device=dev)      # response position of the token to draw
        self.live = torch.zeros(n, dtype=torch.long, device=dev)      # 1 while the row decodes, 0 idle
        self.key_hash = torch.zeros(n, dtype=torch.long, device=dev)
        # cascade: each line the rows (-1: none) reading one prompt's pages, written before every chunk (`set_groups`)
        self.groups = torch.full((n, self.group_rows), -1, dtype=torch.int32, device=dev)
        # two chunks' columns: one chunk writes its half while the host reads the other's
        self.out_tok = torch.zeros(n, 2 * self.sync_every, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(n, 2 * self.sync_every, dtype=torch.float32, device=dev)
        self.chunk_i = torch.zeros(1, dtype=torch.long, device=dev)
        route_shape = (self.n_layers, self.topk)
        if self.record_routes:  # each step's input token's experts, beside its sampled token
            self.out_routes = torch.zeros(n, 2 * self.sync_every, *route_shape, dtype=self.routes_dtype, device=dev)
        if dev.type == "cuda":  # where each half's tokens land on the host (pinned: the copy does not wait)
            self.host_tok = torch.zeros(2, n, self.sync_every, dtype=torch.long, pin_memory=True)
            self.host_lp = torch.zeros(2, n, self.sync_every, dtype=torch.float32, pin_memory=True)
            if self.record_routes:
                self.host_routes = torch.zeros(2, n, self.sync_every, *route_shape, dtype=self.routes_dtype,
                                               pin_memory=True)

    def _on_device(self, values: list[int]) -> torch.Tensor:
        """A long tensor on the engine's device, copied without waiting for the work already queued (a
        plain `torch.tensor(..., device=cuda)` would wait for the chunk in flight)."""
        t = torch.tensor(values, dtype=torch.long)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    # ---- forward pieces --------------------------------------------------------------------------------
    def _prefill(self, ids: torch.Tensor, lens: list[int], write_idx: torch.Tensor, want: list[int]):
        """Packed sequences (each from position 0) -> K/V written at `write_idx` (flat [page * page_size +
        offset] per token; the null page for positions already held elsewhere); returns the hidden states at
        the packed indices `want`, and with `record_routes` every packed token's experts [T, layers, k] on the
        host (else None)."""
        dev = self.device
        pos = torch.cat([torch.arange(n, device=dev) for n in lens])
        cu = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.int32, device=dev)
        cos, sin = self.rope_tables(pos)
        h = F.embedding(ids, self.embed)
        routes = []
        for li, w in enumerate(self.layers):
            q, k, v = self._pre(h, w.ln1, w.qkv_w, w.qkv_b, w.qn, w.kn, cos, sin, w.qkv_s, *w.pre_lora)
            self.k_pool[li].view(-1, self.nkv, self.hd).index_copy_(0, write_idx, k)
            self.v_pool[li].view(-1, self.nkv, self.hd).index_copy_(0, write_idx, v)
            if self.use_flash:
                a = self._flash(q, k, v, cu, cu, max(lens), max(lens), True, self.scale)
            else:
                a = _sdpa_prefill(q, k, v, lens, self.scale)
            h, experts = self._layer_post(h, a.reshape(h.shape[0], -1), w)
            routes.append(experts)
        routes = torch.stack(routes, 1).to(self.routes_dtype).cpu() if self.record_routes else None
        return h.index_select(0, torch.tensor(want, dtype=torch.long, device=dev)), routes

    def _step(self, b: int, sample_fn: Callable) -> None:
        """One decode step for rows [0, b): every tensor it touches is a static buffer (graph-safe)."""
        P = self.page_size
        tok, pos, plen = self.tok[:b], self.pos[:b], self.plen[:b]
        table = self.table[:b]
        own = pos - plen  # the input token's place among the row's own tokens
        col = self.prefix_cols + torch.clamp(own // P, max=self.own_cols - 1)
        page = table.gather(1, col[:, None]).squeeze(1).to(torch.long)
        widx = page * P + own % P
        cos, sin = self.rope_tables(pos)
        h = F.embedding(tok, self.embed)
        routes = []
        for li, w in enumerate(self.layers):
            q, k, v = self._pre(h, w.ln1, w.qkv_w, w.qkv_b, w.qn, w.kn, cos, sin, w.qkv_s, *w.pre_lora)
            kc, vc = self.k_pool[li], self.v_pool[li]
            kc.view(-1, self.nkv, self.hd).index_copy_(0, widx, k)
            vc.view(-1, self.nkv, self.hd).index_copy_(0, widx, v)
            if self.cascade and self.use_triton:
                a = self._cascade_attention(q, kc, vc, table, plen, own + 1, self.prefix_cols, self.groups[:b],
                                            self.scale, split_tokens=self._chunk_split_tokens,
                                            prompt_split_tokens=self._chunk_prompt_split_tokens)
            elif self.cascade:
                a = reference_cascade_decode_attention(q, kc, vc, table, plen, own + 1, self.prefix_cols,
                                                       self.groups[:b], self.scale)
            elif self.use_triton:
                a = self._paged_attention(q, kc, vc, table, plen, own + 1, self.prefix_cols, self.scale,
                                          split_tokens=self._chunk_split_tokens)
            else:
                a = reference_paged_decode_attention(q, kc, vc, table, plen, own + 1, self.prefix_cols, self.scale)
            h, experts = self._layer_post(h, a.reshape(b, -1), w)
            routes.append(experts)
        if self.record_routes:
            self.out_routes[:b].index_copy_(1, self.chunk_i, torch.stack(routes, 1).to(self.routes_dtype)[:, None])
        logits = self._head(h, self.norm, self.lm)
        t, lp = sample_fn(logits, self.key_hash[:b], self.spos[:b])
        self.out_tok[:b].index_copy_(1, self.chunk_i, t[:, None])
        self.out_lp[:b].index_copy_(1, self.chunk_i, lp.to(torch.float32)[:, None])
        tok.copy_(t)
        # an idle row stays at one token on the null page (its attention work does not grow with the steps)
        live = self.live[:b]
        pos.add_(live)
        self.spos[:b].add_(live)
        self.chunk_i.add_(1)

    def set_groups(self, rows: list[int], keys: list, b: int, longest_prompt: int) -> None:
        """Write the group table for a step over rows [0, b): the rows among `rows` with the same key (their prompt)
        are one group, cut into lines of `group_rows` in row order; the other lines empty. Queued on the stream like
        the other writes between chunks, so a chunk already queued keeps the table it was launched with. Picks the
        prompt pass's split for that many lines of prompts up to `longest_prompt` tokens."""
        by_key: dict = {}
        for s, key in sorted(zip(rows, keys), key=lambda x: x[0]):
            by_key.setdefault(key, []).append(s)
        lines = [members[i:i + self.group_rows] for members in by_key.values()
                 for i in range(0, len(members), self.group_rows)]
        flat = [-1] * (b * self.group_rows)
        for i, line in enumerate(lines):
            flat[i * self.group_rows:i * self.group_rows + len(line)] = line
        self.groups[:b].view(-1).copy_(self._on_device(flat))
        self._chunk_prompt_split_tokens = self.split_tokens or split_tokens_for(len(lines), self.nkv, longest_prompt,
                                                                                self.device)

    def _buckets(self) -> list[int]:
        out, b = [], 8
        while b < self.rows:
            out.append(b)
            b = b * 2 if b < 64 else b + 64
        return out + [self.rows]

    def _run_step(self, b: int, sample_fn: Callable, skey) -> None:
        if not self.use_graphs:
            self._step(b, sample_fn)
            return
        splits = (self._chunk_split_tokens, self._chunk_prompt_split_tokens if self.cascade else None)
        key = (b, skey, splits if self.use_triton else None, self.cascade)
        try:
            g = self.graphs.get(key)
            if g is not None:
                g.replay()
            else:
                self.graphs[key] = self._capture(b, sample_fn)
                self.stats["graphs"] = len(self.graphs)
        except Exception as e:  # noqa: BLE001 - named the graphs' failure unless it is another's or memory
            failure = as_feature_failure("cuda_graphs", e)
            if failure is e:
                raise
            raise failure from e

    def _capture(self, b: int, sample_fn: Callable):
        """The first step of a shape: run for real on a side stream (compiles, warms cuBLAS), then captured
        into the CUDA graph returned (which later steps replay)."""
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            self._step(b, sample_fn)
        torch.cuda.current_stream(self.device).wait_stream(s)
        t0 = time.perf_counter()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle()):  # a fresh pool per capture
            self._step(b, sample_fn)
        self.stats["graph_capture_s"] = self.stats.get("graph_capture_s", 0.0) + time.perf_counter() - t0
        return g

    # ---- the loop --------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], key_hash: torch.Tensor, sampling, stop_ids: set[int],
                 stop_at: list[int] | None = None, prefixes: list[tuple[list[int], list[float]]] | None = None,
                 until=None, prefix_routes: list[torch.Tensor | None] | None = None):
        """Returns (response ids, response log-probs, finish reasons), one per prompt, in order.

        prefixes: per request, the response tokens it already has and their log-probs (a continued sample:
        admitted like a preempted one, its tokens recomputed into the cache). until (`base.GroupsDone`): stop
        at the end of the first decode chunk after which enough groups are complete; the others come back
        as "abort" with their tokens so far.

        stop_at (benchmarks): per request, the response length at which it stops; its token there is
        replaced by the smallest stop id, so that runs compared with each other make the same tokens.

        The call is `steps` driven to its end, asking `until` at every check point.
        """
        run = self.steps(prompts, key_hash, sampling, stop_ids, stop_at, prefixes, prefix_routes)
        try:
            done = next(run)
            while True:
                done = run.send(until is not None and until.reached(done))
        except StopIteration as end:
            return end.value

    def steps(self, prompts: list[list[int]], key_hash: torch.Tensor, sampling, stop_ids: set[int],
              stop_at: list[int] | None = None, prefixes: list[tuple[list[int], list[float]]] | None = None,
              prefix_routes: list[torch.Tensor | None] | None = None):
        """`generate` one check point at a time, for a caller that decides when to stop (one engine's
        `until`, or a pool of engines stepping together): a generator that yields, before each round of
        the decode loop (an admission or a decode chunk), every request's done flag (finished: stop or
        length); send it True to stop there (the unfinished come back as "abort"), False to go on. Returns
        what `generate` returns. Where it yields depends only on the requests, the settings and the weights.

        If a speed feature fails at run time (the compiler, graph capture, the Triton or flash kernel:
        `speed_features.SpeedFeatureFailed`), it is switched off, the failure is kept in
        `stats["fallbacks"]`, and the call is redone up to the check point it had reached (every sample is
        a pure function of its key, so the redone rounds make what the first made, and the caller is not
        asked again). Running out of device memory switches nothing off: it is raised as one
        `MemoryPlanError` with the plan's numbers (`out_of_memory`); any other error as it is.
        """
        answered, stop = 0, False  # check points answered "go on"; whether the caller said stop
        while True:
            run = self._generate(prompts, key_hash, sampling, stop_ids, stop_at, prefixes, prefix_routes)
            try:
                done = next(run)
                for _ in range(answered):  # a redone call: the rounds already answered again
                    done = run.send(False)
                while True:
                    if not stop:
                        stop = bool((yield done))
                        answered += 0 if stop else 1
                    done = run.send(stop)
            except StopIteration as end:
                return end.value
            except SpeedFeatureFailed as failed:
                if not self._switch_off(failed.feature, failed.error):
                    raise failed.error from None  # nothing left to fall back to
            except MemoryError:  # the pool's own errors (already with the numbers), the host's
                raise
            except Exception as e:
                if is_out_of_memory(e):
                    raise self.out_of_memory(e) from e
                raise
            finally:
                run.close()  # a call left midway gives its pages back (its own `finally`)

    def _switch_off(self, feature: str, error: BaseException) -> bool:
        """Switch a failed speed feature off (False: it was off already, nothing to fall back to)."""
        on = {"compile": self.compiled, "cuda_graphs": self.use_graphs, "triton": self.use_triton,
              "flash": self.use_flash}[feature]
        if not on or self.expert_shard is not None:  # a shard alone without it would leave its replica's step
            return False
        log.warning("paged decode: %s failed (%s: %s); retrying without it", feature, type(error).__name__, error)
        self.stats.setdefault("fallbacks", []).append(f"{feature}: {type(error).__name__}: {str(error)[:300]}")
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
        return True

    def out_of_memory(self, error: BaseException) -> MemoryPlanError:
        """The error to raise for the device running out of memory: one line with the pool, the engine's
        weights, what else was allocated (a colocated trainer's state left on the GPU, say), the card, and
        the settings that change them."""
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        dev = self.device
        error = out_of_memory_error(error) or error  # the allocator's own words, where a compiler wrapped them
        asked = re.search(r"[Tt]ried to allocate ([0-9.]+ [KMGT]?i?B)", str(error))
        pool = self.kv_cache_bytes() or self._pool_budget
        where = "rollout.kv_cache_gb" if self.kv_cache_gb is not None else \
            f"{KV_FREE_FRACTION:.0%} of the free memory: rollout.kv_cache_gb unset"
        parts = [f"KV pool {gib(pool)} ({where}{'' if self.k_pool is not None else ', being allocated'})",
                 f"engine weights {gib(self.weight_bytes)}"]
        card = []
        if dev.type == "cuda":
            try:
                allocated, reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
                free, total = torch.cuda.mem_get_info(dev)
            except Exception:  # noqa: BLE001 - a broken context: the message goes without these numbers
                pass
            else:
                other = max(allocated - self.weight_bytes - self.kv_cache_bytes(), 0)
                parts += [f"{gib(other)} else allocated on {dev} (e.g. a colocated trainer's state left on the GPU)",
                          f"{gib(allocated)} allocated and {gib(reserved)} reserved in all",
                          # a trainer in another process (Ray, several ranks) is not in this process's numbers
                          f"{gib(max(total - free - reserved, 0))} held by other processes and CUDA contexts, "
                          f"{gib(free)} free"]
                card.append(f"the device has {gib(total)}")
        card.append(f"the plan is for a {self.gpu_memory_gb:g} GiB card (cluster.gpu_memory_gb)"
                    if self.gpu_memory_gb is not None else
                    "cluster.gpu_memory_gb unset (the plan took the GPU of the machine the run started on, else 80 GiB)")
        return MemoryPlanError(
            f"rollout engine: out of device memory on {dev}" + (f" (tried to allocate {asked.group(1)})" if asked else "")
            + f" ({type(error).__name__}): " + "; ".join(parts) + "; " + ", ".join(card)
            + ". Lower rollout.kv_cache_gb, set cluster.offload_trainer_state: on (the trainer's state off the "
            "GPU while the engine generates), or set cluster.gpu_memory_gb to this card's size and check the "
            "plan with grpoflow validate")

    @torch.inference_mode()
    def _generate(self, prompts, key_hash, sampling, stop_ids, stop_at, prefixes=None, prefix_routes=None):
        """`steps`' one attempt: a generator yielding the done flags at every check point (send True to stop).

        With `record_routes` it leaves in `last_routes`, per request, the experts [tokens, layers, k] of every token it
        has run (the prompt's, the response's but its last), on the host, starting with `prefix_routes` (a continued
        request's, recorded before). A position keeps the first route recorded for it: the one its next token was
        drawn under. A preempted request's recompute (prompt and tokens so far, a prefill where they were decode
        steps) and a continued request's prefill record nothing where a route is held (at a near-tie of two experts
        the recompute may round the other way: another kernel, another batch)."""
        n = len(prompts)
        P = self.page_size
        max_new = int(sampling.max_new_tokens)
        cap = [max_new if stop_at is None else max(1, min(max_new, int(stop_at[r]))) for r in range(n)]
        forced_stop = min(stop_ids) if stop_ids else 0
        t_start = time.perf_counter()
        self.ensure_pool()
        self._ensure_rows(pages_for(max(len(p) for p in prompts), P), pages_for(max_new + self.sync_every, P))
        pool, R, dev = self.pool, self.rows, self.device
        step_fn, skey, prefill_fn = self._sampler(sampling)
        self.settle_compiled(((("step", skey), step_fn), (("prefill", skey), prefill_fn)))
        key_hash = key_hash.to(dev)
        out_ids: list[list[int]] = [[] for _ in range(n)]
        out_lp: list[list[float]] = [[] for _ in range(n)]
        finish = ["length"] * n
        done = [False] * n  # finished (stop or length); at the end the others are "abort"
        for r, (ids, lps) in enumerate(prefixes or []):
            out_ids[r], out_lp[r] = list(ids[:cap[r]]), list(lps[:cap[r]])
            if out_ids[r] and out_ids[r][-1] in stop_ids:
                finish[r] = "stop"
            done[r] = finish[r] == "stop" or len(out_ids[r]) >= cap[r]
        # record_routes: each request's routes so far (host tensors in position order) and how many positions they cover
        routes: list[list[torch.Tensor]] = [[] for _ in range(n)]
        n_routed = [0] * n
        prefix_routes_of: dict[tuple, torch.Tensor] = {}  # a held prompt's routes (every sample of the group takes them)
        if self.record_routes:
            for r, rows in enumerate(prefix_routes or []):
                if rows is not None:  # a continued request's: its prompt and the tokens it keeps but the last
                    rows = rows[:len(prompts[r]) + max(len(out_ids[r]) - 1, 0)]
                    routes[r], n_routed[r] = [rows], len(rows)

        def record(r: int, start: int, rows: torch.Tensor | None) -> None:
            """Routes of request r's positions start, start + 1, ...: those it has none for yet (the first stands)."""
            if rows is None or start + len(rows) <= n_routed[r]:
                return
            if start > n_routed[r]:
                raise RuntimeError(f"routing replay: request {r} has routes for {n_routed[r]} positions, got some from "
                                   f"{start} on")
            routes[r].append(rows[n_routed[r] - start:])
            n_routed[r] = start + len(rows)

        row_req = [-1] * R                       # request decoding in each row
        row_own: list[list[int]] = [[] for _ in range(R)]   # each row's own pages, in order
        row_key: list[tuple | None] = [None] * R            # the prompt (prefix) each row reads
        prefix_pages: dict[tuple, list[int]] = {}
        prefix_refs: dict[tuple, int] = {}
        prefix_h: dict[tuple, torch.Tensor] = {}  # a prompt's last hidden state (draws a sample's first token)
        queue = [r for r in range(n) if not done[r]]
        queue.reverse()  # pop() from the end takes requests in order
        stats = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "row_steps": 0, "chunks": 0, "rows": R,
                 "pages": pool.num_pages, "page_size": P, "max_active": 0, "prefills": 0, "prefill_tokens": 0,
                 "prefill_pack_max": 0, "preemptions": 0, "reprefill_tokens": 0, "peak_pages_used": 0, "compactions": 0,
                 "queued_ahead": 0}
        pool.peak_used = pool.used
        self.stats.update(stats)
        stats = self.stats  # live: a failed call leaves what it got to
        for buf in (self.pos, self.plen, self.live):  # every row idle (an earlier call may have stopped midway)
            buf.zero_()
        self.table.zero_()

        def take(r: int, toks: list[int], lps: list[float], step_routes: torch.Tensor | None = None) -> bool:
            """Append a chunk's tokens to a request up to its stop; True when it finished. step_routes: the experts of
            each step's input token (the token before each of `toks`)."""
            room = cap[r] - len(out_ids[r])
            toks, lps = toks[:room], lps[:room]
            stop = next((i for i, t in enumerate(toks) if t in stop_ids), None) if stop_ids else None
            if stop is not None:
                toks, lps = toks[:stop + 1], lps[:stop + 1]
            if step_routes is not None:
                record(r, len(prompts[r]) + len(out_ids[r]) - 1, step_routes[:len(toks)])
            out_ids[r].extend(toks)
            out_lp[r].extend(lps)
            if stop is not None:
                finish[r] = "stop"
                done[r] = True
                return True
            if len(out_ids[r]) < cap[r]:
                return False
            if cap[r] < max_new:  # a benchmark's forced stop (stop_at)
                out_ids[r][-1] = forced_stop
                finish[r] = "stop"
            done[r] = True
            return True

        def unref_prefix(key: tuple) -> None:
            prefix_refs[key] -= 1
            if prefix_refs[key] == 0:
                pool.release(prefix_pages.pop(key))
                del prefix_refs[key]
                prefix_h.pop(key, None)
                prefix_routes_of.pop(key, None)

        def vacate(rows: list[int]) -> None:
            """Rows give back their pages and go idle (attend to one token on the null page)."""
            for s in rows:
                pool.release(row_own[s])
                row_own[s] = []
                unref_prefix(row_key[s])
                row_key[s] = None
                row_req[s] = -1
            if rows:
                idx = self._on_device(rows)
                for buf in (self.pos, self.plen, self.live):
                    buf.index_fill_(0, idx, 0)
                self.table.index_fill_(0, idx, NULL_PAGE)

        def kv_held(s: int) -> int:
            """Own K/V entries a row has written: all its tokens but the last (the next step's input)."""
            return len(out_ids[row_req[s]]) - 1

        def growth(s: int, steps: int) -> int:
            return max(pages_for(kv_held(s) + steps, P) - len(row_own[s]), 0)

        def give_pages(s: int, count: int) -> tuple[list[int], list[int]]:
            """`count` more own pages for row s; returns their (table columns, pages)."""
            new = pool.alloc(count)
            first = len(row_own[s])
            row_own[s].extend(new)
            return [self.prefix_cols + first + i for i in range(count)], new

        def compact(active: list[int], b: int) -> list[int]:
            """Move the active rows at or above row b into the free rows below it (device state, page table and
            bookkeeping); returns the active rows, now all below b."""
            free = [s for s in range(b) if row_req[s] < 0]
            moving = [s for s in active if s >= b]
            src = torch.tensor(moving, dtype=torch.long, device=dev)
            dst = torch.tensor(free[:len(moving)], dtype=torch.long, device=dev)
            for buf in (self.tok, self.pos, self.plen, self.spos, self.live, self.key_hash, self.table):
                buf.index_copy_(0, dst, buf.index_select(0, src))
            for buf in (self.pos, self.plen, self.live):
                buf.index_fill_(0, src, 0)
            self.table.index_fill_(0, src, NULL_PAGE)
            for a, d in zip(moving, free):
                row_req[d], row_own[d], row_key[d] = row_req[a], row_own[a], row_key[a]
                row_req[a], row_own[a], row_key[a] = -1, [], None
            stats["compactions"] += 1
            return [s for s in active if s < b] + free[:len(moving)]

        def write_table(entries: list[tuple[int, int, int]]) -> None:
            if entries:
                e = self._on_device(entries)
                self.table[e[:, 0], e[:, 1]] = e[:, 2].to(torch.int32)

        def grant_pages(counts: dict[int, int]) -> None:
            """Give each row s `counts[s]` more own pages and write them into the page table."""
            entries = []
            for s, count in counts.items():
                if count:
                    cols, pages = give_pages(s, count)
                    entries += [(s, c, p) for c, p in zip(cols, pages)]
            write_table(entries)

        S = self.sync_every
        cuda = dev.type == "cuda"
        last_read = time.perf_counter()  # when the host last had a chunk's tokens
        chunks_read = 0

        def launch(active: list[int], b: int, steps: int, ahead: int) -> _Chunk:
            """Queue `steps` decode steps over rows [0, b) and the copy of their tokens to the host; nothing
            waits. ahead: steps already queued for these rows and not yet read."""
            longest = max(len(prompts[row_req[s]]) + len(out_ids[row_req[s]]) for s in active) + ahead + steps
            self._chunk_split_tokens = self.split_tokens or split_tokens_for(len(active), self.nkv, longest, dev)
            if self.cascade:
                self.set_groups(active, [row_key[s] for s in active], b, max(len(row_key[s]) for s in active))
            half = stats["chunks"] % 2
            t0 = time.perf_counter()
            self.chunk_i.fill_(half * S)
            for _ in range(steps):
                self._run_step(b, step_fn, skey)
            cols = slice(half * S, half * S + steps)
            event = None
            step_routes = None
            if cuda:
                tok, lp = self.host_tok[half, :b, :steps], self.host_lp[half, :b, :steps]
                tok.copy_(self.out_tok[:b, cols], non_blocking=True)
                lp.copy_(self.out_lp[:b, cols], non_blocking=True)
                if self.record_routes:
                    step_routes = self.host_routes[half, :b, :steps]
                    step_routes.copy_(self.out_routes[:b, cols], non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            else:
                tok, lp = self.out_tok[:b, cols], self.out_lp[:b, cols]
                if self.record_routes:
                    step_routes = self.out_routes[:b, cols]
            stats["decode_steps"] += steps
            stats["row_steps"] += steps * b
            stats["chunks"] += 1
            stats["max_active"] = max(stats["max_active"], len(active))
            return _Chunk(rows=[(s, row_req[s]) for s in active], bucket=b, steps=steps, tok=tok, lp=lp,
                          event=event, launched=t0, first_step=stats["decode_steps"] - steps, pages_used=pool.used,
                          routes=step_routes)

        def read(chunk: _Chunk) -> None:
            """Wait for a chunk's tokens and hand them to their requests; rows that finished go idle."""
            nonlocal last_read, chunks_read
            if chunk.event is not None:
                chunk.event.synchronize()
            toks, lps = chunk.tok.tolist(), chunk.lp.tolist()
            now = time.perf_counter()
            dt = now - max(chunk.launched, last_read)
            last_read = now
            stats["decode_s"] += dt
            if self.trace is not None:  # (decode steps before it, active rows, bucket, steps, ms/step, pages used)
                self.trace.append((chunk.first_step, len(chunk.rows),
                                   chunk.bucket, chunk.steps, round(1e3 * dt / chunk.steps, 3), chunk.pages_used))
            # a row vacated after this chunk was queued made its tokens for nobody
            # (the routes are copied: the host buffer's half is written again two chunks on)
            vacate([s for s, r in chunk.rows if row_req[s] == r and take(
                r, toks[s], lps[s], None if chunk.routes is None else chunk.routes[s].clone())])
            chunks_read += 1
            moment("decode-chunk", chunks_read)  # mid-generation: rows live and holding pages, maybe a chunk queued

        def follow(chunk: _Chunk) -> _Chunk | None:
            """The chunk after `chunk`, queued before `chunk` is read, so the device does not wait for the host:
            the same rows (those that stop in `chunk` make tokens nobody takes) in the same bucket. None when
            the round after `chunk` has host work to do first: requests to admit, a smaller bucket, no
            tokens left to make, or pages that only preemption would free."""
            rows = [s for s, r in chunk.rows if row_req[s] == r]
            if not self.overlap_chunks or queue or not rows:
                return None
            if next(x for x in self._buckets() if x >= len(rows)) < chunk.bucket:
                return None
            left = {s: cap[row_req[s]] - len(out_ids[row_req[s]]) for s in rows}  # tokens each may still make
            steps = min(S, max(left.values()) - chunk.steps)
            if steps <= 0:
                return None
            # a row that reaches its cap in `chunk` gets no page for after it: what it writes then lands on
            # its own last page or the null page, and nobody reads it
            more = {s: growth(s, min(chunk.steps + steps, left[s])) for s in rows}
            if sum(more.values()) > pool.free:
                return None
            grant_pages(more)
            stats["queued_ahead"] += 1
            return launch(rows, chunk.bucket, steps, chunk.steps)

        pending: _Chunk | None = None  # a queued chunk whose tokens are not read yet
        try:
            while queue or any(r >= 0 for r in row_req):
                if pending is not None:
                    queued, pending = pending, None
                    pending = follow(queued)
                    read(queued)
                    if pending is not None and (yield list(done)):
                        break
                    continue
                if (yield list(done)):
                    break  # the caller stops here (enough groups complete): the rest are returned as they are
                active = [s for s in range(R) if row_req[s] >= 0]
                # ---- admit queued requests while rows and pages are free ------------------------------------
                free_rows = [s for s in range(R) if row_req[s] < 0]
                if queue and free_rows:
                    t0 = time.perf_counter()
                    reserve = sum(growth(s, self.sync_every) for s in active)
                    assign = []  # (row, request)
                    seqs: list[tuple[list[int], list[int], int | None]] = []  # (tokens, write index, want index)
                    seq_prefix: list[tuple | None] = []  # the new prefix whose hidden state a sequence gives
                    seq_req: list[int] = []  # the request each sequence is
                    budget = self.prefill_tokens
                    table_entries: list[tuple[int, int, int]] = []
                    while queue and len(assign) < len(free_rows):
                        r = queue[-1]
                        key = tuple(prompts[r])
                        made = len(out_ids[r])  # > 0: a preempted request, continued by recompute
                        new_prefix = key not in prefix_pages
                        own_now = pages_for(max(made - 1, 0), P)
                        need = (pages_for(len(key), P) if new_prefix else 0) + pages_for(max(made - 1, 0)
                                                                                         + self.sync_every, P)
                        if need > pool.free - reserve:
                            if not active and not assign:
                                raise MemoryPlanError(
                                    f"KV page pool: one sequence of {len(key)} prompt + {made} tokens needs {need} "
                                    f"pages of {P} tokens, the pool has {pool.free} free of {pool.capacity} "
                                    f"({self.kv_cache_bytes() / 2**30:.3f} GiB); raise rollout.kv_cache_gb")
                            break
                        # what the row prefills: nothing for a fresh row whose group's prompt is held; otherwise its
                        # prompt (recomputed even where its group holds the pages: written to the null page) and
                        # the tokens it made
                        prefill_len = len(key) + max(made - 1, 0) if new_prefix or made > 1 else 0
                        if seqs and prefill_len > budget:
                            break
                        queue.pop()
                        s = free_rows[len(assign)]
                        assign.append((s, r))
                        row_req[s], row_key[s] = r, key
                        if new_prefix:
                            prefix_pages[key] = pool.alloc(pages_for(len(key), P))
                            prefix_refs[key] = 0
                        prefix_refs[key] += 1
                        table_entries += [(s, c, p) for c, p in enumerate(prefix_pages[key])]
                        cols, pages = give_pages(s, own_now)
                        table_entries += [(s, c, p) for c, p in zip(cols, pages)]
                        reserve += pages_for(max(made - 1, 0) + self.sync_every, P) - own_now  # its first chunk
                        if prefill_len:
                            # prompt positions go to the new prefix's pages or (already held) to the null page;
                            # the tokens made before the preemption go to the row's own pages
                            ppages = prefix_pages[key]
                            pw = [ppages[t // P] * P + t % P if new_prefix else NULL_PAGE * P + t % P
                                  for t in range(len(key))]
                            ow = [row_own[s][t // P] * P + t % P for t in range(made - 1)] if made > 1 else []
                            toks = list(key) + out_ids[r][:max(made - 1, 0)]
                            seqs.append((toks, pw + ow, len(key) - 1 if new_prefix else None))
                            seq_prefix.append(key if new_prefix else None)
                            seq_req.append(r)
                            budget -= len(toks)
                            if made:
                                stats["reprefill_tokens"] += len(toks)
                    if seqs:
                        ids = torch.tensor([t for toks, _, _ in seqs for t in toks], dtype=torch.long, device=dev)
                        widx = torch.tensor([w for _, ws, _ in seqs for w in ws], dtype=torch.long, device=dev)
                        lens = [len(toks) for toks, _, _ in seqs]
                        starts = [0] + list(_cumsum(lens))[:-1]
                        wanted = [(k, st + i) for k, st, (_, _, i) in zip(seq_prefix, starts, seqs) if i is not None]
                        hs, seq_routes = self._prefill(ids, lens, widx, [i for _, i in wanted] or [0])
                        for j, (k, _) in enumerate(wanted):
                            prefix_h[k] = hs[j]
                        if seq_routes is not None:
                            for r, k, part in zip(seq_req, seq_prefix, seq_routes.split(lens)):
                                record(r, 0, part)
                                if k is not None:
                                    prefix_routes_of[k] = part[:len(k)]
                        stats["prefills"] += len(seqs)
                        stats["prefill_tokens"] += sum(lens)
                        stats["prefill_pack_max"] = max(stats["prefill_pack_max"], sum(lens))
                    write_table(table_entries)
                    if self.record_routes:  # a row of a held prompt takes the prompt's routes
                        for _, r in assign:
                            record(r, 0, prefix_routes_of[tuple(prompts[r])])
                    # device state of the admitted rows; a fresh request draws its first token from its prompt
                    fresh = [(s, r) for s, r in assign if not out_ids[r]]
                    if fresh:
                        f_rows = torch.tensor([s for s, _ in fresh], dtype=torch.long, device=dev)
                        f_req = torch.tensor([r for _, r in fresh], dtype=torch.long, device=dev)
                        logits = self._head(torch.stack([prefix_h[tuple(prompts[r])] for _, r in fresh]), self.norm,
                                            self.lm)
                        kh = key_hash.index_select(0, f_req)
                        t, lp = prefill_fn(logits, kh, torch.zeros_like(kh))
                        for (s, r), ti, li in zip(fresh, t.tolist(), lp.float().tolist()):
                            take(r, [ti], [li])
                        self.tok.index_copy_(0, f_rows, t)
                    resumed = [(s, r) for s, r in assign if len(out_ids[r]) and (s, r) not in fresh]
                    if resumed:
                        self.tok.index_copy_(0, torch.tensor([s for s, _ in resumed], dtype=torch.long, device=dev),
                                             torch.tensor([out_ids[r][-1] for _, r in resumed], dtype=torch.long,
                                                          device=dev))
                    a_rows = torch.tensor([s for s, _ in assign], dtype=torch.long, device=dev)
                    a_req = torch.tensor([r for _, r in assign], dtype=torch.long, device=dev)
                    plen = torch.tensor([len(prompts[r]) for _, r in assign], dtype=torch.long, device=dev)
                    made = torch.tensor([len(out_ids[r]) for _, r in assign], dtype=torch.long, device=dev)
                    self.pos.index_copy_(0, a_rows, plen + made - 1)
                    self.plen.index_copy_(0, a_rows, plen)
                    self.spos.index_copy_(0, a_rows, made)
                    self.key_hash.index_copy_(0, a_rows, key_hash.index_select(0, a_req))
                    self.live.index_fill_(0, a_rows, 1)
                    vacate([s for s, r in fresh if finish[r] == "stop" or len(out_ids[r]) >= cap[r]])
                    stats["prefill_s"] += time.perf_counter() - t0
                    if len(assign):
                        continue  # rows may have freed at once (stop on the first token): admit again
                active = [s for s in range(R) if row_req[s] >= 0]
                if not active:
                    continue
                # ---- reserve the chunk's pages (preempting the newest rows if the pool cannot hold them) ----
                steps = min(self.sync_every, max(cap[row_req[s]] - len(out_ids[row_req[s]]) for s in active))
                while sum(growth(s, steps) for s in active) > pool.free:
                    if len(active) == 1:
                        s = active[0]
                        raise MemoryPlanError(
                            f"KV page pool: one sequence of {len(prompts[row_req[s]])} prompt + "
                            f"{kv_held(s) + steps} tokens needs more than the {pool.capacity} pages of {P} tokens "
                            f"({self.kv_cache_bytes() / 2**30:.3f} GiB); raise rollout.kv_cache_gb")
                    # the row with the fewest tokens made: the least work to redo, and the rows that have run
                    # longest (those that make the tail) keep going
                    victim = min(active, key=lambda x: (len(out_ids[row_req[x]]), -row_req[x]))
                    r = row_req[victim]
                    vacate([victim])
                    queue.append(r)
                    queue.sort(reverse=True)  # it is admitted again before every later request
                    stats["preemptions"] += 1
                    active.remove(victim)
                grant_pages({s: growth(s, steps) for s in active})
                # ---- decode the chunk -------------------------------------------------------------------------
                b = next(x for x in self._buckets() if x >= len(active))
                if max(active) >= b:  # rows finished below: move the top ones down, so the step runs b rows
                    active = compact(active, b)
                pending = launch(active, b, steps, 0)
        finally:
            if pending is not None and pending.event is not None:
                pending.event.synchronize()  # a chunk nobody reads still writes into the pool
            # every page goes back, also when the loop failed part-way (the pool outlives the call)
            for s in range(R):
                if row_own[s]:
                    pool.release(row_own[s])
                    row_own[s] = []
            for key in list(prefix_pages):
                pool.release(prefix_pages.pop(key))
            if any(r >= 0 for r in row_req):
                for buf in (self.pos, self.plen, self.live):
                    buf.zero_()
                self.table.zero_()
        pool.check_all_free()
        self.last_routes = [torch.cat(x) if x else None for x in routes]
        finish = [f if d else "abort" for f, d in zip(finish, done)]
        stats["aborted"] = finish.count("abort")
        stats["peak_pages_used"] = pool.peak_used
        stats["total_s"] = time.perf_counter() - t_start
        stats["new_tokens"] = sum(len(x) for x in out_ids)
        stats["graphs"] = len(self.graphs)
        stats["compiled"] = self.compiled
        stats["weights_dtype"] = self.weights_dtype
        stats["cuda_graphs"] = self.use_graphs
        stats["attention"] = ("triton_paged_split_kv" if self.use_triton else "sdpa_paged_reference") \
            + ("_cascade" if self.cascade else "")
        stats["prefill_attention"] = "flash_varlen" if self.use_flash else "sdpa"
        if self.true_on_policy:
            stats["attention"] = stats["prefill_attention"] = "batch_invariant"
        if self.compile_error:
            stats["compile_error"] = self.compile_error
        return out_ids, out_lp, finish


__all__ = ["PagedDecoder"]
