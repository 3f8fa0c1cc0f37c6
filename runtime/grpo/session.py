"""The live side of a run's train stage: the trainer and engine actors, the run's state, one rollout.

`TrainSession` holds the live actors of one run across chunks. Whatever state they hold is named by
`self.at` (rollouts done); a chunk that finds them elsewhere, or dead, rebuilds them from the newest
intact checkpoint. Every sample's randomness is keyed by (seed, rollout id, prompt index, sample
index), so a resumed run repeats an unbroken one exactly.
"""
from __future__ import annotations

import copy
import logging
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from runtime.config import GrpoConfig
from runtime.grpo.collect import Collector, sampling_params
from runtime.grpo.rollout_batch import advantages, rollout_metrics, to_train_batch
from runtime.placement import layout
from runtime.placement.cluster import Cluster
from runtime.placement.handles import EngineHandle, TrainerHandle
from runtime.placement.weight_sync import TrainerToEngine
from runtime.plan.memory import offload_enabled
from runtime.rewards.catalog import get_reward_fn
from runtime.run import checkpoint
from runtime.run.directory import RunDir
from runtime.testing.moments import moment

log = logging.getLogger(__name__)


class ChunkError(RuntimeError):
    """A chunk that could not make progress (a resume must prove progress)."""


class TrainSession:
    def __init__(self, cfg: GrpoConfig, rd: RunDir):
        from transformers import AutoTokenizer

        from runtime.inputs.datasets import PromptDataset
        from runtime.models import load_hf_config
        self.cfg, self.rd = cfg, rd
        self.cluster = Cluster(cfg, hf_config=load_hf_config(rd.local(rd.hf_model))).start()
        self.tokenizer = AutoTokenizer.from_pretrained(rd.local(rd.hf_model))  # local copy on a remote run dir
        self.dataset = PromptDataset(rd.train_data, shuffle=cfg.data.shuffle)
        self.reward_fn = get_reward_fn(cfg.rollout.reward)
        self.custom_rollout = None
        if cfg.rollout.custom_rollout:
            from runtime.rollout.custom import load_custom_rollout
            self.custom_rollout = load_custom_rollout(cfg.rollout.custom_rollout)
        self.trainer: TrainerHandle | None = None
        self.engine: EngineHandle | None = None
        self.offload = offload_enabled(cfg, self.cluster.device)
        self.at: int | None = None  # rollouts done by the state the live actors hold
        self.state: dict = {}
        self.builds = 0
        self.writing: checkpoint.Writing | None = None  # the checkpoint being written beside the loop
        self.stall_s = 0.0  # the loop's stall for it
        self.stall_parts: dict[str, float] = {}
        self._finished: dict | None = None  # its files written and finalized, not yet published
        self.written: dict[int, dict] = {}  # rollout → its writer's times (stall, write, hash), as its state keeps

    # -- actors --------------------------------------------------------------------------------
    def _build(self) -> None:
        self.close_actors()
        c = self.cfg
        self.trainer = self.cluster.trainer(
            hf_dir=self.rd.local(self.rd.hf_model), init_checkpoint=self.rd.local(self.rd.torch_dist),
            train=c.train, algorithm=c.algorithm, temperature=c.rollout.temperature,
            true_on_policy=c.rollout.true_on_policy)
        # LoRA with trainer and engine in this process: one copy of the base, the trainer's (runtime/placement/layout.py)
        shared = self.trainer.shared_base() if layout.shares_base(c) else None
        if self.offload:  # the plan puts the engine's KV pool beside the trainer's weights, not its whole state
            log.info("trainer state off the GPU for the engine's build: %s", self.trainer.offload_state())
        self.engine = self.cluster.engine(self.rd.local(self.rd.hf_model), shared_base=shared)
        if self.offload:  # then the GPU is the trainer's, as after every engine turn (GLM-Z1-9B on an H200 ran out
            self.engine.release_memory()  # of memory building its 99 GiB pool beside 30.7 GiB of trainer state)
            self.trainer.reload_state()
        self.collector = Collector(c, self.engine, self.dataset, self.tokenizer, self.reward_fn, self.custom_rollout)
        self.at = None
        self.builds += 1
        # a fresh group name per build: c10d keeps the names of groups already made
        self.weights = TrainerToEngine(self.trainer, self.engine, self.cluster.weight_sync,
                                       transport=self.cluster.direct_transport,
                                       group_name=f"grpoflow_weights_{self.builds}")

    def close_actors(self) -> None:
        """The checkpoint being written made durable first (its files are written by the trainer: a failure is
        logged, and a resume starts from the checkpoint before it), then the actors stopped."""
        if self.writing is not None:
            where = self.writing.where
            try:
                self.wait_durable()
            except Exception as e:  # noqa: BLE001 - stopping anyway (after a failure): the older checkpoint stays
                log.warning("checkpoint %s not completed (%s: %s); a resume starts from the one before",
                            where, type(e).__name__, e)
        for handle in (self.engine, self.trainer):  # the engine first: it leaves the weight-sync group rank 0 hosts
            if handle is not None:
                handle.kill()
        self.trainer = self.engine = None

    def close(self) -> None:
        """The actors (after the checkpoint being written is durable) and the cluster stopped. The train stage
        makes the last checkpoint durable before the run's end already (:meth:`wait_durable`)."""
        try:
            self.close_actors()
        finally:
            self.cluster.shutdown()

    def alive(self) -> bool:
        if self.trainer is None or self.engine is None:
            return False
        try:
            self.trainer.ping()
            self.engine.health()
            return True
        except Exception as e:  # noqa: BLE001 - a dead actor is why we rebuild
            log.warning("live actors unusable (%s: %s); rebuilding from the latest checkpoint", type(e).__name__, e)
            return False

    def ensure_at(self, ckpt: checkpoint.Checkpoint | None) -> None:
        """Bring the live actors to the state of `ckpt` (None: the converted initial model)."""
        target = ckpt.rollout if ckpt else 0
        if self.at == target and self.alive():
            return
        if not self.alive() or self.at is None or self.at != target:
            self._build()
        if ckpt is not None:
            self.trainer.load(f"{ckpt.path}/model")
            self.state = dict(ckpt.state)
            if "writer" in ckpt.state:
                self.written[ckpt.rollout] = ckpt.state["writer"]
        else:
            self.state = {"rollout": 0, "cursor": self.dataset.initial_cursor(self.cfg.train.seed), "metrics": []}
        self.weights.push(target)
        self.at = target

    # -- the memory hand-off: the engine's turn on a colocated GPU --------------------------------
    @contextmanager
    def engine_turn(self) -> Iterator[dict[str, Any]]:
        """Every generate of the loop runs inside one (a rollout's, an evaluation's, a benchmark's warm-up):
        the trainer's grads, master weights and Adam go to the host (when offloading) and the engine's KV
        pool comes back; after the block the pool is freed and the trainer's state returns. Yields what
        the moves reported (`offload` / `reload`: bytes and seconds; None where nothing moved). A block
        that raises leaves the memory as it is (the chunk fails; its actors are rebuilt). Under Ray the
        trainer is another process: the offload also hands its freed blocks back to the driver, which the
        engine could not use otherwise (an evaluation on two H100s ran out of memory beside 51.7 GiB of them)."""
        moved: dict[str, Any] = {"offload": None, "reload": None}
        if self.offload:
            moved["offload"] = self.trainer.offload_state()
        if self.cfg.cluster.colocate:
            self.engine.resume_memory()  # the KV pool back from the last update
        yield moved
        if self.cfg.cluster.colocate:
            self.engine.release_memory()  # the trainer gets the memory generation used
        if self.offload:
            moved["reload"] = self.trainer.reload_state()

    # -- one rollout: collect → advantages → train → push weights --------------------------------
    def rollout(self, rollout_id: int) -> dict[str, Any]:
        c = self.cfg
        t0 = time.time()
        with self.engine_turn():
            # generate + score (+ dynamic sampling; partial rollout: with the groups the last rollout left)
            batch = self.collector.collect(rollout_id, self.state["cursor"], self.state.get("partial"))
            adv = advantages(batch, c.rollout.n_samples_per_prompt, c.algorithm.normalize_adv_std)
        train = self.trainer.train(to_train_batch(batch, adv))
        check_finite(rollout_id, train, c)  # before the weights reach the engine, a checkpoint or the registry
        t_sync = time.time()
        self.weights.push(version=rollout_id + 1)
        sync_s = time.time() - t_sync
        self.state["cursor"] = batch.cursor
        if batch.partial_state is not None:
            self.state["partial"] = batch.partial_state
        return rollout_metrics(rollout_id, batch, train, weight_sync_s=sync_s, step_time_s=time.time() - t0)

    # -- one chunk -----------------------------------------------------------------------------
    def run_chunk(self, start: int, end: int, on_rollout: Callable[[dict], None] | None = None) -> dict:
        """Rollouts [start, end) from the newest intact checkpoint, then a checkpoint at `end` (written beside the
        next chunk with ``checkpoint.background``: the loop waits only for the trainer's host copy)."""
        if self.writing is not None and (self.writing.rollout != start or not self.alive() or self.trainer.save_done()):
            # durable as soon as it is written: a trainer lost later in this chunk is rebuilt from it
            self.wait_durable()
        if self.writing is None:
            # a checkpoint the live actors hold is checked complete, not hashed: nothing is loaded from it
            ckpt = checkpoint.latest(self.rd, held=self.at if self.alive() else None)
            at = ckpt.rollout if ckpt else 0
            if at >= end:
                return {"start": start, "end": end, "skipped": True, "metrics": _chunk_metrics(self.rd, end)}
            if at != start:
                raise ChunkError(f"chunk [{start}, {end}) cannot start: the newest intact checkpoint is at rollout {at}")
            self.ensure_at(ckpt)
        # else: the live actors hold rollout `start`, whose checkpoint is being written
        chunk_metrics = []
        for rid in range(start, end):
            if self.writing is not None:
                moment("checkpoint-pending")  # a rollout starts beside the last chunk's checkpoint, not yet durable
            m = self.rollout(rid)
            chunk_metrics.append(m)
            if on_rollout:
                on_rollout(m)
            if self.writing is not None and self.trainer.save_done():
                self.wait_durable()  # written: durable now rather than at the next checkpoint
        if not chunk_metrics:
            raise ChunkError(f"chunk [{start}, {end}) trained nothing")
        self.wait_durable()  # one checkpoint at a time: the one this chunk started from, durable first
        if start in self.written:  # its writer's times, on this chunk's last rollout (a resumed run reads them back)
            chunk_metrics[-1].update(checkpoint_write_s=self.written[start]["write_s"],
                                     checkpoint_hash_s=self.written[start]["hash_s"])
        # No RNG state to save: sampling noise is keyed by (seed, rollout, prompt, sample) and training
        # draws no random numbers (dropout is off).
        state = {"cursor": self.state["cursor"], "metrics": chunk_metrics, "rng": {"keyed_seed": self.cfg.train.seed}}
        if "partial" in self.state:  # the groups in flight (tokens, log-probs, weight versions): resumed exactly
            state["partial"] = self.state["partial"]
        t0 = time.time()
        background = self.cfg.checkpoint.background
        # a copy: the next chunk's rollouts change the live state (the partial buffer in place) before it is written
        self.writing = checkpoint.Writing(self.rd, end, copy.deepcopy(state), self.cfg.checkpoint.keep_last)
        try:
            began = self.trainer.save_begin(self.writing.model_dir, background)
        except BaseException as e:
            self.writing.abandon(e)
            self.writing, self.at = None, None  # the trainer's state is unknown: rebuilt from disk on a retry
            raise
        self.at = end
        self.state = {**state, "rollout": end}
        if not background:
            self._finish_writing()  # the files first: an inline save's time is the whole write
        # the loop's time for the checkpoint, on the chunk's last rollout, inside the state written with it, so a
        # resumed run that reads the chunk back logs the same metrics as the run that made it
        self.stall_s = time.time() - t0
        # where the stall went, the slowest rank's each (kept with the checkpoint's writer times)
        self.stall_parts = {k: v for k, v in began.items() if k != "stall_s"}
        for metrics in (chunk_metrics, self.writing.state["metrics"]):  # the live ones, and the ones it will hold
            metrics[-1].update(checkpoint_s=self.stall_s, checkpoint_stall_s=self.stall_s)
        if not background:
            self._publish_writing()
        return {"start": start, "end": end, "skipped": False, "metrics": chunk_metrics,
                "checkpoint_s": self.stall_s, "trainer_pid": self.trainer.pid()}

    # -- the checkpoint being written ------------------------------------------------------------
    def wait_durable(self, rollout: int | None = None) -> None:
        """Make the checkpoint being written durable — every rank's files, trainer_state.json, the manifest,
        `latest` moved, the prune — waiting for the writer where it is not done. ``rollout``: only if that is
        the one being written (a no-op otherwise, and when none is). Call it before anything reads the
        checkpoint from disk (a registration's export) and before the run ends. A write that failed raises
        here (ChunkError): the checkpoint is lost, a resume starts from the one before."""
        if self.writing is None or (rollout is not None and self.writing.rollout != rollout):
            return
        if self._finished is None:
            self._finish_writing()
        self._publish_writing()

    def _finish_writing(self) -> None:
        w = self.writing
        try:
            self._finished = self.trainer.save_finish()
        except BaseException as e:
            w.abandon(e)
            self.writing, self.at = None, None  # the actors are rebuilt from the newest durable checkpoint
            raise ChunkError(f"checkpoint {w.where} could not be written ({type(e).__name__}: {e}); "
                             "`grpoflow resume` starts from the checkpoint before it") from e

    def _publish_writing(self) -> None:
        w, done = self.writing, self._finished
        self.writing = self._finished = None
        times = {"stall_s": self.stall_s, "write_s": done["write_s"], "hash_s": done["hash_s"],
                 "stall_parts_s": self.stall_parts}
        w.complete(done["files"], times)
        self.written[w.rollout] = times
        log.info("checkpoint %s durable: loop stalled %.2f s (%s), write %.2f s, hash %.2f s", w.where,
                 times["stall_s"], ", ".join(f"{k} {v:.2f}" for k, v in self.stall_parts.items()),
                 times["write_s"], times["hash_s"])

    # -- evaluation ----------------------------------------------------------------------------
    def evaluate(self, rollout: int) -> dict[str, dict]:
        """Eval sets on the policy after `rollout` rollouts; read back when already done."""
        from runtime.grpo.evaluation import evaluate, load_eval, save_eval
        from runtime.inputs.datasets import read_prepared
        done = load_eval(self.rd, rollout)
        if done is not None:
            return done
        if self.at != rollout or not self.alive():
            ckpt = None
            if rollout > 0:
                path = self.rd.checkpoint(rollout)
                problem = checkpoint.verify(path)
                if problem is not None:
                    raise ChunkError(f"cannot evaluate rollout {rollout}: checkpoint {path} is unusable ({problem})")
                ckpt = checkpoint.Checkpoint(rollout, path, checkpoint.read_state(path), self.rd.state_dir)
            self.ensure_at(ckpt)
        if self.writing is not None:
            moment("checkpoint-pending")  # an evaluation starts beside the checkpoint being written
        c = self.cfg
        results = {}
        with self.engine_turn():  # as a rollout generates: the trainer's state off a shared GPU
            for name in c.data.eval:
                results[name] = evaluate(
                    self.engine.generate, self.tokenizer, read_prepared(self.rd.eval_data(name)),
                    n_samples=c.eval.n_samples_per_prompt, sampling=sampling_params(c.eval_sampling()),
                    seed=c.train.seed, eval_point=rollout, ks=c.eval.pass_k, max_prompts=c.eval.max_prompts,
                    reward_timeout_s=c.rollout.reward_timeout_s)
        save_eval(self.rd, rollout, results)
        return results


