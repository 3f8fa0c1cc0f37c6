"""`grpoflow models list|show|export`: what the MLflow model registry holds for grpoflow checkpoints, and an
export made again from a version's checkpoint after registry retention removed it.

``tracking_uri=None`` means the default SQLite store under ``root`` (what a run with a local
storage.root and no tracking.uri writes to). Unknown models, versions or aliases are one-line
UserErrors; an unreachable server a TransientError naming the URI.
"""
from __future__ import annotations

import os
import re
import sys
from datetime import datetime, timezone

from runtime.config import DEFAULT_ROOT
from runtime.errors import UserError
from runtime.tracking.export_retention import EXPORT_REMOVED_TAG
from runtime.tracking.model_registry import ADAPTER_URI_TAG, EXPORT_URI_TAG, METRIC_TAG, PRIMARY_METRIC_TAG, RUN_ROOT_TAG


def _uri(tracking_uri: str | None, root: str) -> str:
    from runtime.tracking.mlflow_tracker import store_uri_for_root

    return tracking_uri or store_uri_for_root(root)


def _console():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160, soft_wrap=False)


def _store_missing(uri: str) -> bool:
    from runtime.tracking.mlflow_tracker import sqlite_path

    db = sqlite_path(uri)
    return db is not None and not os.path.lexists(db)  # something else in its place is refused by make_client


def _metrics(tags: dict[str, str]) -> dict[str, float]:
    out = {}
    for k, v in tags.items():
        if k.startswith(METRIC_TAG):
            try:
                out[k[len(METRIC_TAG):]] = float(v)
            except ValueError:
                pass
    return dict(sorted(out.items()))


def _short_metric(name: str) -> str:
    return name.removeprefix("eval/").replace("_at_", "@")


