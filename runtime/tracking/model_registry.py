"""Model registry: export a trainer checkpoint to Hugging Face files, register it in MLflow, move aliases.

Registration is idempotent: a model version carries the tag ``grpoflow.checkpoint =
<run_id>/rollout_<N>``, and registering the same checkpoint again returns that version. Aliases:
``best`` moves only to a version whose primary metric is strictly higher than the current best's
(ties and regressions leave it where it is); ``latest`` is the newest version - MLflow reserves that
alias name and resolves ``models:/NAME/latest`` itself, so it is reported, never set.

MLflow is imported inside functions only; the export needs megatron-core, also imported lazily.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

from runtime import storage
from runtime.errors import ModelError
from runtime.mcore.cpu_job import device_job
from runtime.run.directory import RunDir
from runtime.testing.moments import moment
from runtime.secrets import redact_uri
from runtime.tracking.mlflow_tracker import metric_key, mlflow_errors

log = logging.getLogger(__name__)

CHECKPOINT_TAG = "grpoflow.checkpoint"
PRIMARY_METRIC_TAG = "grpoflow.primary_metric"
PRIMARY_VALUE_TAG = "grpoflow.primary_value"
METRIC_TAG = "grpoflow.metric."
EXPORT_URI_TAG = "grpoflow.export_uri"
WEIGHTS_TAG = "grpoflow.weights"  # full | lora-merged
ADAPTER_URI_TAG = "grpoflow.adapter_uri"  # a LoRA run's adapter alone (PEFT layout)
GRADER_TAG = "grpoflow.grader."  # + grader, rule_version, math_verify_version: the rule behind the metrics
RUN_ROOT_TAG = "grpoflow.run_root"  # storage.root of the registering run: where its checkpoint and export live
EXPORT_MARKER = "grpoflow_export.json"  # written last: an export dir with it is complete
LATEST, BEST = "latest", "best"


# ---- aliases ------------------------------------------------------------------------------------
def should_move_best(current: float | None, new: float | None) -> bool:
    """Whether ``best`` moves to a version scoring ``new`` when the current best scores ``current``
    (None: no best yet). Higher is better; a tie keeps the older version; NaN never wins."""
    if new is None or math.isnan(new):
        return False
    if current is None or math.isnan(current):
        return True
    return new > current


def checkpoint_tag(run_id: str, rollout: int) -> str:
    return f"{run_id}/rollout_{int(rollout)}"


# ---- MLflow plumbing ------------------------------------------------------------------------------
def _resolve(tracker_or_client) -> tuple[Any, str, str | None]:
    """(client, uri, the tracker's MLflow run id) of a Tracker or an MlflowClient; client None when
    the tracker is disabled."""
    if hasattr(tracker_or_client, "enabled") and hasattr(tracker_or_client, "run_id"):
        t = tracker_or_client
        return (t.client if t.enabled else None), (t.uri or ""), t.run_id
    client = tracker_or_client
    uri = getattr(client, "tracking_uri", None) or getattr(getattr(client, "_tracking_client", None), "tracking_uri", "")
    return client, str(uri), None


def _error_code(err: BaseException) -> str:
    return str(getattr(err, "error_code", "") or "")


def _ensure_registered_model(client, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
        return
    except MlflowException as err:
        if _error_code(err) != "RESOURCE_DOES_NOT_EXIST":
            raise
    try:
        client.create_registered_model(name, tags={"grpoflow": "1"},
                                       description="GRPO checkpoints registered by grpoflow")
    except MlflowException as err:
        if _error_code(err) != "RESOURCE_ALREADY_EXISTS":  # created meanwhile
            raise


def all_versions(client, name: str, filter_extra: str | None = None) -> list:
    """Every version of registered model ``name`` (all pages), optionally with an extra filter."""
    filt = f"name = '{name}'" + (f" and {filter_extra}" if filter_extra else "")
    out, token = [], None
    while True:
        page = client.search_model_versions(filt, max_results=10000, page_token=token)
        out += list(page)
        token = getattr(page, "token", None)
        if not token:
            return out


def find_checkpoint_version(client, name: str, tag: str):
    """The version of ``name`` registered for checkpoint ``tag``, or None."""
    if "'" in tag or "'" in name:
        found = [v for v in all_versions(client, name) if v.tags.get(CHECKPOINT_TAG) == tag]
    else:
        found = all_versions(client, name, f"tags.`{CHECKPOINT_TAG}` = '{tag}'")
    found = sorted(found, key=lambda v: int(v.version))
    return found[0] if found else None


def _is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://", "databricks"))


def _upload_export(client, mlflow_run_id: str, export_uri: str, rollout: int) -> str:
    """An MLflow server accepts a local-path source only inside the run's artifacts: upload the
    export there (once) and register ``runs:/<run>/exports/rollout_<N>``."""
    artifact_path = f"exports/rollout_{int(rollout)}"
    present = {Path(f.path).name for f in client.list_artifacts(mlflow_run_id, artifact_path)}
    if EXPORT_MARKER not in present:
        client.log_artifacts(mlflow_run_id, str(export_uri), artifact_path)
    return f"runs:/{mlflow_run_id}/{artifact_path}"


def aliases_of(client, name: str) -> dict[str, int]:
    """The model's aliases (alias -> version), with ``latest`` = its newest version. MLflow reserves
    the alias name ``latest`` for exactly that (``models:/NAME/latest``), so it is computed, not set."""
    aliases = {a: int(v) for a, v in (client.get_registered_model(name).aliases or {}).items()}
    versions = [int(v.version) for v in all_versions(client, name)]
    if versions:
        aliases[LATEST] = max(versions)
    return aliases


def _move_aliases(client, name: str, mv) -> list[str]:
    """Apply the alias rules for version ``mv``; the aliases that point at it afterwards."""
    version = int(mv.version)
    aliases = aliases_of(client, name)
    new_val = mv.tags.get(PRIMARY_VALUE_TAG)
    if new_val is not None and aliases.get(BEST) != version:
        cur = aliases.get(BEST)
        cur_val = None
        if cur is not None:
            try:
                best = client.get_model_version(name, str(cur))
                if best.tags.get(PRIMARY_METRIC_TAG) == mv.tags.get(PRIMARY_METRIC_TAG):
                    cur_val = float(best.tags[PRIMARY_VALUE_TAG])
            except Exception as err:  # the best version was deleted, or its tag is unreadable
                if _error_code(err) not in ("", "RESOURCE_DOES_NOT_EXIST"):
                    raise
                log.warning("best version %s of %s is unusable (%s); replacing it", cur, name, err)
        if should_move_best(cur_val, float(new_val)):
            client.set_registered_model_alias(name, BEST, str(version))
            aliases[BEST] = version
    return sorted(a for a, v in aliases.items() if v == version)


def register_checkpoint(tracker_or_client, *, name: str, export_uri: str, rollout: int, run_id: str,
                        mlflow_run_id: str | None = None, metrics: dict[str, float] | None = None,
                        config_hash: str = "", primary_metric: str | None = None,
                        grader: dict[str, str | None] | None = None, weights: str = "full",
                        adapter_uri: str | None = None, run_root: str | None = None) -> dict[str, Any] | None:
    """Register the HF export of checkpoint ``rollout`` of grpoflow run ``run_id`` as a version of ``name``.

    Idempotent (same checkpoint -> same version). ``metrics`` (e.g. ``{"eval/aime/avg@4": 0.3}``) are
    stored as version tags; ``primary_metric`` names the one that decides ``best`` (higher is better;
    a version without it never becomes best). ``grader`` (default: evaluation's, ``grader_record("math")``)
    is tagged ``grpoflow.grader.*`` so a registered number can be traced to the rule that scored it. ``weights``
    (tag ``grpoflow.weights``): "full", or "lora-merged" for a LoRA run's export (the base with the adapters
    merged in), whose PEFT adapter alone is at ``adapter_uri`` (tag ``grpoflow.adapter_uri``). ``run_root``
    (tag ``grpoflow.run_root``): the run's storage.root, where a re-export finds its checkpoint. Returns ``{name, version, source, export_uri,
    checkpoint, created, aliases, mlflow_run_id}``, or None when tracking is disabled.
    """
    client, uri, tracker_run = _resolve(tracker_or_client)
    if client is None:
        return None
    mlflow_run_id = mlflow_run_id or tracker_run
    metrics = {metric_key(k): float(v) for k, v in (metrics or {}).items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    tag = checkpoint_tag(run_id, rollout)
    with mlflow_errors(uri, f"register {name} {tag}"):
        _ensure_registered_model(client, name)
        mv = find_checkpoint_version(client, name, tag)
        created = mv is None
        if created:
            export = storage.absolute_uri(str(export_uri))  # resolves from any working directory
            adapter = redact_uri(storage.absolute_uri(str(adapter_uri))) if adapter_uri else None
            source = export
            if _is_server(uri) and not storage.is_remote(source) and mlflow_run_id:
                source = _upload_export(client, mlflow_run_id, str(export_uri), rollout)
            tags = {CHECKPOINT_TAG: tag, "grpoflow.run_id": run_id, "grpoflow.rollout": str(int(rollout)),
                    "grpoflow.config_hash": config_hash,
                    EXPORT_URI_TAG: redact_uri(export),
                    **{METRIC_TAG + k: repr(v) for k, v in metrics.items()},
                    **{GRADER_TAG + k: str(v) for k, v in (grader or _eval_grader()).items()},
                    WEIGHTS_TAG: weights, **({ADAPTER_URI_TAG: adapter} if adapter else {}),
                    **({RUN_ROOT_TAG: redact_uri(storage.path_of(storage.absolute_uri(run_root)))} if run_root else {})}
            pm = metric_key(primary_metric) if primary_metric else None
            if pm is not None and pm in metrics:
                tags[PRIMARY_METRIC_TAG] = pm
                tags[PRIMARY_VALUE_TAG] = repr(metrics[pm])
            elif pm is not None:
                log.warning("primary metric %s is not among the metrics of %s; best stays where it is", pm, tag)
            what = ("" if weights == "full" else
                    f"; LoRA adapters merged into the base (the adapter alone, PEFT layout: {adapter})"
                    if adapter else f"; {weights}")
            mv = client.create_model_version(name, source=source, run_id=mlflow_run_id, tags=tags,
                                             description=f"grpoflow run {run_id}, after {int(rollout)} rollouts{what}")
            moment("registry-version-created")  # best alias not yet moved
        aliases = _move_aliases(client, name, mv)
        moment("registry-aliases-moved")
    return {"name": name, "version": int(mv.version), "source": mv.source, "export_uri": str(export_uri),
            "checkpoint": tag, "created": created, "aliases": aliases, "mlflow_run_id": mv.run_id}


def _eval_grader() -> dict[str, str | None]:
    from runtime.rewards import grader_record  # math-verify only when a version is registered

    return grader_record("math")


# ---- export ---------------------------------------------------------------------------------------
def export_complete(out_dir: str) -> bool:
    return storage.exists(storage.join(out_dir, EXPORT_MARKER)) and storage.exists(storage.join(out_dir, "config.json"))


def _export_gpu_bytes(ckpt_model_dir, hf_config_dir, *args, dtype=None, **kwargs) -> int:
    """An export's GPU need: the model in its dtype and its HF-named copy, with room to spare (2.2x)."""
    from runtime.mcore.convert import as_dtype
    from runtime.models import load_hf_config
    from runtime.plan.memory import param_counts

    n, _ = param_counts(load_hf_config(Path(hf_config_dir)))
    return int(2.2 * n * as_dtype(dtype or stored_dtype(ckpt_model_dir)).itemsize)


