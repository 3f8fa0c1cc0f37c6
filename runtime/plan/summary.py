"""What a config will do, in words and numbers: printed by `grpoflow validate` and at the start of a run."""
from __future__ import annotations

from datetime import datetime, timezone

from runtime.config import GrpoConfig


def default_run_id(cfg: GrpoConfig) -> str:
    return f"{cfg.name}-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"


def _short(points: list[int]) -> str:
    if len(points) <= 6:
        return str(points)
    return f"[{points[0]}, {points[1]}, {points[2]}, …, {points[-1]}] ({len(points)} evals)"


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
        f"eval          after rollouts {_short(evals)}, {e.n_samples_per_prompt} samples/prompt, pass@{e.pass_k}",
        f"cluster       backend={cfg.cluster.backend}"
        + (f" address={cfg.cluster.address}" if cfg.cluster.address else "")
        + f" colocate={cfg.cluster.colocate} engine={r.engine}",
        f"storage       {cfg.storage.root}/runs/<run_id>/",
    ]
    return lines


def _model_config_offline(source: str):
    """The model's HF config without downloading weights: a local dir, or the local HF cache for hf://."""
    from runtime.models import load_hf_config
    if source.startswith("hf://"):
        from huggingface_hub import hf_hub_download
        repo, _, rev = source[len("hf://"):].partition("@")
        path = hf_hub_download(repo, "config.json", revision=rev or None, local_files_only=True)
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(path.rsplit("/", 1)[0])
    if "://" in source:
        return None
    return load_hf_config(source)


def memory_lines(cfg: GrpoConfig, gpu_mem_gb: float) -> list[str]:
    """The per-GPU memory estimate, when the model's config.json is at hand (no download)."""
    from runtime.plan.memory import estimate_for_config, format_estimate
    try:
        hf_config = _model_config_offline(cfg.model.source)
    except Exception:  # noqa: BLE001 - not cached / not a model dir: validate stays offline and fast
        hf_config = None
    if hf_config is None:
        return [f"memory        no estimate: {cfg.model.source} has no config.json at hand "
                f"(give a local model dir, or fetch it once so the HF cache has it)"]
    return format_estimate(estimate_for_config(cfg, hf_config, gpu_mem_gb=gpu_mem_gb)).splitlines()


def layout_lines(cfg: GrpoConfig) -> list[str]:
    """Where trainer ranks and the engine go; raises ConfigError when the layout cannot run here
    (model shapes when the config.json is at hand; this machine's GPUs under cluster.backend=local)."""
    from runtime.placement import layout
    try:
        hf_config = _model_config_offline(cfg.model.source)
    except Exception:  # noqa: BLE001 - not at hand: the train stage checks again after fetch
        hf_config = None
    gpus = None
    if cfg.cluster.backend == "local" and cfg.cluster.device != "cpu" and cfg.cluster.trainer_gpus:
        import torch
        gpus = torch.cuda.device_count()
    layout.check_layout(cfg, hf_config=hf_config, gpus_available=gpus)
    c, t = cfg.cluster, cfg.train
    if c.trainer_gpus:
        engine = (f"GPU {layout.engine_gpu(cfg)} (shared with trainer rank 0)" if c.colocate
                  else f"{c.rollout_gpus} GPU(s) of its own from GPU {layout.engine_gpu(cfg)}")
        where = f"trainer DP {t.data_parallel} × TP {t.tensor_parallel} on GPUs 0-{c.trainer_gpus - 1}; engine on {engine}"
    else:
        where = f"trainer DP {t.data_parallel} × TP {t.tensor_parallel}, engine beside it (no GPU accounting)"
    checked = "" if gpus is not None else " (GPUs checked when the cluster starts)" if c.trainer_gpus else ""
    return [f"layout        {where}; weight sync {layout.weight_sync_mode(cfg)}{checked}"]