def _aliases_by_version(aliases: dict[str, int]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for alias, version in aliases.items():
        out.setdefault(int(version), []).append(alias)
    return {v: sorted(a) for v, a in out.items()}


def _registered_models(client) -> list:
    out, token = [], None
    while True:
        page = client.search_registered_models(max_results=1000, page_token=token)
        out += list(page)
        token = getattr(page, "token", None)
        if not token:
            return sorted(out, key=lambda m: m.name)


def models_list(tracking_uri: str | None = None, root: str = DEFAULT_ROOT) -> int:
    """Print every registered model version: model, version, aliases, rollout, run id, eval metrics."""
    from rich.table import Table

    from runtime.tracking.model_registry import aliases_of, all_versions
    from runtime.secrets import redact_uri
    from runtime.tracking.mlflow_tracker import make_client, mlflow_errors

    uri = _uri(tracking_uri, root)
    console = _console()
    if _store_missing(uri):
        console.print(f"No registered models: no MLflow store at {redact_uri(uri)} (nothing registered yet).")
        return 0
    client = make_client(uri)
    with mlflow_errors(uri, "list registered models"):
        models = _registered_models(client)
        rows = []
        for m in models:
            aliases = _aliases_by_version(aliases_of(client, m.name))
            for v in sorted(all_versions(client, m.name), key=lambda v: int(v.version)):
                metrics = _metrics(v.tags)
                rows.append((m.name, str(v.version), ", ".join(aliases.get(int(v.version), [])),
                             v.tags.get("grpoflow.rollout", ""), v.tags.get("grpoflow.run_id", ""),
                             "  ".join(f"{_short_metric(k)}={val:.4g}" for k, val in metrics.items())))
    if not rows:
        console.print(f"No registered models in {redact_uri(uri)}.")
        return 0
    table = Table(title=f"registered models ({redact_uri(uri)})")
    for col in ("model", "version", "aliases", "rollout", "run id", "eval metrics"):
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    return 0


def parse_spec(spec: str) -> tuple[str, str | None, int | None]:
    """``NAME`` / ``NAME@alias`` / ``NAME/version`` -> (name, alias, version)."""
    spec = spec.strip()
    if m := re.fullmatch(r"(.+)@([\w.\-]+)", spec):
        return m.group(1), m.group(2), None
    if m := re.fullmatch(r"(.+)/(\d+)", spec):
        return m.group(1), None, int(m.group(2))
    if not spec or "@" in spec or "/" in spec:
        raise UserError(f"model spec {spec!r}: use NAME, NAME@alias or NAME/version (e.g. grpo@best, grpo/3)")
    return spec, None, None


def _load_snippet(source: str) -> str:
    from runtime import storage

    source = storage.path_of(source)
    if not storage.is_remote(source):
        return (f'from transformers import AutoModelForCausalLM, AutoTokenizer\n'
                f'model = AutoModelForCausalLM.from_pretrained("{source}")\n'
                f'tokenizer = AutoTokenizer.from_pretrained("{source}")')
    return (f'import mlflow\n'
            f'from transformers import AutoModelForCausalLM, AutoTokenizer\n'
            f'path = mlflow.artifacts.download_artifacts("{source}")\n'
            f'model = AutoModelForCausalLM.from_pretrained(path)\n'
            f'tokenizer = AutoTokenizer.from_pretrained(path)')


def _find_version(client, uri: str, spec: str):
    """(name, the model version, the model's aliases) of ``NAME`` (its newest version), ``NAME@alias`` or
    ``NAME/version``; unknown models, aliases and versions are one-line UserErrors."""
    from mlflow.exceptions import MlflowException

    from runtime.secrets import redact_uri
    from runtime.tracking.model_registry import aliases_of

    name, alias, version = parse_spec(spec)
    where = redact_uri(uri)
    try:
        client.get_registered_model(name)
    except MlflowException as err:
        if getattr(err, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
            raise
        known = ", ".join(m.name for m in _registered_models(client)) or "none"
        raise UserError(f"unknown model '{name}' in {where} (registered: {known}); "
                        f"see `grpoflow models list`") from None
    aliases = aliases_of(client, name)  # "latest" = the newest version
    if alias is not None:
        if alias not in aliases:
            raise UserError(f"model '{name}' has no alias '{alias}' (aliases: "
                            f"{', '.join(sorted(aliases)) or 'none'})")
        version = aliases[alias]
    elif version is None:
        if "latest" not in aliases:
            raise UserError(f"model '{name}' has no versions yet")
        version = aliases["latest"]
    try:
        mv = client.get_model_version(name, str(version))
    except MlflowException as err:
        if getattr(err, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
            raise
        raise UserError(f"model '{name}' has no version {version}; see `grpoflow models list`") from None
    return name, mv, aliases


def _open_store(tracking_uri: str | None, root: str, name: str):
    from runtime.secrets import redact_uri
    from runtime.tracking.mlflow_tracker import make_client

    uri = _uri(tracking_uri, root)
    if _store_missing(uri):
        raise UserError(f"unknown model '{name}': no MLflow store at {redact_uri(uri)} (give --tracking-uri, "
                        f"or --root of the runs)")
    return uri, make_client(uri)


def models_show(spec: str, tracking_uri: str | None = None, root: str = DEFAULT_ROOT) -> int:
    """Print one model version (``NAME`` = its newest version, as ``NAME@latest``): metrics, tags,
    source, and how to load it (or, when retention removed its export, how to export it again)."""
    from rich.table import Table

    from runtime.tracking.mlflow_tracker import mlflow_errors

    uri, client = _open_store(tracking_uri, root, parse_spec(spec)[0])
    with mlflow_errors(uri, f"show {spec}"):
        name, mv, aliases = _find_version(client, uri, spec)

    console = _console()
    mine = sorted(a for a, v in aliases.items() if v == int(mv.version))
    created = datetime.fromtimestamp(mv.creation_timestamp / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    console.print(f"[bold]{name}[/bold] version {mv.version}" + (f"  (aliases: {', '.join(mine)})" if mine else ""))
    console.print(f"source:        {mv.source}", markup=False, highlight=False)
    export_uri = mv.tags.get(EXPORT_URI_TAG)
    if export_uri and export_uri != mv.source:
        console.print(f"export:        {export_uri}", markup=False, highlight=False)
    adapter_uri = mv.tags.get(ADAPTER_URI_TAG)
    if adapter_uri:
        console.print(f"adapter:       {adapter_uri}  (the LoRA adapter alone, PEFT layout)", markup=False,
                      highlight=False)
    console.print(f"grpoflow run:  {mv.tags.get('grpoflow.run_id', '?')}  rollout {mv.tags.get('grpoflow.rollout', '?')}",
                  markup=False, highlight=False)
    console.print(f"mlflow run:    {mv.run_id or '-'}", markup=False, highlight=False)
    console.print(f"created:       {created}", markup=False, highlight=False)
    metrics = _metrics(mv.tags)
    if metrics:
        table = Table(title="metrics")
        table.add_column("metric", overflow="fold")
        table.add_column("value", justify="right")
        primary = mv.tags.get(PRIMARY_METRIC_TAG)
        for k, v in metrics.items():
            table.add_row(_short_metric(k) + ("  (primary)" if k == primary else ""), f"{v:.6g}")
        console.print(table)
    others = {k: v for k, v in sorted(mv.tags.items()) if not k.startswith(METRIC_TAG)}
    if others:
        table = Table(title="tags")
        table.add_column("tag", overflow="fold")
        table.add_column("value", overflow="fold")
        for k, v in others.items():
            table.add_row(k, v)
        console.print(table)
    if EXPORT_REMOVED_TAG in mv.tags:
        console.print(f"export removed {mv.tags[EXPORT_REMOVED_TAG]}; the version keeps its metrics and lineage.",
                      markup=False, highlight=False)
        console.print(_reexport_advice(name, mv, tracking_uri, root), markup=False, highlight=False)
        return 0
    console.print("load it with:")
    console.print(_load_snippet(_loadable(export_uri, mv.source)), markup=False, highlight=False)
    adapter_dir = _loadable(adapter_uri, "") if adapter_uri else ""
    if adapter_dir:
        console.print("or the adapter alone, on the base its adapter_config.json names:", markup=False, highlight=False)
        console.print(f'from peft import AutoPeftModelForCausalLM\n'
                      f'model = AutoPeftModelForCausalLM.from_pretrained("{adapter_dir}")', markup=False,
                      highlight=False)
    return 0


def _run_dir_of(mv, root: str):
    """The RunDir that registered ``mv`` (its ``grpoflow.run_root`` tag, else ``root``), with the state dir
    its frozen config names (a remote root keeps local copies there)."""
    from runtime.run.directory import RunDir

    rd = RunDir(mv.tags.get(RUN_ROOT_TAG) or root, mv.tags["grpoflow.run_id"])
    try:
        from runtime.run.frozen_config import frozen_config
        return RunDir(rd.root, rd.run_id, frozen_config(rd).storage.state_dir)
    except Exception:  # the run dir is gone or its config unreadable: the checkpoint check says what is missing
        return rd


def _checkpoint_kept(rd, rollout: int) -> bool:
    from runtime import storage

    return storage.exists(storage.join(rd.checkpoint(rollout), "manifest.json"))


def _reexport_advice(name: str, mv, tracking_uri: str | None, root: str) -> str:
    from runtime.tracking.export_retention import reexport_command

    rd, rollout = _run_dir_of(mv, root), int(mv.tags["grpoflow.rollout"])
    if _checkpoint_kept(rd, rollout):
        return (f"re-export it from its checkpoint ({rd.checkpoint(rollout)}):\n"
                f"  {reexport_command(name, mv.version, rd.root, tracking_uri)}")
    return (f"its checkpoint {rd.checkpoint(rollout)} is gone too (checkpoint.keep_last pruned it): this version "
            f"cannot be exported again")


def models_export(spec: str, tracking_uri: str | None = None, root: str = DEFAULT_ROOT) -> int:
    """Export a registered version again from its run's checkpoint (after retention removed its export) into
    the run's ``exports/rollout_<N>/hf``, upload it again where the version was registered from an upload,
    and tag the version ``grpoflow.export_kept`` so retention leaves it."""
    from runtime import storage
    from runtime.tracking.export_retention import EXPORT_KEPT_TAG, uploaded_artifact
    from runtime.tracking.mlflow_tracker import mlflow_errors
    from runtime.tracking.model_registry import _upload_export, export_checkpoint, export_complete

    uri, client = _open_store(tracking_uri, root, parse_spec(spec)[0])
    with mlflow_errors(uri, f"export {spec}"):
        name, mv, _ = _find_version(client, uri, spec)
    if "grpoflow.run_id" not in mv.tags or "grpoflow.rollout" not in mv.tags:
        raise UserError(f"{name}/{mv.version} was not registered by grpoflow (no grpoflow.run_id tag): "
                        f"nothing to export it from")
    rd, rollout = _run_dir_of(mv, root), int(mv.tags["grpoflow.rollout"])
    console = _console()
    if EXPORT_REMOVED_TAG not in mv.tags and export_complete(rd.export(rollout)):
        console.print(f"{name}/{mv.version}: its export is there ({rd.export(rollout)}); nothing to do",
                      markup=False, highlight=False)
        return 0
    if not _checkpoint_kept(rd, rollout):
        raise UserError(f"{name}/{mv.version}: its checkpoint {rd.checkpoint(rollout)} is gone "
                        f"(checkpoint.keep_last pruned it, or --root is not the run's storage.root)")
    with mlflow_errors(uri, f"export {spec}"):
        client.set_model_version_tag(name, mv.version, EXPORT_KEPT_TAG, "re-exported by `grpoflow models export`")
    info = export_checkpoint(rd, rollout)
    upload = uploaded_artifact(mv)
    with mlflow_errors(uri, f"export {spec}"):
        if upload is not None:
            _upload_export(client, upload[0], rd.local(info["path"]) if storage.is_remote(info["path"])
                           else info["path"], rollout)
        if EXPORT_REMOVED_TAG in mv.tags:
            client.delete_model_version_tag(name, mv.version, EXPORT_REMOVED_TAG)
    console.print(f"{name}/{mv.version}: exported rollout {rollout} of run {rd.run_id} to {info['path']} "
                  f"in {info.get('seconds', 0):.1f} s", markup=False, highlight=False)
    return 0


def _loadable(export_uri: str | None, source: str) -> str:
    """The local export dir when it is on this machine (a server registers an uploaded copy), else the source."""
    from pathlib import Path

    from runtime import storage

    if export_uri and not storage.is_remote(export_uri) and Path(storage.path_of(export_uri)).is_dir():
        return storage.path_of(export_uri)
    return source


__all__ = ["models_list", "models_show", "models_export", "parse_spec"]
