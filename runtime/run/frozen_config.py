"""Opening a run: its directory, its frozen config, and what may change when it is resumed."""
from __future__ import annotations

import hashlib
import re

import yaml

from runtime import storage
from runtime.config import (DEFAULT_ROOT, DuplicateKeyError, GrpoConfig, apply_overrides, config_from_dict,
                            config_with_overrides, duplicate_key_error, dump_config, load_yaml)
from runtime.errors import ConfigError
from runtime.run.directory import RunDir
from runtime.secrets import mask_tree, masked_fields

FINISHED_MARKER = "finished"  # stages/finished.json: every stage of the run done, written last

# A resumed run may be extended or re-evaluated; anything that changes what was already trained may not.
# Memory settings that leave every update as it was may change too (resume on another GPU): the KV pool
# (keyed sampling: the same tokens whatever the batching), the target GPU's memory, the state offload
# (a bitwise round trip) and recomputation (bitwise for full and mlp; a few fp32 ulps for the norms').
# Not the micro-batching (train.micro_batch_size, train.max_tokens_per_micro_batch): it changes the
# order in which gradients are summed.
# The one exception to bitwise: the data-parallel layout (train.data_parallel with cluster.trainer_gpus,
# train.distributed_optimizer), so that a run can resume on another number of GPUs. Its checkpoint loads
# exactly into the new layout (runtime/trainer/optimizer_checkpoint.py); the updates after it differ from an
# unbroken run's by the order of the DP reduction, within the float tolerance docs/resume.md states.
# Where the optimizer lives (train.optimizer_on_host) may change too: the same masters and Adam state in the same
# checkpoint format, stepped on the host or on the GPU (updates equal within float rounding); and the host's memory.
RESUMABLE_CHANGES = {"train.num_rollout", "eval.interval", "eval.before_train", "tracking.uri",
                     "tracking.enabled", "cluster.address", "cluster.backend", "cluster.num_cpus",
                     "cluster.placement_timeout_s", "checkpoint.keep_last", "storage.state_dir",
                     "rollout.kv_cache_gb", "cluster.gpu_memory_gb", "cluster.offload_trainer_state",
                     "train.recompute", "train.recompute_modules", "train.recompute_num_layers",
                     "train.data_parallel", "cluster.trainer_gpus", "train.distributed_optimizer",
                     "train.optimizer_on_host", "cluster.host_memory_gb", "storage.disk_gb",
                     "tracking.keep_exports"}


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def changed_fields(old: GrpoConfig, new: GrpoConfig) -> list[str]:
    # Compared as written: a frozen config holds masks where secrets were (runtime.secrets).
    a, b = _flat(mask_tree(old.model_dump(mode="json"))), _flat(mask_tree(new.model_dump(mode="json")))
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def check_changes(old: GrpoConfig, new: GrpoConfig, rd: RunDir, *, given_root: bool = False) -> None:
    """An existing run may change only what RESUMABLE_CHANGES allows, and never so that rollouts it has
    trained or evaluated fall outside it; anything else is one ConfigError."""
    bad = [f for f in changed_fields(old, new)
           if f not in RESUMABLE_CHANGES and not f.startswith("eval.") and f != "name"]
    root = f" --root {rd.root}" if given_root or rd.root != DEFAULT_ROOT else ""
    if bad:
        raise ConfigError(
            f"run '{rd.run_id}' already exists with a different {', '.join(bad)}, which a resumed run cannot "
            f"change; resume it as it is with `grpoflow resume {rd.run_id}{root}` or pick another --run-id")
    if new.train.num_rollout < old.train.num_rollout:
        beyond = rollouts_beyond(rd, new.train.num_rollout)
        if beyond:
            shown = ", ".join(beyond[:6]) + (f" and {len(beyond) - 6} more" if len(beyond) > 6 else "")
            raise ConfigError(
                f"run '{rd.run_id}' has trained or evaluated past train.num_rollout={new.train.num_rollout} ({shown}); "
                f"a resume never drops rollouts that exist: keep train.num_rollout >= {old.train.num_rollout} "
                f"(`grpoflow resume {rd.run_id}{root}`), or start a new run with another --run-id for fewer rollouts")


def rollouts_beyond(rd: RunDir, n: int) -> list[str]:
    """What the run directory holds of rollouts after ``n``: checkpoints, eval results, exports (run-relative names)."""
    found = []
    for sub in ("checkpoints", "eval", "exports"):
        fs, path = storage.fs_for(rd.sub(sub))
        try:
            with storage.s3_errors(rd.path):
                names = sorted(str(x).rstrip("/").rsplit("/", 1)[-1] for x in fs.ls(path, detail=False))
        except FileNotFoundError:
            continue
        for name in names:
            m = re.fullmatch(r"rollout_(\d+)(\.json)?", name)
            if m and int(m.group(1)) > n:
                found.append((int(m.group(1)), f"{sub}/{name}"))
    return [name for _, name in sorted(found)]


