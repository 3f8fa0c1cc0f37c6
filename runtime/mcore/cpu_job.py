"""Conversions and exports build a model on the CPU: each runs on a CPU parallel state and leaves the
process's as it found it (:func:`cpu_job`)."""
from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing
from typing import Any, Callable, TypeVar

_Job = TypeVar("_Job", bound=Callable[..., Any])


def cpu_job(fn: _Job) -> _Job:
    """``fn`` on a CPU parallel state. With none in this process, one is set up for the call and torn down
    after it: a conversion that left its state (and its shims: ``torch.cuda.current_device`` answering "cpu")
    in the driver had the GPU trainer built there next run on it. A CPU state already here is used as it is.
    Where this process holds a GPU state (the local backend's trainer in the driver), the call runs in a
    fresh spawned process: a model cannot be built on the CPU under that state."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        import torch.distributed as dist

        from runtime.mcore import env
        if env.parallel_device() == "cuda":
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                return pool.submit(run, *args, **kwargs).result()
        made = not dist.is_initialized()
        env.ensure_parallel("cpu")
        try:
            return fn(*args, **kwargs)
        finally:
            if made:
                env.destroy_parallel()
    return run  # type: ignore[return-value]


__all__ = ["cpu_job"]