def check_finite(rollout_id: int, train: dict[str, Any], cfg: GrpoConfig) -> None:
    """Raise TrainingDiverged (one line: the rollout, the quantity, the fix) when the update made the loss, the
    gradient norm or any weight inf or NaN: nothing after it is worth saving, pushing or registering."""
    import math

    from runtime.errors import TrainingDiverged
    bad_weights = train.pop("nonfinite_weights", 0)
    grad_norm = train.get("grad_norm")
    if not math.isfinite(train["loss"]):
        what = f"the loss is {train['loss']}"
    elif cfg.train.clip_grad > 0 and grad_norm is not None and not math.isfinite(grad_norm):
        what = f"the gradient norm is {grad_norm}"  # megatron reports none without clipping
    elif bad_weights:
        what = f"{bad_weights} weight tensor(s) hold inf or NaN after the update"
    else:
        return
    clip = "" if cfg.train.clip_grad > 0 else " or set train.clip_grad (e.g. 1.0; 0 is off)"
    raise TrainingDiverged(
        f"rollout {rollout_id}: training diverged: {what} (train.lr={cfg.train.lr:g}); the run stopped before "
        f"anything of it was saved or registered; lower train.lr{clip} and start a new run")


def _chunk_metrics(rd: RunDir, end: int) -> list[dict]:
    path = rd.checkpoint(end)
    if checkpoint.verify(path, hashed=False) is None:  # only its trainer_state.json is read
        return checkpoint.read_state(path).get("metrics", [])
    return []
