"""The SGLang rollout backend: SGLang servers launched, fed and supervised over SGLang's HTTP API.

**Status: this module has NOT run against a real SGLang here.** SGLang cannot be installed in this
environment (0.5.23 pins torch 2.14.1 and CUDA kernel wheels), so it is tested only against
`tests/sglang_standin.py`, a stdlib HTTP server that speaks the same endpoints and payloads. The
protocol was read from SGLang **0.5.23** (the PyPI wheel `sglang-0.5.23`, built 2026-10-30):

- `sglang/srt/entrypoints/http_server.py`: routes `/health_generate`, `/generate`, `/flush_cache`,
  `/update_weights_from_disk`, `/update_weights_from_tensor`, `/init_weights_update_group`,
  `/destroy_weights_update_group`, `/update_weights_from_distributed`, `/release_memory_occupation`,
  `/resume_memory_occupation`; their status codes (400 with `{"success": false, "message"}` or
  `{"error": {"message"}}`).
- `sglang/srt/managers/io_struct.py`: `GenerateReqInput` (`input_ids`, `sampling_params`,
  `return_logprob`, `logprob_start_len`, `rid`), `UpdateWeightFromDiskReqInput` (`model_path`,
  `weight_version`, `flush_cache`, `abort_all_requests`), `UpdateWeightsFromTensorReqInput`
  (`serialized_named_tensors`: one base64 ForkingPickler payload per TP rank),
  `UpdateWeightsFromDistributedReqInput` (`names`, `dtypes`, `shapes`, `group_name`,
  `weight_version`, `flush_cache`), `InitWeightsUpdateGroupReqInput` (`master_address`,
  `master_port`, `rank_offset`, `world_size`, `group_name`, `backend`),
  `DestroyWeightsUpdateGroupReqInput` (`group_name`), `Release/ResumeMemoryOccupationReqInput` (`tags`).
- `sglang/srt/model_executor/model_runner.py`: the server joins the group as rank
  `rank_offset + tp_rank` (TCP rendezvous at master_address:master_port), receives every tensor of
  an update (one broadcast from rank 0 each, in the order named) and only then loads them.
- `sglang/api/v1/api_types.py`: the JSON contract of `/generate` - `SamplingParams` rejects
  unknown keys; `GenerateMetaInfo` has `finish_reason`, `completion_tokens`, `weight_version`,
  `output_token_logprobs` / `input_token_logprobs` as `[logprob, token_id, text]` lists.
- `sglang/srt/managers/schedule_batch.py`: `finish_reason` is `{"type": "stop", "matched": id}`,
  `{"type": "length", "length": n}` or `{"type": "abort", "message": ...}`; the matched stop
  token is part of `output_ids` (our contract: the response includes its stop token).
- `sglang/srt/arg_groups/fields/*.py`: the `sglang.launch_server` flags used here
  (`--model-path --tp-size --mem-fraction-static --host --port --random-seed --weight-version
  --base-gpu-id --enable-memory-saver --enable-deterministic-inference`).

Keyed randomness: every request carries `sampling_params.sampling_seed`, a 64-bit hash of its key
`(seed, rollout_id, prompt_index, sample_index)`. SGLang's sampler (`srt/layers/sampler.py`,
`srt/sampling/sampling_batch_info.py`) uses it - per request and per position, so independent of
batch neighbours and of retries - only when the server runs with `--enable-deterministic-inference`
(`rollout.sglang_deterministic`, on by default; it costs throughput). Then a resumed run or a
retried request draws the same tokens as far as SGLang's deterministic mode promises; without it
the seed is sent but ignored and samples are not reproducible. The returned log-probs are SGLang's
default: log_softmax(logits / temperature) of the sampled token (temperature 0 -> 1), as in the
built-in engine.

Shape of the backend:
- `rollout.sglang_num_engines` servers, each `python -m sglang.launch_server` (the command prefix
  is `rollout.sglang_launch`, so tests start the stand-in through this same code), in its own
  process group, its output in `<scratch>/logs/engine-<i>.log`; start-up waits for
  `/health_generate` with a timeout and surfaces the server's own last error line if it exits.
- Requests go out one per sample over async HTTP (httpx) with at most `rollout.sglang_concurrency`
  in flight per engine, each to the least-busy healthy engine (client-side balancing rather than
  `sglang_router`: the client must restart and re-sync one engine at a time, which a router hides).
  Results come back in request order.
- `update_weights` always writes the tensors as safetensors under the scratch dir and has every
  engine load them with `/update_weights_from_disk` (`sglang_weight_sync: tensor` pushes them with
  `/update_weights_from_tensor` instead, for engines on the trainer's host; the disk copy is still
  written, for re-syncing a restarted engine).
- `cluster.weight_sync: broadcast` (runtime/placement/weight_sync.py): `init_weight_sync` has every engine
  join a torch.distributed group with trainer rank 0 (`/init_weights_update_group`; engine i's
  ranks start at rank_offset + i * tp_size), and `receive_weights` has them take the trainer's
  broadcast (`/update_weights_from_distributed`). No copy exists on disk then, so an engine that
  restarts cannot be re-synced by this client: it stays up but gets no requests ("stale") and the
  group is broken (`weight_sync_ready()` is false; `receive_weights` refuses at once) until the
  group is formed again with it (`init_weight_sync`, then a broadcast) or `update_weights` loads
  weights from disk into every engine. A failed broadcast leaves every engine stale the same way.
- After every update the engines are probed: each must report the new `weight_version` and the
  same log-probs for fixed tokens; log-probs that did not move are warned about.
- In colocate mode (`cluster.colocate`) servers start with `--enable-memory-saver`;
  `release_memory()` frees their GPU memory for training and the next update or generate resumes
  it (weights first, then the KV cache after the new weights are in).
- Faults: a request that fails on transport, times out or gets a 5xx triggers a health check of
  its engine; an engine that is dead or does not answer is killed by process group, relaunched,
  re-synced to the current weights and verified against the recorded probe; failed requests are
  retried (same seed). `generate` returns one result per request or raises.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runtime.errors import ConfigError, ModelError, TransientError
from runtime.placement.ports import free_port
from runtime.rollout.base import RolloutEngine, SampleRequest, SampleResult, SamplingParams

log = logging.getLogger(__name__)

SGLANG_VERSION_READ = "0.5.23"
INSTALL_HINT = "pip install 'grpoflow[sglang]'"
DEFAULT_LAUNCH = ("{python}", "-m", "sglang.launch_server")
# Flags this module sets itself; rollout.sglang_launch must not repeat them.
MANAGED_FLAGS = ("--model-path", "--model", "--tp-size", "--tensor-parallel-size", "--mem-fraction-static",
                 "--host", "--port", "--random-seed", "--weight-version", "--base-gpu-id",
                 "--enable-memory-saver", "--enable-deterministic-inference")
# Fixed tokens whose log-probs show which weights an engine serves (ids small enough for any vocab).
PROBE_IDS = (1, 5, 2, 8, 3, 13, 21, 4)
PROBE_TOLERANCE = 0.02  # max |Δ logprob| between engines serving the same weights (bf16 noise)
PORT_STRIDE = 10        # with a fixed base port, engine i listens on port + 10 * i
_READY, _CHECKING, _RESTARTING, _DEAD, _STARTING = "ready", "checking", "restarting", "dead", "starting"
# Up, but serving other weights than the rest (restarted after a broadcast update, or a broadcast
# failed): no requests until an update (disk, or a broadcast on a group it joined) reaches it.
_STALE = "stale"


class SGLangError(RuntimeError):
    """The SGLang servers did something the client cannot work with (a protocol or consistency fault)."""


class _EngineFault(Exception):
    """A request failed in a way that says something about the engine (transport, timeout, 5xx)."""


class _StaleWeights(_EngineFault):
    """The engine answered with another weight_version than the one it must serve: restart and re-sync it."""


class _NeedsWeights(Exception):
    """A restarted engine cannot be brought to the current weights by this client (no disk copy)."""


class _Aborted(Exception):
    """SGLang aborted the request (finish_reason type "abort"); worth a retry."""


# ---- settings -----------------------------------------------------------------------------------


@dataclass
class SGLangSettings:
    """Everything the backend needs; `from_config` reads it from `rollout.sglang_*` (+ cluster, train)."""

    launch: list[str] | None = None      # command prefix; None: [python, -m, sglang.launch_server]
    num_engines: int = 1
    tp_size: int = 1
    mem_fraction: float = 0.7
    concurrency: int = 64                # requests in flight per engine
    host: str = "127.0.0.1"
    port: int = 0                        # 0: free ports; else engine i uses port + 10 * i
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 1800.0     # one /generate; long reasoning rollouts take minutes
    max_restarts: int = 3                # per engine, over the engine's life
    weight_sync: str = "disk"            # disk | tensor
    scratch_dir: str | None = None       # weights and logs; None: a temp dir
    deterministic: bool = True           # --enable-deterministic-inference (sampling_seed honoured)
    colocate: bool = False               # --enable-memory-saver; release/resume memory around training
    random_seed: int | None = None
    # the torch.distributed backend the engines join a weight-sync group with: the trainer's
    # (from_config: nccl when the trainer runs on CUDA, else gloo, which only the stand-in can use)
    sync_backend: str = "nccl"
    # timing knobs, not in the config (tests shrink them)
    health_timeout_s: float = 20.0       # one health check of a suspect engine
    health_poll_s: float = 0.5           # start-up polling interval
    kill_grace_s: float = 15.0           # SIGTERM -> SIGKILL
    max_attempts: int = 4                # tries per request

    @classmethod
    def from_config(cls, cfg, **overrides) -> "SGLangSettings":
        values: dict[str, Any] = {}
        if cfg is not None:
            r = cfg.rollout
            names = {"launch": "sglang_launch", "num_engines": "sglang_num_engines", "tp_size": "sglang_tp_size",
                     "mem_fraction": "sglang_mem_fraction", "concurrency": "sglang_concurrency",
                     "host": "sglang_host", "port": "sglang_port", "startup_timeout_s": "sglang_startup_timeout_s",
                     "request_timeout_s": "sglang_request_timeout_s", "max_restarts": "sglang_max_restarts",
                     "weight_sync": "sglang_weight_sync", "scratch_dir": "sglang_scratch_dir",
                     "deterministic": "sglang_deterministic"}
            for ours, theirs in names.items():
                if hasattr(r, theirs):
                    values[ours] = getattr(r, theirs)
            values["colocate"] = bool(cfg.cluster.colocate)
            values["random_seed"] = int(cfg.train.seed)
            # the backend trainer rank 0 joins the weight-sync group with (runtime.placement.weight_sync.backend_for
            # of the trainer's device, which the cluster resolves the same way)
            from runtime.placement.cluster import resolve_device
            from runtime.placement.weight_sync import backend_for
            values["sync_backend"] = backend_for(resolve_device(cfg))
        values.update({k: v for k, v in overrides.items()})
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        if self.num_engines < 1:
            raise ConfigError(f"rollout.sglang_num_engines must be >= 1, got {self.num_engines}")
        if self.tp_size < 1:
            raise ConfigError(f"rollout.sglang_tp_size must be >= 1, got {self.tp_size}")
        if not 0.0 < self.mem_fraction < 1.0:
            raise ConfigError(f"rollout.sglang_mem_fraction must be in (0, 1), got {self.mem_fraction}")
        if self.concurrency < 1:
            raise ConfigError(f"rollout.sglang_concurrency must be >= 1, got {self.concurrency}")
        if self.weight_sync not in ("disk", "tensor"):
            raise ConfigError(f"rollout.sglang_weight_sync must be 'disk' or 'tensor', got {self.weight_sync!r}")
        if self.sync_backend not in ("nccl", "gloo"):
            raise ConfigError(f"SGLang sync_backend must be 'nccl' or 'gloo', got {self.sync_backend!r}")
        if self.port and not 0 < self.port + PORT_STRIDE * (self.num_engines - 1) < 65536:
            raise ConfigError(f"rollout.sglang_port={self.port}: engine ports port + 10*i must stay below 65536")
        for flag in self.launch or []:
            if flag.split("=", 1)[0] in MANAGED_FLAGS:
                raise ConfigError(f"rollout.sglang_launch sets {flag.split('=', 1)[0]}, which grpoflow sets itself; "
                                  f"remove it (use rollout.sglang_* keys: tp_size, mem_fraction, host, port, deterministic)")

    def launch_prefix(self) -> list[str]:
        if not self.launch:
            return [sys.executable, "-m", "sglang.launch_server"]
        return [sys.executable if part == "{python}" else str(part) for part in self.launch]

    def uses_real_sglang(self) -> bool:
        prefix = self.launch_prefix()
        return any(a == "sglang.launch_server" for a in prefix) and prefix[0] == sys.executable


def check_sglang_installed(settings: SGLangSettings) -> None:
    """One line naming the install command when the launch command needs `sglang` in this Python."""
    if settings.uses_real_sglang() and importlib.util.find_spec("sglang") is None:
        raise ConfigError(f"rollout.engine=sglang needs the sglang package, which is not installed: {INSTALL_HINT}")


# ---- request payloads and parsing ---------------------------------------------------------------


def sampling_seed_for(key: tuple[int, int, int, int]) -> int:
    """The int64 `sampling_seed` of a request key (seed, rollout_id, prompt_index, sample_index)."""
    digest = hashlib.blake2b(struct.pack("<4q", *key), digest_size=8, person=b"grpoflow-sglang").digest()
    return int.from_bytes(digest, "little", signed=True)


def sglang_sampling_params(sampling: SamplingParams, seed: int) -> dict:
    params = {
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k),
        "max_new_tokens": int(sampling.max_new_tokens),
        "sampling_seed": int(seed),
    }
    if sampling.stop_token_ids:
        params["stop_token_ids"] = [int(t) for t in sampling.stop_token_ids]
    return params


def generate_payload(request: SampleRequest, sampling: SamplingParams) -> dict:
    """The `/generate` body for one sample (GenerateReqInput, single-prompt form)."""
    key = request.key
    return {
        "rid": f"gf-{key[0]}-{key[1]}-{key[2]}-{key[3]}-{uuid.uuid4().hex[:8]}",
        "input_ids": [int(t) for t in request.prompt_ids],
        "sampling_params": sglang_sampling_params(sampling, sampling_seed_for(key)),
        "return_logprob": True,
    }


def error_message(body: Any, fallback: str) -> str:
    """SGLang's error text from a response body: {"error": {"message"}}, {"error": "..."}, {"message"}."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("message"):
            return str(body["message"])
        if body.get("detail"):
            return str(body["detail"])
    if isinstance(body, str) and body.strip():
        return body.strip()
    return fallback