def with_plan_choices(cfg: GrpoConfig) -> GrpoConfig:
    """``cfg`` with what the memory plan chooses for the settings it leaves open (``rollout.kv_cache_gb`` on a
    GPU: runtime/plan/memory.py ``plan_choices``), when the target GPU's memory is known (``cluster.gpu_memory_gb``,
    or this machine's GPU) and the model's config is at hand (local dir, HF cache, or a shipped known config)."""
    from runtime.devices import this_machine_gpu_gb
    from runtime.plan.memory import config_device, plan_choices
    from runtime.plan.summary import model_config_for_plan
    if config_device(cfg) != "cuda" or cfg.rollout.kv_cache_gb is not None:
        return cfg
    if cfg.cluster.gpu_memory_gb is None and this_machine_gpu_gb() is None:
        return cfg  # the card is not known here: the engine sizes its pool on its own
    try:
        hf_config, _ = model_config_for_plan(cfg.model.source)
    except Exception:  # noqa: BLE001 - not at hand before the fetch: the engine sizes its pool itself
        return cfg
    if hf_config is None:
        return cfg
    choices = plan_choices(cfg, hf_config)  # for the card check_fits plans for
    if not choices:
        return cfg
    tree = cfg.model_dump(mode="json")
    return config_from_dict(apply_overrides(tree, [f"{k}={v}" for k, v in choices.items()]), "plan")


def freeze(cfg: GrpoConfig, rd: RunDir) -> GrpoConfig:
    """Write the run's frozen config, with the memory plan's choices (:func:`with_plan_choices`), and return
    it: the run uses what was frozen. An existing run may only change what RESUMABLE_CHANGES allows.
    Secrets in it are masked (runtime.secrets): the file is for reading, never for credentials."""
    cfg = with_plan_choices(cfg)
    if storage.exists(rd.config):
        check_changes(frozen_config(rd), cfg, rd)
    storage.write_text_atomic(rd.config, frozen_text(cfg))
    return cfg


# ---- the checksum: a frozen config changed outside grpoflow (cut, edited) is refused, never trusted ----------
CHECKSUM_PREFIX = "# grpoflow frozen config, sha256 of the lines below: "


def frozen_text(cfg: GrpoConfig) -> str:
    body = dump_config(cfg)
    return f"{CHECKSUM_PREFIX}{hashlib.sha256(body.encode()).hexdigest()}\n{body}"


def checked_body(text: str, rd: RunDir) -> str:
    """The YAML of a frozen config whose checksum holds (one written before checksums has none: taken as it
    is); a ConfigError saying how to recover otherwise."""
    first, _, body = text.partition("\n")
    if not first.startswith(CHECKSUM_PREFIX):
        return text
    if hashlib.sha256(body.encode()).hexdigest() != first[len(CHECKSUM_PREFIX):].strip():
        raise ConfigError(f"{rd.config}: the frozen config of run '{rd.run_id}' was changed outside grpoflow (cut short "
                          f"or edited: its checksum does not match), so it is not trusted; {recover_hint(rd)}")
    return body


def recover_hint(rd: RunDir) -> str:
    return (f"recover with `grpoflow resume {rd.run_id} --root {rd.root} --config FILE`, FILE being the config the run "
            f"was started with (and its --set values as --set); the file found is kept beside it")


def rebased(cfg: GrpoConfig, root: str) -> GrpoConfig:
    """``cfg`` with storage.root where its run directory is now: a run moved or copied to another root writes
    there (its MLflow store included), never to the root it was frozen under. The same place written another
    way (relative, a trailing slash) keeps the frozen spelling."""
    if _same_place(cfg.storage.root, root):
        return cfg
    return cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"root": root})})


def _same_place(a: str, b: str) -> bool:
    if storage.is_remote(a) or storage.is_remote(b):
        return a.rstrip("/") == b.rstrip("/")
    from pathlib import Path
    return Path(storage.path_of(a)).expanduser().resolve() == Path(storage.path_of(b)).expanduser().resolve()


def replace_frozen(rd: RunDir, given: GrpoConfig) -> None:
    """`resume --config FILE`: make ``given`` the run's frozen config. Over a sound frozen config only what a
    resume may change can differ; a damaged or missing one is kept beside it (``config.yaml.replaced-<time>``),
    and ``given`` may not drop rollouts the run directory holds."""
    import time

    from runtime.run.lease import RunLease
    if not storage.exists(rd.path):
        raise ConfigError(f"unknown run id '{rd.run_id}': no {rd.path} (--config replaces the config of a run that "
                          f"exists; start a new one with `grpoflow run`)")
    given = rebased(given, rd.root)
    try:
        frozen = frozen_config(rd)
    except ConfigError:
        frozen = None  # damaged or missing: what replaces it is checked against the run directory alone
    if frozen is not None:
        check_changes(frozen, given, rd, given_root=True)
    elif beyond := rollouts_beyond(rd, given.train.num_rollout):
        raise ConfigError(f"--config gives train.num_rollout={given.train.num_rollout}, but run '{rd.run_id}' holds "
                          f"{', '.join(beyond[:6])}: give the config it was started with")
    with RunLease(rd.checked()):
        if storage.exists(rd.config):
            aside = f"{rd.config}.replaced-{time.strftime('%Y%m%dT%H%M%S')}"
            storage.write_text_atomic(aside, storage.read_text(rd.config))
        storage.write_text_atomic(rd.config, frozen_text(given))