def stored_dtype(ckpt_model_dir: str | os.PathLike):
    """The dtype of the model weights a torch_dist checkpoint holds (a trainer's: the dtype it trained in, bf16
    for a bf16 run; its fp32 master and Adam moments are other tensors), read from its metadata alone, or from its
    marker where the weights are left to their masters (runtime/trainer/master_weights.py); None where it holds
    neither word embeddings nor that marker (an fp32 LoRA checkpoint: adapters only)."""
    from torch.distributed.checkpoint import FileSystemReader

    from runtime.trainer.master_weights import marked_dtype
    marked = marked_dtype(ckpt_model_dir)  # weights left to their fp32 masters: the dtype they were trained in
    if marked is not None:
        return marked
    meta = FileSystemReader(str(ckpt_model_dir)).read_metadata().state_dict_metadata
    for key, item in meta.items():
        props = getattr(item, "properties", None)
        if key.startswith("embedding.") and props is not None:  # the word embeddings: a weight, never state
            return props.dtype
    return None


@device_job(_export_gpu_bytes)
def export_trainer_checkpoint(ckpt_model_dir: str | os.PathLike, hf_config_dir: str | os.PathLike,
                              out_dir: str | os.PathLike, *, dtype=None, device: str = "cpu",
                              provenance: dict | None = None, base_dir: str | os.PathLike | None = None,
                              adapter_dir: str | None = None) -> dict[str, Any]:
    """Export a trainer checkpoint's ``model/`` dir (a torch_dist save of ``{"model": ..., "optimizer":
    ..., "scheduler": ..., "steps_done": ...}``) to an HF model dir, loading only the model part (bf16 weights left
    to their masters: the masters rounded, runtime/trainer/master_weights.py), on
    ``device`` ("cpu", "cuda", or "auto": the GPU where one has room), written in ``dtype`` (default: the
    dtype the checkpoint's weights were trained in, :func:`stored_dtype`).

    ``runtime.mcore.convert.torch_dist_to_hf`` loads a bare model save; on a trainer save the common state
    (scheduler, steps_done, optimizer param groups) comes back beside the weights and a strict load
    fails, so the model is loaded here under its ``"model"`` key. Weights, shards, side files
    (config, tokenizer) are written by runtime.mcore.convert's helpers. ``out_dir`` may be remote.

    A LoRA checkpoint (``lora.json`` beside its adapters): the base comes from ``base_dir`` (the run's converted
    model), the adapters are merged into it in fp32 on the host (runtime/tracking/lora_export.py), and with
    ``adapter_dir`` the adapter alone is written there in PEFT's layout as well (first, so a complete HF export
    implies it).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from runtime.mcore.convert import (_check_torch_dist_dir, _config_dtype, _quiet_checkpoint_warnings,
                                       _require_single_process, as_dtype, hf_named_weights, loading_dtype)
    from runtime.mcore.env import build_gpt_model, cuda_to_cpu
    from runtime.models import get_adapter, load_hf_config

    t0 = time.time()
    ckpt, hf_config_dir = Path(ckpt_model_dir), Path(hf_config_dir)
    _check_torch_dist_dir(ckpt)
    hf_config = load_hf_config(hf_config_dir)
    adapter = get_adapter(hf_config)
    _require_single_process("export_trainer_checkpoint")
    if dtype is None:  # the trained dtype: the checkpoint's weights', a LoRA run's base's
        dtype = stored_dtype(ckpt) or (stored_dtype(base_dir) if base_dir else None) or _config_dtype(hf_config)
    dtype = as_dtype(dtype)
    from runtime.trainer.lora import read_description
    lora = read_description(str(ckpt))
    extra: dict[str, Any] = {}
    if lora is not None:
        from runtime.tracking import lora_export
        if base_dir is None:
            raise ModelError(f"{ckpt} holds LoRA adapters: its export needs the base (the run's model/torch_dist)")
        merged, adapters = lora_export.load_merged(ckpt, base_dir, hf_config, lora)
        hf_state = {k: v.to(dtype).contiguous() for k, v in adapter.to_hf(merged, hf_config).items()}
        del merged
        extra["weights"] = "lora-merged"  # the base with the adapters merged in
        extra["lora"] = {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules)}
        if adapter_dir is not None:
            extra["adapter"] = lora_export.export_adapter(adapters, hf_config, lora, adapter_dir,
                                                          base_model=str(hf_config_dir))["path"]
    else:
        model = build_gpt_model(hf_config, dtype=loading_dtype(device, dtype), device=device, init_weights=False)
        from runtime.trainer import master_weights
        trained = master_weights.marked_dtype(ckpt)
        with cuda_to_cpu(), _quiet_checkpoint_warnings():
            try:
                if trained is None:
                    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt))["model"]
                else:  # the weights are their fp32 masters rounded to the trained dtype: the trainer's, bitwise
                    loaded = master_weights.read_weights(model.sharded_state_dict(), ckpt, trained)
            except CheckpointingException as e:
                raise ModelError(f"{ckpt} does not match the model built from {hf_config_dir}/config.json "
                                 f"({str(e)[:200]})") from None
        model.load_state_dict(loaded, strict=True)
        del loaded
        hf_state = hf_named_weights(model, hf_config, dtype)
        del model
    marker = {"source": str(ckpt), "model_type": hf_config.model_type, "dtype": str(dtype).removeprefix("torch."),
              "device": device,
              "n_tensors": len(hf_state), "created": time.time(), **extra, **(provenance or {})}

    files = publish_hf_export(hf_state, hf_config_dir, str(out_dir), marker)
    return {**marker, "path": str(out_dir), "files": files, "skipped": False, "seconds": round(time.time() - t0, 3)}


def publish_hf_export(hf_state: dict, hf_config_dir: str | os.PathLike, out_dir: str, marker: dict) -> list[str]:
    """Write HF-named tensors, the side files of ``hf_config_dir`` (config, tokenizer) and the export marker
    (``marker`` + its files) to ``out_dir`` (local or remote), atomically, the marker last; the files written.
    Any source of full HF-named weights can publish through it (a checkpoint read back, or the live trainer's
    gathered weights at that rollout)."""
    from runtime.mcore.convert import HF_SIDE_FILES, save_hf_state_dict

    hf_config_dir = Path(hf_config_dir)
    with storage.publish_dir(out_dir, last=["config.json", EXPORT_MARKER]) as tmp:  # the marker last
        files = save_hf_state_dict(hf_state, tmp)
        moment("export-weights-written")  # under a temp name, no marker yet
        for name in HF_SIDE_FILES:
            if (hf_config_dir / name).is_file():
                shutil.copyfile(hf_config_dir / name, tmp / name)
                files.append(name)
        (tmp / EXPORT_MARKER).write_text(json.dumps({**marker, "files": sorted(files)}, indent=2) + "\n")
    return sorted(files)


def export_checkpoint(rd: RunDir, rollout: int, hf_dir: str | None = None, *, dtype=None,
                      device: str = "auto") -> dict[str, Any]:
    """HF export of ``checkpoints/rollout_<N>`` into ``exports/rollout_<N>/hf`` (skipped when complete), in
    ``dtype`` (default: the checkpoint's trained dtype) on ``device`` (default: the GPU where one has room).
    ``hf_dir``: where config and tokenizer come from (default: the run's fetched model)."""
    out = rd.export(rollout)
    if export_complete(out):  # what it is (full or LoRA merged, the adapter's path) is in its marker
        return {**storage.read_json(storage.join(out, EXPORT_MARKER)), "path": out, "skipped": True}
    from runtime.run.checkpoint import stage

    ckpt = rd.checkpoint(rollout)
    if not storage.exists(storage.join(ckpt, "manifest.json")):
        raise ModelError(f"checkpoint {ckpt} does not exist or is incomplete (no manifest.json); "
                         f"it was pruned (raise checkpoint.keep_last) or never finished")
    # On a remote run dir: local copies (the checkpoint's is usually still staged from its save).
    local = Path(stage(ckpt, rd.state_dir))
    from runtime.trainer.lora import read_description
    lora = {}
    if read_description(str(local / "model")) is not None:
        # a LoRA checkpoint: its base is the converted model; the adapter alone goes beside the merged export
        lora = {"base_dir": rd.local(rd.torch_dist), "adapter_dir": rd.export_adapter(rollout)}
    return export_trainer_checkpoint(local / "model", rd.local(hf_dir or rd.hf_model), out, dtype=dtype,
                                     device="cpu" if lora else device, provenance={"run_id": rd.run_id, "rollout": int(rollout),
                                                 "source": storage.join(ckpt, "model")}, **lora)


__all__ = [
    "should_move_best", "checkpoint_tag", "register_checkpoint", "find_checkpoint_version", "all_versions",
    "export_checkpoint", "export_trainer_checkpoint", "export_complete", "aliases_of", "publish_hf_export",
    "stored_dtype",
]
