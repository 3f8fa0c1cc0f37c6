"""The run directory's disk at its peak, by term (``runtime/run/directory.py``'s layout), and the free space it is
checked against.

Nothing a run writes is removed before it ends except pruned checkpoints and exports, so the peak is at the last
eval point, with every term at its largest:

* ``hf model``: the fetched HF weights (``model/hf``), in the dtype of their config.json;
* ``converted``: ``model/torch_dist``, in the dtype the trainer loads (:func:`converted_bytes_per_param`);
* ``checkpoints``: ``checkpoint.keep_last`` durable ones and the one being written (pruning follows the new
  ``latest``), no more than the run's chunks; each :func:`checkpoint_bytes_per_param` a trained parameter
  (a LoRA checkpoint: the adapters and their optimizer only);
* ``exports``: the HF exports of registered eval points (``tracking.enabled``, rollout > 0) kept under
  ``tracking.keep_exports`` (:func:`exports_at_peak`), in the HF config's dtype; a LoRA export is the merged model
  and the adapter beside it. An export is written under a temp name next to the kept ones: the conversion's temp
  space is the export being written, counted among them;
* ``files``: what each of those directories holds beside its weights (config, manifest, parity report:
  ``FILES_BYTES``; an HF directory's tokenizer, ``TOKENIZER_BYTES_PER_TOKEN`` a vocabulary entry), and the data as
  fetched and as prepared (its source's size where it is a local file; builtin sets are kilobytes, hub datasets
  are not fetched to plan).

A local ``storage.root`` holds all of it. Under an ``s3://`` root the writers build each directory in a local
mirror (``storage.publish_dir`` / ``output_dir`` under ``storage.state_dir``) and keep it after the upload, so the
local disk of ``storage.state_dir`` needs the same bytes; pruning drops a checkpoint's mirror with it.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from runtime.plan.shape import GIB, dtype_bytes, shape_param_counts

# What a model directory holds beside its weights and tokenizer (config.json, a checkpoint's trainer_state.json,
# manifest and megatron's .metadata, a parity report): 12-36 KB in the tiny reference run
FILES_BYTES = 64 * 2**10
# An HF tokenizer.json per vocabulary entry: Qwen3's 11.4 MB for 151,669 entries (75 B)
TOKENIZER_BYTES_PER_TOKEN = 80


def checkpoint_bytes_per_param(weight_bytes: int) -> int:
    """Bytes of one checkpoint per trained parameter: fp32 weights (their own master), or the fp32 master of
    half-precision weights (the weights left out: the master determines them, runtime/trainer/master_weights.py),
    and Adam's two fp32 moments. 4 + 8 = 12 either way; a checkpoint written before the weights were left out holds
    them too (bf16: 14)."""
    weights_or_master = 4 if weight_bytes < 4 else weight_bytes
    return weights_or_master + 8


def converted_bytes_per_param(trainer_dtype: str) -> int:
    """``model/torch_dist`` is written in the dtype the trainer loads (bf16 for a bf16 run)."""
    return dtype_bytes(trainer_dtype)


def exports_at_peak(eval_points: int, keep_exports: int | None) -> int:
    """HF exports on disk at once: those of ``best``, ``latest`` and the last ``keep_exports`` versions, the new one
    being written among them (latest is one of the last N when N >= 1: best + N kept + the new one = N + 2; N = 0:
    best, the previous latest and the new one)."""
    if keep_exports is None:
        return eval_points
    return min(eval_points, max(keep_exports, 1) + 2)


def _hf_dtype(hf_config) -> str:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
    return name if name in ("float32", "bfloat16", "float16") else "float32"


def _local_size(source: str) -> int:
    """Bytes of a local data source (file or directory); 0 for builtin and remote ones (not fetched to plan)."""
    if "://" in source and not source.startswith("file://"):
        return 0
    p = Path(source.removeprefix("file://")).expanduser()
    if p.is_file():
        return p.stat().st_size
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return 0


def disk_terms(cfg, hf_config, *, device: str) -> dict[str, Any]:
    """The run directory's peak bytes, by term (module doc), with the counts behind them."""
    from runtime.devices import resolve_dtype
    from runtime.plan import lora_memory
    from runtime.plan.shape import model_shape

    m = model_shape(hf_config)
    n_params, _ = shape_param_counts(m, 1)
    trainer_dtype = resolve_dtype(cfg, device)
    e = dtype_bytes(trainer_dtype)
    export_e = dtype_bytes(_hf_dtype(hf_config))
    lora = lora_memory.config_lora(cfg)
    adapters = lora_memory.adapter_params(m, lora, 1)[0] if lora else 0
    trained = adapters if lora else n_params
    per_ckpt = trained * checkpoint_bytes_per_param(e)
    n_ckpts = min(cfg.checkpoint.keep_last + 1, len(cfg.chunk_bounds()))
    registered = len([p for p in cfg.eval_points() if p > 0]) if cfg.data.eval and cfg.tracking.enabled else 0
    n_exports = exports_at_peak(registered, cfg.tracking.keep_exports)
    per_export = n_params * export_e + adapters * export_e
    data = _local_size(cfg.data.train.source) + sum(_local_size(s.source) for s in cfg.data.eval.values())
    tokenizer = m["V"] * TOKENIZER_BYTES_PER_TOKEN  # in the HF model and each export
    exact = {"hf_model": n_params * export_e, "converted": n_params * converted_bytes_per_param(trainer_dtype),
             "checkpoints": n_ckpts * per_ckpt, "exports": n_exports * per_export,
             "files": (2 + n_ckpts + n_exports) * FILES_BYTES + (1 + n_exports) * tokenizer + 2 * data}
    exact["total"] = sum(exact.values())
    out: dict[str, Any] = {k: v / GIB for k, v in exact.items()}
    out.update(bytes=exact, checkpoints_n=n_ckpts, checkpoint_bytes=per_ckpt,
               checkpoint_bytes_per_param=checkpoint_bytes_per_param(e),
               trained_params=trained, lora=bool(lora), moe=bool(m.get("E")), exports_n=n_exports, registered_n=registered,
               export_bytes=per_export, trainer_dtype=trainer_dtype, export_dtype=_hf_dtype(hf_config),
               keep_last=cfg.checkpoint.keep_last, keep_exports=cfg.tracking.keep_exports)
    return out


