"""The GRPO loop: sample n responses per prompt → reward → group advantages → update → sync weights.

`TrainSession` holds the live actors of one run (trainer ranks + rollout engine) across chunks.
Whatever state they hold is named by `self.at` (rollouts done); a chunk that finds them elsewhere, or
dead, rebuilds them from the newest intact checkpoint. Every sample's randomness is keyed by
(seed, rollout id, prompt index, sample index), so a resumed run repeats an unbroken one exactly.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable

import torch

from runtime.run import checkpoint
from runtime.algo import fill_batch, group_advantages
from runtime.placement.cluster import Cluster
from runtime.config import GrpoConfig
from runtime.errors import ConfigError
from runtime.rewards.catalog import get_reward_fn
from runtime.rewards.timeout import score_batch
from runtime.rollout.base import SampleRequest, SamplingParams
from runtime.run.directory import RunDir
from runtime.trainer.batch import TrainBatch
from runtime.placement.weight_sync import TrainerToEngine

log = logging.getLogger("grpoflow.train")


class ChunkError(RuntimeError):
    """A chunk that could not make progress (a resume must prove progress)."""


def sampling_params(d: dict) -> SamplingParams:
    return SamplingParams(temperature=d["temperature"], top_p=d["top_p"], top_k=d["top_k"],
                          max_new_tokens=d["max_new_tokens"])


class TrainSession:
    def __init__(self, cfg: GrpoConfig, rd: RunDir):
        from transformers import AutoTokenizer

        from runtime.inputs.datasets import PromptDataset
        self.cfg, self.rd = cfg, rd
        from runtime.models import load_hf_config
        self.cluster = Cluster(cfg, hf_config=load_hf_config(rd.local(rd.hf_model))).start()
        self.tokenizer = AutoTokenizer.from_pretrained(rd.local(rd.hf_model))  # local copy on a remote run dir
        self.dataset = PromptDataset(rd.train_data, shuffle=cfg.data.shuffle)
        self.reward_fn = get_reward_fn(cfg.rollout.reward)
        self.custom_rollout = None
        if cfg.rollout.custom_rollout:
            from runtime.rollout.custom import load_custom_rollout
            self.custom_rollout = load_custom_rollout(cfg.rollout.custom_rollout)
        self.trainer = None
        self.engine = None
        self.at: int | None = None  # rollouts done by the state the live actors hold
        self.state: dict = {}
        self.builds = 0

    # -- actors --------------------------------------------------------------------------------
    def _build(self) -> None:
        self.close_actors()
        c = self.cfg
        self.trainer = self.cluster.trainer_group(
            hf_dir=self.rd.local(self.rd.hf_model), init_checkpoint=self.rd.local(self.rd.torch_dist),
            train=c.train.model_dump(), algorithm=c.algorithm.model_dump(), temperature=c.rollout.temperature)
        self.engine = self.cluster.engine(self.rd.local(self.rd.hf_model))
        self.at = None
        self.builds += 1
        # a fresh group name per build: c10d keeps the names of groups already made
        self.weights = TrainerToEngine(self.trainer, self.engine, self.cluster.weight_sync,
                                       tensors_on_cpu=self.cfg.cluster.backend == "ray",
                                       group_name=f"grpoflow_weights_{self.builds}")

    def close_actors(self) -> None:
        for g in (self.trainer, self.engine):
            if g is not None:
                g.kill()
        self.trainer = self.engine = None

    def close(self) -> None:
        self.close_actors()
        self.cluster.shutdown()

    def alive(self) -> bool:
        if self.trainer is None or self.engine is None:
            return False
        try:
            self.trainer.call("ping")
            self.engine.call("health")
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
            self.trainer.call("load", f"{ckpt.path}/model")
            self.state = dict(ckpt.state)
        else:
            self.state = {"rollout": 0, "cursor": self.dataset.initial_cursor(self.cfg.train.seed), "metrics": []}
        self._sync_weights(version=target)
        self.at = target

    def _sync_weights(self, version: int) -> float:
        t0 = time.time()
        self.weights.push(version)
        return time.time() - t0

    # -- one rollout ---------------------------------------------------------------------------
    def _generate(self, rows: list[dict], rollout_id: int, first_prompt: int, sampling: SamplingParams, n: int):
        seed = self.cfg.train.seed
        if self.custom_rollout is not None:
            keys = [[(seed, rollout_id, first_prompt + i, j) for j in range(n)] for i in range(len(rows))]
            return self.custom_rollout(_EngineView(self.engine), rows, sampling, keys, self.reward_fn)
        reqs = []
        for i, row in enumerate(rows):
            ids = self.tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
            reqs += [SampleRequest(prompt_ids=ids, key=(seed, rollout_id, first_prompt + i, j)) for j in range(n)]
        flat = self.engine.call("generate", reqs, sampling)[0]
        return [flat[i * n:(i + 1) * n] for i in range(len(rows))]

    def _score(self, rows: list[dict], groups) -> list[list[float]]:
        texts, labels, metas, where = [], [], [], []
        for gi, (row, samples) in enumerate(zip(rows, groups)):
            for si, s in enumerate(samples):
                if getattr(s, "reward", None) is None:
                    texts.append(s.text)
                    labels.append(row["label"])
                    metas.append(row.get("metadata") or {})
                    where.append((gi, si))
        scored, failed = score_batch(self.reward_fn, texts, labels, metas, self.cfg.rollout.reward_timeout_s)
        rewards = [[s.reward if getattr(s, "reward", None) is not None else 0.0 for s in g] for g in groups]
        for (gi, si), r in zip(where, scored):
            rewards[gi][si] = float(r)
        self._reward_failures = failed
        return rewards

    def rollout(self, rollout_id: int) -> dict[str, Any]:
        c = self.cfg
        n, need = c.rollout.n_samples_per_prompt, c.rollout.rollout_batch_size
        sampling = sampling_params(c.rollout_sampling())
        t0 = time.time()
        cursor = self.state["cursor"]
        rows_all, groups_all, rewards_all = [], [], []
        attempts = 0
        generate_s = reward_s = 0.0
        # Dynamic sampling draws extra prompts and keeps the first `need` groups whose rewards differ.
        while True:
            want = need if not c.rollout.dynamic_sampling else max(need, int(need * c.rollout.over_sampling_factor))
            rows, cursor = self.dataset.batch(cursor, want)
            t_gen = time.time()
            groups = self._generate(rows, rollout_id, len(rows_all), sampling, n)
            t_reward = time.time()
            rewards = self._score(rows, groups)
            generate_s += t_reward - t_gen
            reward_s += time.time() - t_reward
            rows_all += rows
            groups_all += groups
            rewards_all += rewards
            attempts += 1
            if not c.rollout.dynamic_sampling:
                break
            kept, _ = fill_batch(list(range(len(rows_all))), rewards_all, need)
            if len(kept) >= need or attempts >= 4:
                break
        gen_time = time.time() - t0
        if c.rollout.dynamic_sampling:
            kept, dropped = fill_batch(list(range(len(rows_all))), rewards_all, need)
            # too few informative groups after the attempts: fill with uninformative ones (zero advantage)
            kept += [i for i in range(len(rows_all)) if i not in kept][: need - len(kept)]
            kept = sorted(kept)
        else:
            kept, dropped = list(range(len(rows_all))), 0
        rows = [rows_all[i] for i in kept]
        groups = [groups_all[i] for i in kept]
        rewards = [rewards_all[i] for i in kept]

        flat_rewards = torch.tensor([r for g in rewards for r in g], dtype=torch.float32)
        adv = group_advantages(flat_rewards, n, normalize_std=c.algorithm.normalize_adv_std)
        samples = [s for g in groups for s in g]
        batch = TrainBatch(
            tokens=[list(s.prompt_ids) + list(s.response_ids) for s in samples],
            prompt_lens=[len(s.prompt_ids) for s in samples],
            advantages=adv.tolist(),
            loss_masks=[s.effective_loss_mask() for s in samples],
            rollout_logprobs=[list(s.response_logprobs) for s in samples])
        if c.cluster.colocate and c.rollout.engine == "sglang":
            # free the engine's GPU memory for the update; the next weight sync takes it back
            self.engine.call("release_memory")
        train_metrics = self.trainer.call("train", batch)[0]
        sync_s = self._sync_weights(version=rollout_id + 1)
        self.state["cursor"] = cursor

        lens = [len(s.response_ids) for s in samples]
        gen_tokens = sum(len(s.response_ids) for g in groups_all for s in g)
        all_r = [r for g in rewards_all for r in g]
        metrics = {
            "rollout": rollout_id,
            "reward_mean": statistics.fmean(flat_rewards.tolist()),
            "reward_std": statistics.pstdev(flat_rewards.tolist()) if len(flat_rewards) > 1 else 0.0,
            "reward_mean_all": statistics.fmean(all_r),
            "response_len_mean": statistics.fmean(lens),
            "response_len_max": max(lens),
            "truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "rollout_tok_s": gen_tokens / max(gen_time, 1e-9),
            "rollout_time_s": gen_time,
            "generate_s": generate_s,
            "reward_s": reward_s,
            "weight_sync_s": sync_s,
            "groups_dropped": dropped,
            "reward_failures": self._reward_failures,
            **train_metrics,
        }
        metrics["train_tok_s"] = train_metrics["train_tokens"] / max(train_metrics["train_time_s"], 1e-9)
        metrics["step_time_s"] = time.time() - t0
        return metrics

    # -- one chunk -----------------------------------------------------------------------------
    def run_chunk(self, start: int, end: int, on_rollout: Callable[[dict], None] | None = None) -> dict:
        """Rollouts [start, end) from the newest intact checkpoint, then a checkpoint at `end`."""
        ckpt = checkpoint.latest(self.rd)
        at = ckpt.rollout if ckpt else 0
        if at >= end:
            return {"start": start, "end": end, "skipped": True, "metrics": _chunk_metrics(self.rd, end)}
        if at != start:
            raise ChunkError(f"chunk [{start}, {end}) cannot start: the newest intact checkpoint is at rollout {at}")
        self.ensure_at(ckpt)
        chunk_metrics = []
        for rid in range(start, end):
            m = self.rollout(rid)
            chunk_metrics.append(m)
            if on_rollout:
                on_rollout(m)
        # No RNG state to save: sampling noise is keyed by (seed, rollout, prompt, sample) and training
        # draws no random numbers (dropout is off).
        state = {"cursor": self.state["cursor"], "metrics": chunk_metrics, "rng": {"keyed_seed": self.cfg.train.seed}}
        trainer = self.trainer
        t_save = time.time()
        checkpoint.save(self.rd, end, lambda path: trainer.call("save", path), state, self.cfg.checkpoint.keep_last)
        if not chunk_metrics:
            raise ChunkError(f"chunk [{start}, {end}) trained nothing")
        # The chunk's save is charged to its last rollout (the metrics logged to MLflow after the chunk).
        chunk_metrics[-1]["checkpoint_s"] = time.time() - t_save
        self.at = end
        self.state = {**state, "rollout": end}
        return {"start": start, "end": end, "skipped": False, "metrics": chunk_metrics,
                "trainer_pid": self.trainer.call("pid")[0]}


    # -- evaluation ----------------------------------------------------------------------------
    def evaluate(self, rollout: int) -> dict[str, dict]:
        """Eval sets on the policy after `rollout` rollouts; read back when already done."""
        from runtime.inputs.datasets import read_prepared
        from runtime.grpo.evaluation import evaluate, load_eval, save_eval
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
        c = self.cfg
        results = {}
        for name in c.data.eval:
            results[name] = evaluate(
                lambda reqs, sp: self.engine.call("generate", reqs, sp)[0], self.tokenizer,
                read_prepared(self.rd.eval_data(name)), n_samples=c.eval.n_samples_per_prompt,
                sampling=sampling_params(c.eval_sampling()), seed=c.train.seed, eval_point=rollout,
                ks=c.eval.pass_k, max_prompts=c.eval.max_prompts, reward_timeout_s=c.rollout.reward_timeout_s)
        save_eval(self.rd, rollout, results)
        return results


def _chunk_metrics(rd: RunDir, end: int) -> list[dict]:
    path = rd.checkpoint(end)
    if checkpoint.verify(path) is None:
        return checkpoint.read_state(path).get("metrics", [])
    return []


class _EngineView:
    """What a custom rollout function sees: `generate(requests, sampling)` on the live engine."""

    def __init__(self, group):
        self._group = group

    def generate(self, requests, sampling):
        return self._group.call("generate", requests, sampling)[0]


def check_trainable(cfg: GrpoConfig) -> None:
    if cfg.algorithm.entropy_coef and cfg.train.tensor_parallel > 1:
        raise ConfigError("algorithm.entropy_coef > 0 needs train.tensor_parallel=1 (entropy bonus under TP is not supported)")
