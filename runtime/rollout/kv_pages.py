"""The paged KV cache's pool: its size (a pure function the memory plan shares) and its page allocator.

The engine keeps K and V in fixed-size pages of `page_size` tokens taken from one pool, so a sequence
holds memory for the tokens it has, not for the longest it could become. The pool's size is the
config setting `rollout.kv_cache_gb`; without it, on CUDA the pool takes `KV_FREE_FRACTION` of what
is free on the device when it is made (the weights are loaded by then, and in a colocated run the
trainer's optimizer state has left the GPU), on CPU at most `CPU_KV_POOL_BYTES`.

Page 0 is never handed out: it is the *null page*. Rows that are idle in a CUDA-graph step write
their (unused) K/V there, and a re-prefill writes the prompt positions it does not need there, so
every write of a step has a target without a branch.

`PagePool` is host-side bookkeeping only (lists of ints); the pages themselves are rows of the
decoder's K/V tensors. Pages carry a reference count so the prompt pages of a GRPO group are held
once and shared by every sample of the group.
"""
from __future__ import annotations

DEFAULT_PAGE_SIZE = 16
KV_FREE_FRACTION = 0.85      # without kv_cache_gb, on CUDA: this share of the free GPU memory
CPU_KV_POOL_BYTES = 256 * 2**20
NULL_PAGE = 0

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(hf_config, dtype: str = "bfloat16") -> int:
    """K and V of one token over every layer, in bytes."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    dtype = str(dtype).removeprefix("torch.")
    return 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim * _DTYPE_BYTES[dtype]


def kv_pool_bytes(kv_cache_gb: float | None, device_type: str, free_bytes: int = 0) -> int:
    """The pool's memory budget: `kv_cache_gb` GiB when given; else on CUDA `KV_FREE_FRACTION` of
    `free_bytes` (what is free on the device when the pool is made); else (CPU) `CPU_KV_POOL_BYTES`."""
    if kv_cache_gb is not None:
        return int(kv_cache_gb * 2**30)
    if device_type == "cuda":
        return int(KV_FREE_FRACTION * max(int(free_bytes), 0))
    return CPU_KV_POOL_BYTES


def kv_pool_pages(hf_config, kv_cache_gb: float | None, page_size: int = DEFAULT_PAGE_SIZE, dtype: str = "bfloat16",
                  device_type: str = "cuda", free_bytes: int = 0) -> dict[str, int]:
    """The pool the engine makes (pure: `runtime/plan/memory.py` uses it for the plan). Returns `pages`
    (including the null page), `page_size`, `bytes` (K and V of every page) and `tokens` (what the
    pages other than the null page hold)."""
    per_page = page_size * kv_bytes_per_token(hf_config, dtype)
    pages = kv_pool_bytes(kv_cache_gb, device_type, free_bytes) // per_page
    return {"pages": int(pages), "page_size": int(page_size), "bytes": int(pages * per_page),
            "tokens": int(max(pages - 1, 0) * page_size)}


def pages_for(tokens: int, page_size: int) -> int:
    return -(-int(tokens) // page_size) if tokens > 0 else 0


class PoolExhausted(MemoryError):
    """Fewer free pages than asked for (the decoder preempts a sequence and tries again)."""


class PagePool:
    """Free list and reference counts of `num_pages` pages (page 0, the null page, is never handed out)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (one is the null page), got {num_pages}")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self._free = list(range(self.num_pages - 1, NULL_PAGE, -1))  # pop() hands out low pages first
        self._refs = [0] * self.num_pages
        self.peak_used = 0

    @property
    def capacity(self) -> int:
        """Pages that can be handed out (all but the null page)."""
        return self.num_pages - 1

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"{n} KV pages asked for, {len(self._free)} free of {self.capacity}")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        self.peak_used = max(self.peak_used, self.used)
        return pages

    def share(self, pages: list[int]) -> None:
        """One more holder of `pages` (a sample of a group reading its prompt's pages)."""
        for p in pages:
            if self._refs[p] < 1:
                raise RuntimeError(f"page {p} is not allocated")
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """One holder fewer; a page whose last holder let go is free again."""
        for p in pages:
            if self._refs[p] < 1:
                raise RuntimeError(f"page {p} released more often than it was held")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def check_all_free(self) -> None:
        """Raise if any page is still held (the decoder's accounting after a generate call)."""
        if self.used or any(self._refs):
            held = [p for p, r in enumerate(self._refs) if r]
            raise RuntimeError(f"KV page pool leaked {len(held)} page(s), e.g. {held[:5]}")


__all__ = ["DEFAULT_PAGE_SIZE", "KV_FREE_FRACTION", "CPU_KV_POOL_BYTES", "NULL_PAGE", "PagePool", "PoolExhausted",
           "kv_bytes_per_token", "kv_pool_bytes", "kv_pool_pages", "pages_for"]
