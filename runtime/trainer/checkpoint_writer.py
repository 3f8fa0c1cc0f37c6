"""A trainer rank's torch_dist checkpoint written beside training: plan and host copy now, files in a thread.

Source: megatron-core's own async torch_dist save (``dist_checkpointing.save(..., async_sharded_save=True)``),
not its ``AsyncCallsQueue``. The save splits into

1. the plan (``save`` itself, on the calling thread): sharded state dict → write items, the common part
   (``common.pt``) written, the global plan agreed over the ranks (collectives);
2. the write (``AsyncRequest.async_fn``): each rank's buckets of tensors into its ``__<rank>_<i>.distcp`` files;
3. the finalize (``AsyncRequest.finalize_fns``, collective): the write results gathered to rank 0, which
   writes ``.metadata`` and ``metadata.json``.

Here (1) runs in :meth:`CheckpointWriter.begin` with a host copy of every tensor the buckets hold — a copy the
next update cannot change: megatron's ``preload_fn`` copies device tensors to the host, but a tensor already on
the host (every tensor on CPU; the host optimizer's master and moments on a GPU) would be written from the live
storage, so it is cloned. (2) runs in one thread of this process with megatron's per-bucket writer
(``FileSystemWriterAsync.write_preloaded_data``) and then hashes each file it wrote (sha256, for the
checkpoint's manifest): file I/O only, no collective, no CUDA. (3) runs in :meth:`finish`, on the calling thread,
at a point every rank reaches together (the session calls it through the trainer handle).

Why not ``AsyncCallsQueue``: it forks a writer process per save from a CUDA process (or keeps a persistent one
fed through a ``multiprocessing.Manager`` queue) — the orphans runtime/mcore/env.py removed — and megatron's
multi-process write (``write_preloaded_data_multiproc``) forks again per bucket. A thread in the trainer needs
neither, and dies with it: a killed trainer leaves only the temp directory a resume discards. Why not
StateOffload's pinned copies (the master and Adam a bf16 checkpoint holds, runtime/trainer/master_weights.py): they
exist only when offloading, and are overwritten by the next offload while a write could still read them.

Host memory: a background save holds one host copy of this rank's checkpoint bytes until its files are written
(on a GPU in pinned buffers kept for the next save).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

import torch

from runtime.run.checkpoint import sha256_file
from runtime.testing.moments import moment

log = logging.getLogger(__name__)


class CheckpointWriter:
    """One rank's checkpoint in flight (at most one at a time)."""

    def __init__(self):
        self._pending: dict[str, Any] | None = None
        self._pinned: list[torch.Tensor] = []  # host buffers of the device tensors, reused save after save
        self._pin_s = 0.0

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def begin(self, state: dict, path: str, *, background: bool) -> dict[str, float]:
        """Plan the save of ``state`` (a sharded state dict) into ``path`` and take the host copy; the files are
        written in a thread (``background``) or before returning. Call :meth:`finish` on every rank next.
        Returns the seconds spent here (the stall the training loop sees)."""
        from megatron.core import dist_checkpointing
        if self._pending is not None:
            raise RuntimeError("a checkpoint is still being written: finish it first")
        t0 = time.time()
        request = dist_checkpointing.save(state, path, async_sharded_save=True)
        t_plan = time.time()
        self._pin_s = 0.0
        transforms, _use_msc = request.async_fn.args if request.async_fn is not None else ([], False)
        buckets, results_queue = [], None
        if request.async_fn is not None:
            _rank, planned, results_queue = request.async_fn_args
            if background:
                buckets = self._host_copy(planned, request.preload_fn)
            else:  # written before anything changes the state: only the device tensors need the host
                buckets = request.preload_fn() if _on_device(planned) else planned
        job = {"path": path, "request": request, "error": None, "files": {}, "write_s": 0.0, "hash_s": 0.0}
        self._pending = job
        if background:
            job["thread"] = threading.Thread(target=self._write, args=(job, transforms, buckets, results_queue),
                                             name="checkpoint-writer", daemon=True)
            job["thread"].start()
        else:
            self._write(job, transforms, buckets, results_queue)
        t_copy = time.time()
        return {"stall_s": t_copy - t0, "plan_s": t_plan - t0, "host_copy_s": t_copy - t_plan, "pin_s": self._pin_s}

    def done(self) -> bool:
        """Whether this rank's files are written (a :meth:`finish` now would not wait)."""
        thread = self._pending and self._pending.get("thread")
        return thread is None or not thread.is_alive()

    def finish(self) -> dict[str, Any]:
        """Wait for this rank's files, then finalize the save with the other ranks (collective). Returns the
        files this rank wrote (path relative to the checkpoint dir: size, sha256) and the write's and hash's
        seconds; raises what the write met."""
        job, self._pending = self._pending, None
        if job is None:
            return {"files": {}, "write_s": 0.0, "hash_s": 0.0}
        if job.get("thread") is not None:
            job["thread"].join()
        failed = torch.tensor([1 if job["error"] is not None else 0], dtype=torch.int)
        # every rank learns whether any failed before the finalize's own collectives (a rank that raised
        # alone would leave the others waiting in them)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
            failed = failed.to(device)
            torch.distributed.all_reduce(failed)
        if job["error"] is not None:
            raise RuntimeError(f"writing checkpoint {job['path']} failed: {job['error']}") from job["error"]
        if int(failed.item()):
            raise RuntimeError(f"writing checkpoint {job['path']} failed on another rank")
        for fn in job["request"].finalize_fns:
            fn()
        return {"files": job["files"], "write_s": job["write_s"], "hash_s": job["hash_s"]}

    # -- the host copy ----------------------------------------------------------------------------------------
    def _host_copy(self, buckets: list, preload_fn) -> list:
        """The buckets with every tensor in host memory the live state does not share."""
        on_device = _on_device(buckets)
        if on_device and torch.cuda.is_available():
            return self._pinned_copy(buckets)
        copied = preload_fn() if on_device else buckets
        out = []
        for (name, key, (byte_items, tensors)), (_, _, (_, host)) in zip(buckets, copied):
            fresh = [(item, h.clone() if _shares(h, t) else h) for (item, t), (_, h) in zip(tensors, host)]
            out.append((name, key, (byte_items, fresh)))
        return out

    def _pinned_copy(self, buckets: list) -> list:
        flat = [t for _, _, (_, tensors) in buckets for _, t in tensors]
        if [(b.shape, b.dtype) for b in self._pinned] != [(t.shape, t.dtype) for t in flat]:
            t0 = time.time()  # the first save's pinning: its share of the stall, apart
            self._pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in flat]
            self._pin_s = time.time() - t0
        it = iter(self._pinned)
        out = []
        for name, key, (byte_items, tensors) in buckets:
            copied = []
            for item, t in tensors:
                buf = next(it)
                buf.copy_(t.detach(), non_blocking=t.device.type != "cpu")
                copied.append((item, buf))
            out.append((name, key, (byte_items, copied)))
        torch.cuda.synchronize()
        return out

    # -- the write (a thread; no collective, no CUDA) -----------------------------------------------------
    def _write(self, job: dict, transforms: list, buckets: list, results_queue) -> None:
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
        try:
            moment("checkpoint-write-started")  # the host copy taken, no file written
            t0 = time.time()
            results, local = {}, queue.Queue()
            for i, bucket in enumerate(buckets):
                done = queue.Queue()
                done.put(i)
                FileSystemWriterAsync.write_preloaded_data(transforms, i, bucket, local, done, use_fsync=True)
                idx, res = local.get()
                if isinstance(res, Exception):
                    raise res
                results[idx] = res
            job["write_s"] = time.time() - t0
            t1 = time.time()
            for file_name, _key, _data in buckets:
                rel = os.path.relpath(file_name, os.path.dirname(os.path.normpath(job["path"])))
                job["files"][rel] = {"size": os.path.getsize(file_name), "sha256": sha256_file(file_name)}
            job["hash_s"] = time.time() - t1
            if results_queue is not None:
                results_queue.put(results)  # what the finalize reads (FileSystemWriterAsync.retrieve_write_results)
            moment("checkpoint-files-written")  # this rank's tensors on disk and hashed; no metadata, no manifest
        except BaseException as e:  # noqa: BLE001 - raised again by finish(), on the loop's thread
            log.error("checkpoint write into %s failed: %s: %s", job["path"], type(e).__name__, e)
            job["error"] = e


def _on_device(buckets: list) -> bool:
    return any(t.device.type != "cpu" for _, _, (_, tensors) in buckets for _, t in tensors)


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