def start_again_command(rd: RunDir, holder: dict | None) -> str:
    """The command that starts a run stopped before its config was frozen: as its lease (``holder``) recorded
    it, secrets masked; without that record, with CONFIG for the config it was started from."""
    import shlex

    started = (holder or {}).get("started_with") or {}
    argv = ["grpoflow", "run", started.get("config") or "CONFIG", "--run-id", rd.run_id]
    overrides = list(started.get("overrides") or [])
    if not started and rd.root != DEFAULT_ROOT:
        overrides.append(f"storage.root={rd.root}")
    return shlex.join(argv + sum((["--set", o] for o in overrides), []))


def not_frozen_error(rd: RunDir) -> ConfigError:
    """A run directory without its frozen config: a run starting right now, one stopped before it froze, or one
    whose config was deleted after it trained."""
    from runtime.run.lease import lease_holder
    from runtime.secrets import REDACTED

    holder, stale = lease_holder(rd)
    if holder is not None and stale is None:
        return ConfigError(f"run '{rd.run_id}' is starting (pid {holder.get('pid')} on {holder.get('host')} holds its "
                           f"lease; its config is not frozen yet); wait for it, or see `grpoflow runs --root {rd.root}`")
    trained = rollouts_beyond(rd, -1)
    if trained:
        return ConfigError(f"run '{rd.run_id}' holds {', '.join(trained[-3:])} but its frozen config {rd.config} is "
                           f"missing; nothing is lost: {recover_hint(rd).removesuffix('; the file found is kept beside it')}")
    command = start_again_command(rd, holder)
    masked = " (give the masked values again)" if REDACTED in command else ""
    return ConfigError(f"run '{rd.run_id}' was stopped before its config was frozen (no {rd.config}), so nothing of "
                       f"it can be resumed; start it again with `{command}`{masked}")


def frozen_config(rd: RunDir, overrides: list[str] | None = None) -> GrpoConfig:
    if not storage.exists(rd.config):
        if storage.exists(rd.path):
            raise not_frozen_error(rd)
        raise ConfigError(f"unknown run id '{rd.run_id}': no {rd.config} "
                          f"(list runs under {storage.join(rd.root, 'runs')} or check storage.root / --root)")
    try:
        tree = load_yaml(checked_body(storage.read_text(rd.config), rd))
    except DuplicateKeyError as err:
        raise duplicate_key_error(rd.config, err) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{rd.config}: the frozen config of run '{rd.run_id}' is damaged "
                          f"({' '.join(str(err).split())[:160]}); {recover_hint(rd)}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{rd.config}: the frozen config of run '{rd.run_id}' is damaged (not a mapping); "
                          f"{recover_hint(rd)}")
    return rebased(config_with_overrides(tree, overrides, rd.config), rd.root)


def config_to_resume(rd: RunDir, overrides: list[str] | None = None) -> GrpoConfig:
    """The frozen config with ``overrides``, ready to run: a secret masked in it must be given again."""
    cfg = frozen_config(rd, overrides)
    missing = masked_fields(cfg.model_dump(mode="json"))
    if missing:
        raise ConfigError(f"run '{rd.run_id}': {', '.join(missing)} held a secret, which is never stored (it is masked "
                          f"in {rd.config}); give it again with --set {missing[0]}=...")
    return cfg


def finished_record(cfg: GrpoConfig) -> dict:
    """What "finished" means for this config: trained, evaluated and registered up to these points."""
    return {"num_rollout": cfg.train.num_rollout, "eval_points": cfg.eval_points() if cfg.data.eval else [],
            "tracking": cfg.tracking.enabled}


def mark_finished(cfg: GrpoConfig, rd: RunDir) -> None:
    """Written after the last stage (final eval, registration, MLflow run ended), before the lease goes."""
    storage.write_json_atomic(rd.stage_marker(FINISHED_MARKER), finished_record(cfg))


def finished(cfg: GrpoConfig, rd: RunDir) -> bool:
    """Every stage done, read from the run directory: trained to train.num_rollout, evaluated at every
    eval point, and the finishing steps (registration, aliases, the MLflow run's end) recorded by the
    run's last act, ``stages/finished.json``. A run killed anywhere before that is not finished."""
    from runtime.run import checkpoint
    try:
        record = storage.read_json(rd.stage_marker(FINISHED_MARKER))
    except (FileNotFoundError, ValueError):
        return False
    want = finished_record(cfg)
    if (record.get("num_rollout") != want["num_rollout"] or not set(want["eval_points"]) <= set(record.get("eval_points", []))
            or (want["tracking"] and not record.get("tracking"))):
        return False
    ck = checkpoint.latest(rd)
    if ck is None or ck.rollout < cfg.train.num_rollout:
        return False
    if cfg.data.eval:
        return all(storage.exists(rd.eval_result(n)) for n in cfg.eval_points())
    return True
