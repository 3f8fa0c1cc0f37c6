"""What a config will do, in words and numbers: printed by `grpoflow validate` and at the start of a run."""
from __future__ import annotations

from datetime import datetime, timezone

from .config import GrpoConfig


def default_run_id(cfg: GrpoConfig) -> str:
    return f"{cfg.name}-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"


def plan_lines(cfg: GrpoConfig) -> list[str]:
    r, t, c, e = cfg.rollout, cfg.train, cfg.checkpoint, cfg.eval
    samples = cfg.samples_per_rollout
    chunks = cfg.chunk_bounds()
    evals = cfg.eval_points()
    lines = [
        f"config        {cfg.name}",
        "stages        fetch → convert → prepare → train ({} chunks) → evaluate ({}×) → register".format(
            len(chunks), len(evals) * len(cfg.data.eval) if cfg.data.eval else 0),
        f"model         {cfg.model.source}",
        f"train data    {cfg.data.train.source}",
        "eval data     " + (", ".join(f"{k}={v.source}" for k, v in cfg.data.eval.items()) or "none"),
        f"golden rule   rollout_batch_size × n_samples_per_prompt = {r.rollout_batch_size} × "
        f"{r.n_samples_per_prompt} = {samples} = global_batch_size × num_steps_per_rollout = "
        f"{t.global_batch_size} × {t.num_steps_per_rollout}  ✓",
        f"micro-batches {t.global_batch_size // (t.data_parallel * t.micro_batch_size)} per step per DP rank "
        f"(micro_batch_size {t.micro_batch_size}, DP {t.data_parallel}, TP {t.tensor_parallel})",
        f"total         {t.num_rollout} rollouts × {samples} samples = {t.num_rollout * samples} samples, "
        f"{t.num_rollout * t.num_steps_per_rollout} optimizer steps",
        f"chunking      {len(chunks)} chunks of {c.interval} rollouts (one checkpoint each, keep last {c.keep_last})",
        f"eval          after rollouts {evals}, {e.n_samples_per_prompt} samples/prompt, pass@{e.pass_k}",
        f"cluster       backend={cfg.cluster.backend}"
        + (f" address={cfg.cluster.address}" if cfg.cluster.address else "")
        + f" colocate={cfg.cluster.colocate} engine={r.engine}",
        f"storage       {cfg.storage.root}/runs/<run_id>/",
    ]
    return lines
