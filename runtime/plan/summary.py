"""What a config will do, in words and numbers: printed by `grpoflow validate` and at the start of a run."""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from runtime.config import GrpoConfig


def default_run_id(cfg: GrpoConfig) -> str:
    return f"{cfg.name}-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"


def _short(points: list[int]) -> str:
    if len(points) <= 6:
        return str(points)
    return f"[{points[0]}, {points[1]}, {points[2]}, …, {points[-1]}] ({len(points)} evals)"


def counted(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def plan_lines(cfg: GrpoConfig) -> list[str]:
    r, t, c, e = cfg.rollout, cfg.train, cfg.checkpoint, cfg.eval
    samples = cfg.samples_per_rollout
    chunks = cfg.chunk_bounds()
    evals = cfg.eval_points()
    lines = [
        f"config        {cfg.name}",
        "stages        fetch → convert → prepare → train ({}) → evaluate ({}×) → register".format(
            counted(len(chunks), "chunk"), len(evals) * len(cfg.data.eval) if cfg.data.eval else 0),
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
        f"chunking      {counted(len(chunks), 'chunk')} of {counted(c.interval, 'rollout')} (one checkpoint each, keep last {c.keep_last})",
        f"eval          after rollouts {_short(evals)}, {e.n_samples_per_prompt} samples/prompt, pass@{e.pass_k}",
        f"cluster       backend={cfg.cluster.backend}"
        + (f" address={cfg.cluster.address}" if cfg.cluster.address else "")
        + f" colocate={cfg.cluster.colocate} engine={r.engine}",
        f"storage       {cfg.storage.root}/runs/<run_id>/",
    ]
    if t.lora.enabled:
        lines.insert(7, lora_line(cfg))
    if r.weights_dtype == "fp8":
        lines.append(fp8_line(cfg))
    return lines


def fp8_line(cfg: GrpoConfig) -> str:
    tis = ("TIS on (algorithm.use_tis: the default with fp8 weights)" if cfg.algorithm.use_tis else
           "TIS off (algorithm.use_tis: false set in the config; fp8 rollouts' log-probs differ from the trainer's)")
    return ("fp8 rollout   the engine's linear layers in e4m3 (a scale per output row and per token), quantised "
            f"from the trainer's weights at each sync; embeddings and head in the model's dtype; {tis}")


def lora_line(cfg: GrpoConfig) -> str:
    from runtime.placement.layout import shares_base
    lo, t = cfg.train.lora, cfg.train
    where = ("the engine decodes with the trainer's base (one copy)" if shares_base(cfg)
             else "the engine holds its own base and receives the adapters only")
    return (f"lora          rank {lo.rank}, alpha {lo.alpha:g} (scale {lo.scale:g}), dropout {lo.dropout:g} on "
            f"{', '.join(lo.target_modules)}; lr {t.lr:g}; base frozen, {where}")


KNOWN_CONFIGS = Path(__file__).resolve().parents[1] / "models" / "known_configs"


def known_config(repo: str):
    """The shipped config.json of a public model (``runtime/models/known_configs``), or None."""
    import json
    index = json.loads((KNOWN_CONFIGS / "index.json").read_text())
    name = index.get(repo)
    if name is None:
        return None
    from transformers import AutoConfig
    raw = json.loads((KNOWN_CONFIGS / name).read_text())
    model_type = raw.pop("model_type")
    return AutoConfig.for_model(model_type, **raw)


def model_config_for_plan(source: str):
    """The model's HF config without downloading weights, and what was assumed to get it (None: read from
    the model itself): a local dir; for hf:// the HF cache, else the shipped known config of that model."""
    from runtime.models import load_hf_config
    if source.startswith("hf://"):
        repo, _, rev = source[len("hf://"):].partition("@")
        try:
            from huggingface_hub import hf_hub_download
            path = hf_hub_download(repo, "config.json", revision=rev or None, local_files_only=True)
            from transformers import AutoConfig
            return AutoConfig.from_pretrained(path.rsplit("/", 1)[0]), None
        except Exception:  # noqa: BLE001 - not cached: validate stays offline and fast
            known = known_config(repo)
            if known is None:
                return None, None
            return known, (f"{repo} is not fetched yet: its architecture from the config.json shipped in "
                           f"runtime/models/known_configs")
    if "://" in source:
        return None, None
    return load_hf_config(source), None


def _model_config_offline(source: str):
    return model_config_for_plan(source)[0]


def memory_plan(cfg: GrpoConfig, gpu_mem_gb: float | None = None, host_mem_gb: float | None = None):
    """(the estimate, or None without a model config at hand; what was assumed; why there is none)."""
    from runtime.plan.memory import estimate_for_config
    try:
        hf_config, assumed = model_config_for_plan(cfg.model.source)
    except Exception:  # noqa: BLE001 - not a model dir: the fetch stage says so
        hf_config, assumed = None, None
    if hf_config is None:
        return None, None
    est = estimate_for_config(cfg, hf_config, gpu_mem_gb=gpu_mem_gb, host_mem_gb=host_mem_gb)
    est["assumed"] = assumed
    return est, hf_config


def memory_report(cfg: GrpoConfig, gpu_mem_gb: float | None = None,
                  host_mem_gb: float | None = None) -> tuple[list[str], str | None]:
    """The per-GPU and per-node host memory plan (no download) as lines, and None when it fits, else the one-line
    error naming the settings that would fit. ``gpu_mem_gb``: ``--gpu-mem-gb``, else ``cluster.gpu_memory_gb``,
    else this machine's GPU, else 80; ``host_mem_gb``: ``--host-mem-gb``, else ``cluster.host_memory_gb``, else 1.6 x
    the node's GPU memory."""
    from runtime.plan.memory import format_estimate, plan_choices
    est, hf_config = memory_plan(cfg, gpu_mem_gb, host_mem_gb)
    if est is None:
        return [f"memory        no estimate: {cfg.model.source} has no config.json at hand "
                f"(give a local model dir, or fetch it once so the HF cache has it)"], None
    lines = format_estimate(est).splitlines()
    if not est["fits"]:
        return lines, f"memory: {est['reason']}"
    choices = plan_choices(cfg, hf_config, gpu_mem_gb)
    if choices:
        lines.append("  the plan chooses " + ", ".join(f"{k}={v}" for k, v in choices.items())
                     + " (written into the run's frozen config)")
    return lines, None


def disk_plan(cfg: GrpoConfig, hf_config, *, run_dir: str | None = None):
    """The run directory's disk plan (runtime/plan/disk.py) checked against where the run writes: validate
    (``run_dir`` None) against ``storage.disk_gb``, else the free space measured on this machine; the run
    (``run_dir``: its directory, a resumed run's bytes already there counted) against the lesser of the two."""
    from runtime import storage
    from runtime.plan import disk
    from runtime.plan.memory import config_device
    if run_dir is None:
        est = disk.disk_terms(cfg, hf_config, device=config_device(cfg))
    else:
        from runtime.devices import resolve_device
        est = disk.disk_terms(cfg, hf_config, device=resolve_device(cfg))
    # a resumed run's directory may sit under another root than its frozen storage.root (`resume --root`)
    where = run_dir if run_dir is not None and not storage.is_remote(run_dir) else disk.local_dir(cfg)
    measured = disk.free_bytes(where) / disk.GIB
    given = cfg.storage.disk_gb is not None and (run_dir is None or cfg.storage.disk_gb <= measured)
    free = cfg.storage.disk_gb if given else measured
    already = 0
    if run_dir is not None:
        already = disk.used_bytes(str(storage.staged_path(run_dir, cfg.storage.state_dir))
                                  if storage.is_remote(run_dir) else run_dir)
    return disk.check_disk(est, free_gb=free, where=None if given else where, here=run_dir is None, already=already)


def disk_report(cfg: GrpoConfig, run_dir: str | None = None) -> tuple[list[str], str | None]:
    """The disk plan as lines, and None when it fits (or validate measured this machine: the run decides), else
    the one-line error naming the fix."""
    from runtime.plan.disk import format_disk
    try:
        hf_config, _ = model_config_for_plan(cfg.model.source)
    except Exception:  # noqa: BLE001 - not a model dir: the fetch stage says so
        hf_config = None
    if hf_config is None:
        return [], None
    est = disk_plan(cfg, hf_config, run_dir=run_dir)
    refuse = not est["fits"] and (run_dir is not None or cfg.storage.disk_gb is not None)
    return format_disk(est), f"disk: {est['reason']}" if refuse else None


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
    n = layout.rollout_engines(cfg)
    on = layout.engine_gpus(cfg)
    span = f"GPU {on[0]}" if n == 1 else f"GPUs {on[0]}-{on[-1]}"
    engines = "engine" if n == 1 else f"{n} built-in engines (one per GPU, the requests split between them)"
    shards = cfg.rollout.expert_shards
    if shards > 1:
        engines = (f"{n} built-in engines (one per GPU) in {n // shards} replica(s) of {shards} expert shards (each "
                   f"holds 1/{shards} of the experts; a replica's engines run its requests together)")
    if c.trainer_gpus:
        ranks = "trainer rank 0" if n == 1 else f"trainer ranks 0-{n - 1}"
        engine = (f"{span} (shared with {ranks})" if c.colocate
                  else f"{c.rollout_gpus} GPU(s) of its own from GPU {on[0]}" if n == 1 else f"{span} of their own")
        where = f"trainer DP {t.data_parallel} × TP {t.tensor_parallel} on GPUs 0-{c.trainer_gpus - 1}; {engines} on {engine}"
    else:
        where = f"trainer DP {t.data_parallel} × TP {t.tensor_parallel}, {engines} beside it (no GPU accounting)"
    checked = "" if gpus is not None else " (GPUs checked when the cluster starts)" if c.trainer_gpus else ""
    mode = layout.weight_sync_mode(cfg)
    from runtime.plan.memory import config_device
    device = config_device(cfg)
    how = {"broadcast": " (NCCL from trainer rank 0)" if device == "cuda" else " (gloo from trainer rank 0)",
           "cuda_ipc": " (CUDA IPC: each engine reads its GPU's trainer rank in place)",
           "host": " (through host memory)"}
    via = how["broadcast"] if mode == "broadcast" else how.get(layout.direct_transport(cfg, device), "")
    return [f"layout        {where}; weight sync {mode}{via}{checked}"]
