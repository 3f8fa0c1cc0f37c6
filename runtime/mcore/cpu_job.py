"""Conversions and exports build a model on a parallel state of their own and leave the process's as they
found it: on the CPU (:func:`cpu_job`), or on a GPU in a process of their own (:func:`device_job`)."""
from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing
import os
import threading
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, TypeVar

from runtime.parent_death import die_with_parent

_Job = TypeVar("_Job", bound=Callable[..., Any])

_worker: concurrent.futures.ProcessPoolExecutor | None = None
_worker_lock = threading.Lock()


def cpu_job(fn: _Job) -> _Job:
    """``fn`` on a CPU parallel state. With none in this process, one is set up for the call and torn down
    after it: a conversion that left its state (and its shims: ``torch.cuda.current_device`` answering "cpu")
    in the driver had the GPU trainer built there next run on it. A CPU state already here is used as it is.
    Where this process holds a GPU state (the local backend's trainer in the driver), the call runs in the
    CPU worker (:func:`_cpu_worker`): a model cannot be built on the CPU under that state."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        import torch.distributed as dist

        from runtime.mcore import env
        if env.parallel_device() == "cuda":
            try:  # by name: the module's attribute may wrap this one (device_job), and pickles only as itself
                return _cpu_worker().submit(_call_by_name, fn.__module__, fn.__qualname__, args, kwargs).result()
            except BrokenProcessPool:
                shutdown_cpu_worker()  # the next job starts a fresh one
                raise
        made = not dist.is_initialized()
        env.ensure_parallel("cpu")
        try:
            return fn(*args, **kwargs)
        finally:
            if made:
                env.destroy_parallel()
    return run  # type: ignore[return-value]


def _call_by_name(module: str, qualname: str, args: tuple, kwargs: dict):
    import importlib
    return getattr(importlib.import_module(module), qualname)(*args, **kwargs)


def _cpu_worker() -> concurrent.futures.ProcessPoolExecutor:
    """One spawned process for this process's CPU jobs, started at the first and kept: a registration of a
    local-backend run on a GPU took 20 s when each export started a process of its own (importing torch and
    megatron, a gloo group), against 2 s for the export itself. It holds a CPU parallel state for its life and
    dies with this process (``PR_SET_PDEATHSIG``), so a killed driver leaves no worker behind."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init, initargs=(os.getpid(),))
        return _worker


def _worker_init(parent_pid: int) -> None:
    die_with_parent(parent_pid)
    from runtime.mcore import env
    env.ensure_parallel("cpu")


# Below this GPU need "auto" stays on the host: a fresh GPU process costs ~20 s (torch, megatron, a process
# group), the host's kept worker exports a 0.6B model in ~2 s; the 9B's export takes 45 s on an H200.
GPU_WORTH_BYTES = 8 * 10**9


def device_job(gpu_bytes: Callable[..., int]) -> Callable[[_Job], _Job]:
    """``fn(..., device=...)`` on the device its ``device`` keyword names: "cpu" as :func:`cpu_job`; "cuda" in a
    spawned process of its own with a CUDA parallel state, so the CUDA context and every byte it allocated end
    with the call (a driver that kept them would hold GPU memory no plan counts, beside the trainer it starts
    next). "auto": the GPU where this process sees one, the job needs ``gpu_bytes(*args, **kwargs)`` >=
    :data:`GPU_WORTH_BYTES` and the GPU has that much free (an export during a colocated run finds it full),
    else the CPU."""
    def wrap(fn: _Job) -> _Job:
        on_cpu = cpu_job(fn)

        @functools.wraps(fn)
        def run(*args, device: str = "cpu", **kwargs):
            if device not in ("cpu", "cuda", "auto"):
                raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', not {device!r}")
            import torch
            need = 0
            if device == "auto":
                need = gpu_bytes(*args, **kwargs) if torch.cuda.is_available() else 0
                device = "cuda" if need >= GPU_WORTH_BYTES else "cpu"
            if device == "cpu":
                return on_cpu(*args, device="cpu", **kwargs)
            with concurrent.futures.ProcessPoolExecutor(
                    1, mp_context=multiprocessing.get_context("spawn"), initializer=die_with_parent,
                    initargs=(os.getpid(),)) as one:
                return one.submit(_on_gpu_or_cpu, run, need, args, kwargs).result()
        return run  # type: ignore[return-value]
    return wrap


def _on_gpu_or_cpu(job, need: int, args: tuple, kwargs: dict):
    """In the spawned process: ``job``'s body on the GPU when it holds ``need`` bytes free, else the CPU."""
    import torch

    from runtime.mcore import env
    device = "cuda"
    if need:
        free, _ = torch.cuda.mem_get_info()
        device = "cuda" if free >= need else "cpu"
    env.ensure_parallel(device)
    try:
        return job.__wrapped__(*args, device=device, **kwargs)
    finally:
        env.destroy_parallel()


def shutdown_cpu_worker() -> None:
    """End the CPU worker, if one was started (a later job starts another)."""
    global _worker
    with _worker_lock:
        worker, _worker = _worker, None
    if worker is not None:
        worker.shutdown(wait=True, cancel_futures=True)


__all__ = ["cpu_job", "device_job", "shutdown_cpu_worker"]