def parse_generate_response(body: Any, request: SampleRequest, expected_version: str | None = None) -> SampleResult:
    """A SampleResult from a `/generate` response; raises _Aborted, or SGLangError on a malformed one."""
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise SGLangError(f"SGLang /generate answered without meta_info: {str(body)[:200]}")
    meta = body["meta_info"]
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind == "abort":
        raise _Aborted(error_message(finish, "aborted"))
    if kind not in ("stop", "length"):
        raise SGLangError(f"SGLang /generate finished with finish_reason={finish!r}; expected stop or length")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise SGLangError("SGLang /generate answered without meta_info.output_token_logprobs (was return_logprob sent?)")
    logprobs = [float(e[0]) for e in entries]
    ids_from_logprobs = [int(e[1]) for e in entries]
    output_ids = body.get("output_ids")
    response_ids = [int(t) for t in output_ids] if output_ids is not None else ids_from_logprobs
    if response_ids != ids_from_logprobs:
        raise SGLangError(f"SGLang output_ids {response_ids[:8]}... disagree with output_token_logprobs ids "
                          f"{ids_from_logprobs[:8]}...")
    completion = meta.get("completion_tokens")
    if completion is not None and int(completion) != len(response_ids):
        raise SGLangError(f"SGLang completion_tokens={completion} but {len(response_ids)} output tokens came back")
    if expected_version is not None and meta.get("weight_version") is not None and str(meta["weight_version"]) != expected_version:
        raise _StaleWeights(f"engine serves weight_version {meta['weight_version']!r}, expected {expected_version!r}")
    return SampleResult(
        prompt_ids=list(request.prompt_ids),
        response_ids=response_ids,
        response_logprobs=logprobs,
        text=body.get("text") or "",
        finish_reason=kind,
    )