def local_dir(cfg) -> str:
    """The local directory whose disk holds the run's bytes: ``storage.root``, or under an ``s3://`` root the
    scratch where its writers build and keep the mirrors (``<storage.state_dir>/scratch``)."""
    from runtime import storage
    root = cfg.storage.root
    if storage.is_remote(root):
        return str(storage.scratch_root(cfg.storage.state_dir))
    return root.removeprefix("file://")


def free_bytes(path: str) -> int:
    """Free space of the disk that holds ``path``: ``shutil.disk_usage`` of its nearest existing ancestor."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def used_bytes(path: str) -> int:
    """What a run directory already holds (a resumed run's bytes are part of its peak already)."""
    p = Path(path)
    if not p.is_dir():
        return 0
    total = 0
    for dirpath, _, files in os.walk(p):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def check_disk(disk: dict[str, Any], *, free_gb: float, where: str | None, here: bool = False,
               already: int = 0) -> dict[str, Any]:
    """``disk`` (:func:`disk_terms`) against ``free_gb`` GiB: ``storage.disk_gb`` (``where`` None) or the free space
    measured at ``where`` (``here``: on the machine validate runs on, not the run's), ``already`` bytes of the run
    written (a resumed run's): adds ``free_gb``, ``source``, ``fits`` and, when it does not fit, ``reason``."""
    source = "storage.disk_gb" if where is None else f"free at {where}" + (
        " on this machine; the run checks where it starts" if here else "")
    need = max(disk["bytes"]["total"] - already, 0)
    disk.update(free_gb=free_gb, source=source, where=where, already=already / GIB, need_now=need / GIB,
                fits=need <= free_gb * GIB)
    disk["reason"] = None if disk["fits"] else _why_not(disk)
    return disk


def _why_not(disk: dict[str, Any]) -> str:
    b = disk["bytes"]
    what = [f"{disk['checkpoints_n']} checkpoints of {disk['checkpoint_bytes'] / GIB:.1f} GiB "
            f"(checkpoint.keep_last={disk['keep_last']} and the one being written)"]
    if disk["exports_n"]:
        what.append(f"{disk['exports_n']} HF exports of {disk['export_bytes'] / GIB:.1f} GiB "
                    f"(tracking.keep_exports={_shown(disk['keep_exports'])})")
    what.append(f"the models {(b['hf_model'] + b['converted']) / GIB:.1f} GiB")
    fixes = []
    if disk["keep_last"] > 1:
        fixes.append("a smaller checkpoint.keep_last")
    if disk["exports_n"] > 3:
        fixes.append("a smaller tracking.keep_exports")
    least = _least(disk)
    settings = "checkpoint.keep_last=1" + (", tracking.keep_exports=0" if disk["exports_n"] else "")
    fixes.append(f"a larger disk for storage.root (or for storage.state_dir under an s3:// root: its writers build "
                 f"each directory there): at least {least / GIB:.1f} GiB with {settings}")
    cannot = ""
    models = b["hf_model"] + b["converted"]
    bare = models + 2 * disk["checkpoint_bytes"]  # no exports, keep_last 1
    if models + disk["checkpoint_bytes"] - disk["already"] * GIB > disk["free_gb"] * GIB:
        # not even one checkpoint: retention cannot help, a smaller checkpoint or a larger disk can
        cannot = (f"; this disk cannot hold even one checkpoint ({disk['checkpoint_bytes'] / GIB:.1f} GiB: "
                  f"{disk['checkpoint_bytes_per_param']} B x {disk['trained_params'] / 1e9:.2f}B "
                  f"{'adapter ' if disk['lora'] else ''}parameters) beside the models ({models / GIB:.1f} GiB)")
        if not disk["lora"] and not disk["moe"]:  # LoRA on a mixture of experts is refused by the trainer
            fixes.append("train.lora (a checkpoint holds the adapters and their optimizer only)")
        fixes.append("a depth-truncated shape of this width (a local model dir whose config.json has fewer "
                     "num_hidden_layers: 12 B a parameter of what is left)")
    elif bare - disk["already"] * GIB > disk["free_gb"] * GIB and disk["checkpoints_n"] > 1:
        cannot = (f"; this disk cannot hold one durable checkpoint while the next is written beside the models "
                  f"({bare / GIB:.1f} GiB)")
    more = f" ({disk['need_now']:.1f} beyond the {disk['already']:.1f} it holds)" if disk["already"] else ""
    has = (f"storage.disk_gb allows {disk['free_gb']:.1f} GiB" if disk["where"] is None
           else f"{disk['where']} has {disk['free_gb']:.1f} GiB free")
    return (f"the run directory needs {disk['total']:.1f} GiB of disk at its peak{more} but {has}: "
            + ", ".join(what) + cannot + "; use " + ", or ".join(fixes))


def _least(disk: dict[str, Any]) -> int:
    """The run's bytes with one durable checkpoint and the fewest exports the retention allows."""
    b = disk["bytes"]
    ckpts = min(2, disk["checkpoints_n"])
    exports = min(disk["registered_n"], 3)
    return b["total"] - b["checkpoints"] - b["exports"] + ckpts * disk["checkpoint_bytes"] \
        + exports * disk["export_bytes"]


def _shown(v) -> str:
    return "null" if v is None else str(v)


def format_disk(disk: dict[str, Any]) -> list[str]:
    """Lines for ``grpoflow validate``: the disk's terms and total."""
    per = disk["checkpoint_bytes_per_param"]
    rows = [("hf model", disk["hf_model"], f"the fetched HF weights ({disk['export_dtype']})"),
            ("converted", disk["converted"], f"model/torch_dist in the trainer's {disk['trainer_dtype']}"),
            ("checkpoints", disk["checkpoints"],
             f"{disk['checkpoints_n']} x {disk['checkpoint_bytes'] / GIB:.2f} GiB: keep_last {disk['keep_last']} + "
             f"the one being written; {per} B per {'adapter ' if disk['lora'] else ''}parameter"),
            ("exports", disk["exports"],
             f"{disk['exports_n']} x {disk['export_bytes'] / GIB:.2f} GiB of {disk['registered_n']} eval points "
             f"(best, latest, keep_exports {_shown(disk['keep_exports'])}; the one being written among them)"
             if disk["registered_n"] else "no registered eval points"),
            ("files", disk["files"], "configs, tokenizers, manifests, data")]
    lines = ["disk of the run directory at its peak:"]
    lines += [f"  {name:<15}{gib:8.2f} GiB" + (f"   {note}" if note else "") for name, gib, note in rows]
    total = f"  {'total':<15}{disk['total']:8.2f} GiB"
    if disk.get("free_gb") is not None:
        verdict = "fits" if disk["fits"] else "DOES NOT FIT"
        total += f" of {disk['free_gb']:.1f} GiB ({disk['source']}): {verdict}"
    return lines + [total]