# ---- processes ----------------------------------------------------------------------------------


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate_process(proc: subprocess.Popen | None, grace_s: float) -> None:
    """Stop a server we started (its own session, so pgid == pid): SIGTERM, then SIGKILL, then reap.
    Once per process: after that its id may belong to someone else."""
    if proc is None or getattr(proc, "_grpoflow_terminated", False):
        return
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
    _signal_group(proc.pid, signal.SIGKILL)  # children the server left in its group (scheduler, detokenizer)
    proc._grpoflow_terminated = True


def _kill_all(procs: list, grace_s: float) -> None:
    for proc in list(procs):
        terminate_process(proc, grace_s)


def log_tail_error(path: Path, max_bytes: int = 16384) -> str:
    """The most telling line at the end of a server log: the last error-looking line, else the last line."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    if not lines:
        return "(empty log)"
    for line in reversed(lines):
        if ("Error" in line or "Exception" in line) and not line.startswith("Traceback"):
            return line
    return lines[-1]


@dataclass
class _Engine:
    index: int
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    state: str = _STARTING
    inflight: int = 0
    restarts: int = 0
    epoch: int = 0            # bumped on every (re)start; a fault seen on an older epoch is stale
    last_fault: str = ""
    fault_task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def url(self, host: str, path: str) -> str:
        return f"http://{host}:{self.port}{path}"


@dataclass
class _SyncGroup:
    """The weight-sync group the engines joined (init_weight_sync)."""

    name: str
    members: dict[int, int]   # engine index -> its epoch when it joined; a restart leaves the group
    broken: str = ""          # why it can carry no more broadcasts (a failed one), else ""


def _log_task_error(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("sglang: engine check/restart failed: %r", task.exception())


class _LoopThread:
    """One private asyncio loop in a daemon thread: the sync API submits coroutines to it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpoflow-sglang-client", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self, last=None) -> None:
        """Cancel whatever still runs (a caller blocked in run() gets CancelledError), run `last`, stop."""
        if self.loop.is_closed():
            return

        async def _wind_down():
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if last is not None:
                await last()

        try:
            asyncio.run_coroutine_threadsafe(_wind_down(), self.loop).result(timeout=30)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


# ---- the engine ---------------------------------------------------------------------------------


class SGLangEngine(RolloutEngine):
    """`rollout.engine: sglang`: a pool of SGLang servers behind the RolloutEngine interface."""

    def __init__(self, cfg=None, model_dir: str = "", *, settings: SGLangSettings | None = None, **overrides):
        self.settings = settings or SGLangSettings.from_config(cfg, **overrides)
        s = self.settings
        s.validate()
        check_sglang_installed(s)
        try:
            import httpx  # noqa: F401  (prefect and sglang both bring it)
        except ImportError:
            raise ConfigError(f"the SGLang backend needs httpx, which is not installed: {INSTALL_HINT}") from None
        if not model_dir:
            raise ModelError("SGLangEngine needs model_dir: an HF checkpoint directory (or hub id) SGLang can load")
        self.model_dir = str(model_dir)
        self._own_scratch = s.scratch_dir is None
        base = Path(s.scratch_dir) if s.scratch_dir else Path(tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp(prefix="grpoflow-sglang-", dir=base))
        (self.scratch / "logs").mkdir()
        (self.scratch / "weights").mkdir()
        self._lock = threading.RLock()
        self._closed = False
        self._version = 0
        self._target: tuple[int, Path | None] = (0, None)   # (version, weights dir) an engine must serve
        self._target_disk_version = 0                        # the version the target dir holds
        self._weights_dir: Path | None = None
        self._probe: list[float] | None = None              # probe log-probs of the current version
        self._released = False
        self._sync: _SyncGroup | None = None                # cluster.weight_sync: broadcast
        self._procs: list[subprocess.Popen] = []             # every server started; the finalizer kills them
        self._finalizer = weakref.finalize(self, _kill_all, self._procs, 5.0)
        self._engines = [_Engine(index=i, port=0, log_path=self.scratch / "logs" / f"engine-{i}.log")
                         for i in range(s.num_engines)]
        self._start_failed = False
        self._loop = _LoopThread()
        try:
            self._loop.run(self._astart())
        except BaseException:
            self._start_failed = True
            self.shutdown()
            raise

    # ---- RolloutEngine -----------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, requests: list[SampleRequest], sampling: SamplingParams) -> list[SampleResult]:
        with self._lock:
            self._check_open()
            if not requests:
                return []
            if self._released:
                self._loop.run(self._aresume(None))
            return self._loop.run(self._agenerate(list(requests), sampling))

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Write the tensors to disk, load them into every engine, verify, then weight_version == version."""
        with self._lock:
            self._check_open()
            version = int(version)
            path = self._write_weights(named_tensors, version)
            previous = self._target, self._target_disk_version
            self._target, self._target_disk_version = (version, path), version
            try:
                payload = self._tensor_payload(named_tensors) if self.settings.weight_sync == "tensor" else None
                self._loop.run(self._aupdate(path, version, payload))
            except BaseException:
                self._target, self._target_disk_version = previous
                shutil.rmtree(path, ignore_errors=True)
                raise
            old, self._weights_dir, self._version = self._weights_dir, path, version
            if old is not None and old != path:
                shutil.rmtree(old, ignore_errors=True)

    def health(self) -> dict:
        engines = [{"index": e.index, "url": e.url(self.settings.host, ""), "pid": e.pid, "state": e.state,
                    "alive": e.proc is not None and e.proc.poll() is None, "restarts": e.restarts,
                    "last_fault": e.last_fault, "log": str(e.log_path)} for e in self._engines]
        return {
            "ok": not self._closed and all(e["alive"] and e["state"] == _READY for e in engines),
            "engine": "sglang",
            "weight_version": self._version,
            "model_dir": self.model_dir,
            "weights_dir": str(self._weights_dir) if self._weights_dir else None,
            "released": self._released,
            "weight_sync_group": self._sync.name if self._sync else None,
            "engines": engines,
        }

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True  # no more launches from here on
        _kill_all(self._procs, self.settings.kill_grace_s)
        for e in self._engines:
            e.state = _DEAD
        if getattr(self, "_loop", None) is not None:
            self._loop.close(last=self._aclose_client)
        _kill_all(self._procs, self.settings.kill_grace_s)  # anything a restart launched meanwhile
        shutil.rmtree(self.scratch / "weights", ignore_errors=True)
        troubled = any(e.restarts or e.last_fault for e in self._engines) or self._start_failed
        if self._own_scratch and not troubled:  # keep the server logs of a run that had trouble
            shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> "SGLangEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- extras ------------------------------------------------------------------------------

    @property
    def pids(self) -> list[int | None]:
        return [e.pid for e in self._engines]

    @property
    def urls(self) -> list[str]:
        return [e.url(self.settings.host, "") for e in self._engines]

    def logprobs_of(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Teacher-forced log-probs of response_ids after prompt_ids under log_softmax(logits / T), from one engine."""
        with self._lock:
            self._check_open()
            if not response_ids:
                return []
            if self._released:
                self._loop.run(self._aresume(None))
            return self._loop.run(self._alogprobs_any(list(prompt_ids), list(response_ids), temperature))

    def release_memory(self) -> None:
        """Colocate mode: free the engines' GPU memory (weights and KV cache) for the trainer. No-op otherwise."""
        with self._lock:
            self._check_open()
            if not self.settings.colocate or self._released:
                return
            self._loop.run(self._arelease())
            self._released = True

    def resume_memory(self) -> None:
        """Colocate mode: take the GPU memory back (generate and update_weights do this themselves)."""
        with self._lock:
            self._check_open()
            if self._released:
                self._loop.run(self._aresume(None))

    # ---- weight sync over a torch.distributed group (cluster.weight_sync: broadcast) ---------

    def weight_sync_ranks(self) -> int:
        """Ranks the engines take in a weight-sync group: one per TP rank of every engine."""
        return self.settings.num_engines * self.settings.tp_size

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, group_name: str,
                         backend: str | None = None) -> None:
        """Have every engine join the group `group_name` hosted at host:port (`/init_weights_update_group`),
        engine i as ranks rank_offset + i * tp_size ...; returns once all have joined, which takes the
        trainer's rank 0 joining too (from another process or thread). Engines leave the group they
        were in before (`/destroy_weights_update_group`). Stale engines join like the others: the next
        broadcast brings them to the current weights. `backend`: settings.sync_backend by default."""
        with self._lock:
            self._check_open()
            s = self.settings
            if int(world_size) < int(rank_offset) + self.weight_sync_ranks():
                raise ConfigError(f"weight-sync group {group_name!r}: world_size {world_size} has no room for "
                                  f"{self.weight_sync_ranks()} SGLang rank(s) from rank {rank_offset}")
            bodies = {e.index: {"master_address": host, "master_port": int(port),
                                "rank_offset": int(rank_offset) + e.index * s.tp_size, "world_size": int(world_size),
                                "group_name": group_name, "backend": backend or s.sync_backend} for e in self._engines}
            self._loop.run(self._ainit_sync(group_name, bodies))

    def weight_sync_ready(self) -> bool:
        """Whether receive_weights can run now: every engine is in the current group, as the process that
        joined it, and no broadcast on it failed. False after a restart: form the group again first."""
        with self._lock:
            self._check_open()
            self._loop.run(self._asettle())
            return not self._sync_problem()

    def receive_weights(self, metadata, version: int) -> None:
        """Have every engine receive the tensors of `metadata` ((name, dtype, shape) in the order trainer
        rank 0 broadcasts them) over the current group (`/update_weights_from_distributed`), verify,
        then weight_version == version. Blocks until the engines have them.

        Refuses at once (SGLangError) when the group cannot carry the broadcast (weight_sync_ready()
        is False). When the broadcast or the check after it fails, no engine serves until weights
        reach them again (a new group and a broadcast, or update_weights)."""
        from runtime.placement.weight_sync import as_metadata
        with self._lock:
            self._check_open()
            self._loop.run(self._asettle())
            problem = self._sync_problem()
            if problem:
                raise SGLangError(f"receive_weights: {problem}; form the group again (init_weight_sync) first")
            version = int(version)
            metadata = as_metadata(metadata)
            body = {"names": [n for n, _, _ in metadata],
                    "dtypes": [str(d).removeprefix("torch.") for _, d, _ in metadata],
                    "shapes": [list(shape) for _, _, shape in metadata],
                    "group_name": self._sync.name, "weight_version": str(version), "flush_cache": True}
            previous = self._target
            self._target = (version, None)  # no copy on disk: a restart now leaves the engine stale
            try:
                self._loop.run(self._aload(version, lambda: self._aall_post(
                    "/update_weights_from_distributed", {e.index: body for e in self._engines})))
            except BaseException as exc:
                self._target = previous
                if not self._closed:
                    try:
                        self._loop.run(self._abroadcast_failed(f"the broadcast of weight version {version} failed: {exc}"))
                    except Exception:  # noqa: BLE001 - the first error is the one to report
                        log.exception("sglang: marking the engines stale after a failed broadcast failed")
                raise
            old, self._weights_dir, self._version = self._weights_dir, None, version
            if old is not None:  # an older version: of no use for re-syncing now
                shutil.rmtree(old, ignore_errors=True)

    # ---- internals: start-up and process management ------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SGLangEngine was shut down; build a new one")

    def _command(self, e: _Engine) -> list[str]:
        s = self.settings
        cmd = self.settings.launch_prefix() + [
            "--model-path", self.model_dir,
            "--tp-size", str(s.tp_size),
            "--mem-fraction-static", str(s.mem_fraction),
            "--host", s.host,
            "--port", str(e.port),
            "--weight-version", "0",
        ]
        if s.random_seed is not None:
            cmd += ["--random-seed", str(s.random_seed)]
        if s.num_engines > 1:
            cmd += ["--base-gpu-id", str(e.index * s.tp_size)]
        if s.colocate:
            cmd.append("--enable-memory-saver")
        if s.deterministic:
            cmd.append("--enable-deterministic-inference")
        return cmd

    def _launch(self, e: _Engine) -> None:
        s = self.settings
        if self._closed:
            raise RuntimeError("SGLangEngine was shut down")
        if s.port:
            e.port = s.port + PORT_STRIDE * e.index
        else:  # a fresh free port per launch, distinct from the other engines'
            taken = {x.port for x in self._engines if x is not e}
            e.port = free_port(s.host)
            while e.port in taken:
                e.port = free_port(s.host)
        cmd = self._command(e)
        with open(e.log_path, "ab") as logf:
            logf.write(f"\n==== grpoflow: launching engine {e.index} (restart {e.restarts}): {' '.join(cmd)}\n".encode())
            logf.flush()
            e.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True, cwd=os.getcwd())
        self._procs.append(e.proc)
        e.epoch += 1
        e.state = _STARTING
        log.info("sglang engine %d: pid %d on %s:%d (log %s)", e.index, e.proc.pid, s.host, e.port, e.log_path)

    async def _wait_healthy(self, e: _Engine) -> None:
        s = self.settings
        deadline = time.monotonic() + s.startup_timeout_s
        while True:
            code = e.proc.poll()
            if code is not None:
                raise ModelError(f"SGLang engine {e.index} exited with code {code} during start-up "
                                 f"(model {self.model_dir}): {log_tail_error(e.log_path)} [full log: {e.log_path}]")
            try:
                r = await self._client.get(e.url(s.host, "/health_generate"), timeout=max(s.health_timeout_s, 1.0))
                if r.status_code == 200:
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                await asyncio.to_thread(terminate_process, e.proc, s.kill_grace_s)
                raise TransientError(f"SGLang engine {e.index} was not healthy within {s.startup_timeout_s:.0f}s "
                                     f"(rollout.sglang_startup_timeout_s); killed it. Last log line: "
                                     f"{log_tail_error(e.log_path)} [full log: {e.log_path}]")
            await asyncio.sleep(s.health_poll_s)

    async def _astart(self) -> None:
        import httpx
        s = self.settings
        self._client = httpx.AsyncClient(
            trust_env=False,  # never route loopback traffic through an HTTP(S)_PROXY
            timeout=httpx.Timeout(s.request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=s.concurrency * s.num_engines + 8 * s.num_engines,
                                max_keepalive_connections=s.concurrency * s.num_engines),
        )
        self._cond = asyncio.Condition()
        for e in self._engines:
            self._launch(e)
        await asyncio.gather(*(self._wait_healthy(e) for e in self._engines))
        probes = await asyncio.gather(*(self._aprobe(e) for e in self._engines))
        self._check_agreement(probes, version=0)
        self._probe = probes[0]
        for e in self._engines:
            e.state = _READY

    async def _aclose_client(self) -> None:
        client = getattr(self, "_client", None)
        if client is not None:
            await client.aclose()

    # ---- internals: HTTP ---------------------------------------------------------------------

    async def _post(self, e: _Engine, path: str, body: Any, timeout: float | None = None) -> Any:
        """POST to one engine. 2xx -> parsed JSON (or text); 4xx -> SGLangError with SGLang's message;
        transport errors, timeouts and 5xx -> _EngineFault."""
        import httpx
        try:
            r = await self._client.post(e.url(self.settings.host, path), json=body,
                                        timeout=timeout if timeout is not None else self.settings.request_timeout_s)
        except httpx.TimeoutException as exc:
            raise _EngineFault(f"{path} timed out after {timeout or self.settings.request_timeout_s:.0f}s "
                               f"({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            raise _EngineFault(f"{path}: {type(exc).__name__}: {exc}") from exc
        try:
            payload = r.json()
        except (json.JSONDecodeError, ValueError):
            payload = r.text
        if r.status_code >= 500:
            raise _EngineFault(f"{path} answered {r.status_code}: {error_message(payload, r.reason_phrase)}")
        if r.status_code >= 400:
            raise SGLangError(f"SGLang engine {e.index} rejected {path} ({r.status_code}): "
                              f"{error_message(payload, r.reason_phrase)}")
        if isinstance(payload, dict) and payload.get("success") is False:
            raise SGLangError(f"SGLang engine {e.index} {path} failed: {error_message(payload, 'success=false')}")
        return payload

    async def _acquire(self) -> _Engine:
        async with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("SGLangEngine was shut down")
                ready = [e for e in self._engines if e.state == _READY and e.inflight < self.settings.concurrency]
                if ready:
                    e = min(ready, key=lambda x: (x.inflight, x.index))
                    e.inflight += 1
                    return e
                if all(e.state == _DEAD for e in self._engines):
                    faults = "; ".join(f"engine {e.index}: {e.last_fault}" for e in self._engines)
                    raise TransientError(f"every SGLang engine is down after {self.settings.max_restarts} restart(s) "
                                         f"each ({faults}); logs under {self.scratch / 'logs'}")
                if all(e.state in (_DEAD, _STALE) for e in self._engines):
                    faults = "; ".join(f"engine {e.index} ({e.state}): {e.last_fault}" for e in self._engines)
                    raise TransientError(f"no SGLang engine serves weight version {self._version}: {faults}. Stale "
                                         f"engines serve again once weights reach them (a broadcast on a group formed "
                                         f"again, or update_weights)")
                await self._cond.wait()

    async def _release_slot(self, e: _Engine) -> None:
        async with self._cond:
            e.inflight -= 1
            self._cond.notify_all()

    async def _set_state(self, e: _Engine, state: str) -> None:
        async with self._cond:
            e.state = state
            self._cond.notify_all()

    # ---- internals: generation and faults ----------------------------------------------------

    async def _agenerate(self, requests: list[SampleRequest], sampling: SamplingParams) -> list[SampleResult]:
        expected = str(self._version)
        tasks = [asyncio.ensure_future(self._aone(r, sampling, expected)) for r in requests]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _aone(self, request: SampleRequest, sampling: SamplingParams, expected: str) -> SampleResult:
        payload = generate_payload(request, sampling)
        problems: list[str] = []
        for _ in range(self.settings.max_attempts):
            e = await self._acquire()
            epoch = e.epoch
            try:
                body = await self._post(e, "/generate", payload)
                return parse_generate_response(body, request, expected)
            except _Aborted as exc:
                problems.append(f"engine {e.index}: aborted ({exc})")
            except _EngineFault as exc:
                problems.append(f"engine {e.index}: {exc}")
                self._on_fault(e, epoch, exc)  # checked/restarted in the background; retry elsewhere now
            finally:
                await self._release_slot(e)
        raise TransientError(f"SGLang request key={request.key} failed {self.settings.max_attempts} times: "
                             f"{' | '.join(problems)}")

    def _on_fault(self, e: _Engine, epoch: int, exc: Exception) -> asyncio.Task | None:
        """A request on `e` (sent in `epoch`) failed: check the engine once, restart it if it is down or
        serves stale weights. Concurrent failures share one check; one from before the last restart is
        ignored. Marks the engine unavailable at once; returns the task doing the check."""
        if e.epoch == epoch and e.state in (_READY, _STALE) and (e.fault_task is None or e.fault_task.done()):
            prior, e.state = e.state, _CHECKING
            e.last_fault = str(exc)
            e.fault_task = asyncio.ensure_future(self._check_or_restart(e, str(exc), isinstance(exc, _StaleWeights), prior))
            e.fault_task.add_done_callback(_log_task_error)
        return e.fault_task

    async def _check_or_restart(self, e: _Engine, reason: str, force: bool, prior: str = _READY) -> None:
        if not force and e.proc is not None and e.proc.poll() is None:
            try:
                r = await self._client.get(e.url(self.settings.host, "/health_generate"), timeout=self.settings.health_timeout_s)
                if r.status_code == 200:
                    log.warning("sglang engine %d: a request failed (%s) but the engine is healthy; retrying", e.index, reason)
                    await self._set_state(e, prior)  # a stale engine stays stale
                    return
            except Exception:
                pass
        await self._restart(e, reason)

    async def _restart(self, e: _Engine, reason: str) -> None:
        s = self.settings
        await self._set_state(e, _RESTARTING)
        while True:
            log.warning("sglang engine %d (pid %s) is down or not answering (%s); killing it", e.index, e.pid, reason)
            await asyncio.to_thread(terminate_process, e.proc, s.kill_grace_s)
            if e.restarts >= s.max_restarts:
                e.last_fault = f"{reason}; no restarts left (rollout.sglang_max_restarts={s.max_restarts})"
                await self._set_state(e, _DEAD)
                return
            e.restarts += 1
            try:
                self._launch(e)
                await self._wait_healthy(e)
                await self._resync(e)
            except _NeedsWeights as exc:
                e.last_fault = f"restart {e.restarts}: {exc}"
                log.warning("sglang engine %d restarted (pid %d) but %s: it gets no requests until new weights "
                            "reach it (a broadcast on a group it joined, or update_weights)", e.index, e.pid, exc)
                await self._set_state(e, _STALE)
                return
            except SGLangError as exc:  # a consistency fault: restarting again will not fix it
                e.last_fault = f"restart {e.restarts}: {exc}"
                log.error("sglang engine %d: %s", e.index, e.last_fault)
                await asyncio.to_thread(terminate_process, e.proc, s.kill_grace_s)
                await self._set_state(e, _DEAD)
                return
            except (ModelError, TransientError, _EngineFault) as exc:
                reason = f"restart {e.restarts} failed: {exc}"
                e.last_fault = reason
                continue
            log.warning("sglang engine %d restarted (pid %d) and serves weight version %d", e.index, e.pid, self._target[0])
            await self._set_state(e, _READY)
            return

    async def _resync(self, e: _Engine) -> None:
        """Bring a freshly started engine to the weights the others serve, then check its probe."""
        version, path = self._target
        if version != self._target_disk_version:
            raise _NeedsWeights(f"weight version {version} came by broadcast and has no copy on disk")
        if path is not None:
            await self._post(e, "/update_weights_from_disk",
                             {"model_path": str(path), "weight_version": str(version), "flush_cache": True})
        probe = await self._aprobe(e)
        if self._probe is not None and self._target[0] == self._version:
            diff = max(abs(a - b) for a, b in zip(probe, self._probe))
            if diff > PROBE_TOLERANCE:
                raise SGLangError(f"SGLang engine {e.index} restarted but does not serve weight version {version}: "
                                  f"probe log-probs differ by {diff:.3g} from the other engines'")

    # ---- internals: probes and weights -------------------------------------------------------

    async def _alogprobs(self, e: _Engine, prompt_ids: list[int], response_ids: list[int], temperature: float,
                         expected_version: str | None = None) -> list[float]:
        body = {
            "rid": f"gf-logprobs-{uuid.uuid4().hex[:8]}",
            "input_ids": list(prompt_ids) + list(response_ids),
            "sampling_params": {"max_new_tokens": 1, "temperature": temperature if temperature > 0 else 1.0,
                                "sampling_seed": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        out = await self._post(e, "/generate", body, timeout=min(self.settings.request_timeout_s, 120.0))
        meta = out.get("meta_info", {}) if isinstance(out, dict) else {}
        if expected_version is not None and str(meta.get("weight_version")) != expected_version:
            raise _EngineFault(f"engine {e.index} reports weight_version {meta.get('weight_version')!r}, expected {expected_version!r}")
        entries = meta.get("input_token_logprobs") or []
        tail = entries[-len(response_ids):] if len(entries) >= len(response_ids) else []
        if [int(x[1]) for x in tail] != list(response_ids) or any(x[0] is None for x in tail):
            raise SGLangError(f"SGLang engine {e.index} returned input_token_logprobs that do not line up with the "
                              f"input (got ids {[x[1] for x in entries][-8:]}, wanted {list(response_ids)[-8:]})")
        return [float(x[0]) for x in tail]

    async def _alogprobs_any(self, prompt_ids, response_ids, temperature) -> list[float]:
        for _ in range(self.settings.max_attempts):
            e = await self._acquire()
            epoch = e.epoch
            try:
                return await self._alogprobs(e, prompt_ids, response_ids, temperature)
            except _EngineFault as exc:
                self._on_fault(e, epoch, exc)
            finally:
                await self._release_slot(e)
        raise TransientError("SGLang logprobs_of failed on every try")

    async def _aprobe(self, e: _Engine) -> list[float]:
        version = str(self._target[0])
        return await self._alogprobs(e, list(PROBE_IDS[:1]), list(PROBE_IDS[1:]), 1.0, expected_version=version)

    def _check_agreement(self, probes: list[list[float]], version: int) -> None:
        for i, p in enumerate(probes[1:], start=1):
            diff = max(abs(a - b) for a, b in zip(p, probes[0]))
            if diff > PROBE_TOLERANCE:
                raise SGLangError(f"SGLang engines 0 and {i} disagree on the probe log-probs at weight version "
                                  f"{version} (max diff {diff:.3g}): they do not serve the same weights")

    async def _aall(self, fn) -> list:
        """Run fn(engine) on every live engine; an engine fault restarts that engine (which re-syncs it to
        the target weights) instead of failing the whole call."""
        async def one(e: _Engine):
            if e.fault_task is not None and not e.fault_task.done():
                await asyncio.shield(e.fault_task)  # a check or restart from earlier: let it finish first
            for _ in range(self.settings.max_attempts):
                if e.state == _DEAD:
                    return None
                epoch = e.epoch
                try:
                    return await fn(e)
                except _EngineFault as exc:
                    task = self._on_fault(e, epoch, exc)
                    if task is not None:
                        await asyncio.shield(task)
                    if e.epoch != epoch and e.state == _READY:
                        return "resynced"  # restarted after the target was set: it loaded the target weights
                    if e.epoch != epoch and e.state == _STALE:
                        return None  # restarted, and could not be given the target weights
            raise TransientError(f"SGLang engine {e.index}: gave up after {self.settings.max_attempts} tries")
        results = await asyncio.gather(*(one(e) for e in self._engines))
        if all(e.state == _DEAD for e in self._engines):
            raise TransientError(f"every SGLang engine is down; logs under {self.scratch / 'logs'}")
        return results

    async def _aall_post(self, path: str, bodies: dict[int, dict]) -> list:
        """POST to every engine at once, for the collective calls every engine must take part in: an
        engine fault fails the call (and gets the engine checked) rather than being retried."""
        async def one(e: _Engine):
            epoch = e.epoch
            try:
                return await self._post(e, path, bodies[e.index])
            except _EngineFault as exc:
                self._on_fault(e, epoch, exc)
                raise TransientError(f"SGLang engine {e.index} {path}: {exc}") from exc
        return await asyncio.gather(*(one(e) for e in self._engines))

    async def _asettle(self) -> None:
        """Restart the engines whose process has exited, and let the checks and restarts under way finish."""
        for e in self._engines:
            if e.proc is not None and e.proc.poll() is not None:
                self._on_fault(e, e.epoch, _EngineFault(f"the server exited with code {e.proc.poll()}"))
        for e in self._engines:
            if e.fault_task is not None and not e.fault_task.done():
                await asyncio.shield(e.fault_task)

    def _sync_problem(self) -> str:
        """Why the engines cannot receive a broadcast now ("" when they can)."""
        sync = self._sync
        if sync is None:
            return "the engines are in no weight-sync group (init_weight_sync)"
        if sync.broken:
            return f"weight-sync group {sync.name!r} is broken: {sync.broken}"
        for e in self._engines:
            if e.state == _DEAD:
                return f"SGLang engine {e.index} of weight-sync group {sync.name!r} is down ({e.last_fault})"
            if sync.members.get(e.index) != e.epoch:
                return f"SGLang engine {e.index} restarted since it joined weight-sync group {sync.name!r}"
        return ""

    async def _ainit_sync(self, name: str, bodies: dict[int, dict]) -> None:
        await self._asettle()
        old, self._sync = self._sync, None
        if old is not None:  # leave it, where the process that joined it is still there
            await asyncio.gather(*(self._aleave(e, old.name) for e in self._engines
                                   if old.members.get(e.index) == e.epoch and e.state != _DEAD))
        down = [e for e in self._engines if e.state == _DEAD]
        if down:
            raise SGLangError(f"SGLang engine(s) {[e.index for e in down]} are down for good "
                              f"({'; '.join(e.last_fault for e in down)}): no weight-sync group of every engine can "
                              f"be formed")
        epochs = {e.index: e.epoch for e in self._engines}
        await self._aall_post("/init_weights_update_group", bodies)
        self._sync = _SyncGroup(name, epochs)

    async def _aleave(self, e: _Engine, name: str) -> None:
        try:
            await self._post(e, "/destroy_weights_update_group", {"group_name": name},
                             timeout=self.settings.health_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a group left behind costs memory, not correctness
            log.warning("sglang engine %d: could not leave weight-sync group %r: %s", e.index, name, exc)

    async def _abroadcast_failed(self, reason: str) -> None:
        """After a failed broadcast an engine may hold part of the new weights (SGLang: "partially
        updated. Please discard the whole weights"): none serves, and the group is done with."""
        if self._sync is not None:
            self._sync.broken = reason
        for e in self._engines:
            if e.state != _DEAD:
                e.last_fault = reason
                await self._set_state(e, _STALE)

    async def _aupdate(self, path: Path, version: int, tensor_payload: list[str] | None) -> None:
        if tensor_payload is not None:
            route, body = "/update_weights_from_tensor", {"serialized_named_tensors": tensor_payload,
                                                          "flush_cache": True, "weight_version": str(version)}
        else:
            route, body = "/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version),
                                                        "flush_cache": True, "abort_all_requests": False}
        await self._aload(version, lambda: self._aall(lambda e: self._post(e, route, body)))

    async def _aload(self, version: int, send) -> None:
        """Load new weights into every engine: resume released weights, `send()`, resume the KV cache,
        verify. Stale engines take part, and serve again once the check shows the new weights."""
        stale = {e.index: e.epoch for e in self._engines if e.state == _STALE}
        if self._released:
            await self._aall(lambda e: self._post(e, "/resume_memory_occupation", {"tags": ["weights"]}))
        await send()
        if self._released:
            await self._aall(lambda e: self._post(e, "/resume_memory_occupation", {"tags": ["kv_cache"]}))
            self._released = False
        await self._averify(version)
        for e in self._engines:
            if e.state == _STALE and stale.get(e.index) == e.epoch:
                e.last_fault = ""
                await self._set_state(e, _READY)

    async def _averify(self, version: int) -> None:
        """Every engine reports `version` and the same probe log-probs; warn if they did not move."""
        self._target = (version, self._target[1])
        probes = [p for p in await self._aall(self._aprobe) if isinstance(p, list)]
        if not probes:
            return
        self._check_agreement(probes, version)
        if self._probe is not None and version != self._version:
            moved = max(abs(a - b) for a, b in zip(probes[0], self._probe))
            if moved == 0.0:
                log.warning("sglang: the probe log-probs did not change from weight version %d to %d: the update "
                            "may not have reached the engines (or the weights did not change)", self._version, version)
        self._probe = probes[0]

    async def _arelease(self) -> None:
        await self._aall(lambda e: self._post(e, "/flush_cache", None))
        await self._aall(lambda e: self._post(e, "/release_memory_occupation", {}))

    async def _aresume(self, tags: list[str] | None) -> None:
        await self._aall(lambda e: self._post(e, "/resume_memory_occupation", {"tags": tags} if tags else {}))
        self._released = False

    def _write_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> Path:
        """`<scratch>/weights/v<version>/model.safetensors` (+ the model's config.json), written then renamed."""
        from safetensors.torch import save_file
        if not named_tensors:
            raise ValueError("update_weights: no tensors given")
        final = self.scratch / "weights" / f"v{version:08d}"
        tmp = self.scratch / "weights" / f".v{version:08d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            seen: set[tuple[int, int]] = set()
            cpu: dict[str, torch.Tensor] = {}
            for name, t in named_tensors.items():
                t = t.detach()
                ident = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.device.type == "cpu" else None
                t = t.to("cpu").contiguous()
                if ident is not None and ident in seen:  # tied weights share storage: safetensors refuses that
                    t = t.clone()
                if ident is not None:
                    seen.add(ident)
                cpu[name] = t
            save_file(cpu, str(tmp / "model.safetensors"), metadata={"format": "pt", "grpoflow_weight_version": str(version)})
            src = Path(self.model_dir) / "config.json"
            if src.is_file():
                shutil.copy2(src, tmp / "config.json")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def _tensor_payload(self, named_tensors: dict[str, torch.Tensor]) -> list[str]:
        """`serialized_named_tensors` for /update_weights_from_tensor: base64 of torch's ForkingPickler dump
        of [(name, tensor), ...], one copy per TP rank (as sglang's Engine._serialize_tensors_per_rank).
        CUDA tensors travel as IPC handles, so the engine must be on this host."""
        import io
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401  (registers the tensor reductions)
        buf = io.BytesIO()
        ForkingPickler(buf).dump([(name, t.detach()) for name, t in named_tensors.items()])
        data = base64.b64encode(buf.getvalue()).decode("ascii")
        return [data] * self.settings.tp_size
