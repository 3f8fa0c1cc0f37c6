"""Registry retention (``tracking.keep_exports``): after a registration, a run keeps the HF exports of the
model's ``best`` and ``latest`` versions, its own newest version and its last N versions; the exports of its
older versions are removed (the run's ``exports/rollout_<N>/`` and, with an MLflow server, the copy uploaded
to the run's artifacts). The versions themselves stay, with their metrics, tags and lineage, tagged
``grpoflow.export_removed`` so `grpoflow models show` can say what happened and how to re-export.

A run prunes only its own versions: those whose ``grpoflow.run_id`` tag is the run's and whose export tag
names this run directory (a registered model may hold versions of several runs, and run ids repeat across
storage roots). A version re-exported by `grpoflow models export` is tagged ``grpoflow.export_kept`` and left
alone. Every step is idempotent: a pass killed half way is finished by the next one (the export is deleted
before the tag is set, and deleting what is gone is a no-op).
"""
from __future__ import annotations

import logging
import time

from runtime import storage
from runtime.run.directory import RunDir
from runtime.secrets import redact_uri
from runtime.testing.moments import moment
from runtime.tracking.model_registry import BEST, EXPORT_URI_TAG, LATEST, aliases_of, all_versions

log = logging.getLogger(__name__)

EXPORT_REMOVED_TAG = "grpoflow.export_removed"  # why and when its export was removed
EXPORT_KEPT_TAG = "grpoflow.export_kept"  # re-exported on request: retention leaves it


def exports_to_keep(run_versions: list[int], *, keep: int, best: int | None, latest: int | None) -> set[int]:
    """The versions (of one run, plus the model's ``best`` and ``latest``) whose exports stay: best, latest,
    the run's newest and its ``keep`` newest."""
    newest = sorted(run_versions)[-max(keep, 1):]
    return {v for v in (best, latest, *newest) if v is not None}


def uploaded_artifact(mv) -> tuple[str, str] | None:
    """(MLflow run id, artifact path) of a version registered from an upload to its run (``runs:/<id>/<path>``,
    what a server's registration does), else None."""
    if not str(mv.source).startswith("runs:/"):
        return None
    run_id, _, path = str(mv.source)[len("runs:/"):].partition("/")
    return (run_id, path) if run_id and path else None


def _remove_uploaded(client, tracking_uri: str, mlflow_run_id: str, path: str) -> None:
    """Delete what was uploaded under ``path`` of MLflow run ``mlflow_run_id`` through MLflow's artifact
    repository (the server's artifact store: local, S3 or proxied)."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    if not list(client.list_artifacts(mlflow_run_id, path)):
        return  # removed by an earlier pass
    repo = get_artifact_repository(client.get_run(mlflow_run_id).info.artifact_uri, tracking_uri=tracking_uri)
    repo.delete_artifacts(path)


def prune_exports(client, *, tracking_uri: str, name: str, rd: RunDir, keep: int | None,
                  mlflow_run_id: str | None) -> list[int]:
    """Remove the exports of run ``rd``'s versions of ``name`` beyond what :func:`exports_to_keep` keeps;
    the versions pruned in this pass (``keep`` None: none)."""
    if keep is None:
        return []
    mine = all_versions(client, name, f"tags.`grpoflow.run_id` = '{rd.run_id}'")  # run ids hold no quotes
    aliases = aliases_of(client, name)
    kept = exports_to_keep([int(v.version) for v in mine], keep=keep, best=aliases.get(BEST),
                           latest=aliases.get(LATEST))
    pruned = []
    for mv in sorted(mine, key=lambda v: int(v.version)):
        tags = mv.tags
        if int(mv.version) in kept or EXPORT_REMOVED_TAG in tags or EXPORT_KEPT_TAG in tags:
            continue
        rollout = int(tags["grpoflow.rollout"])
        if tags.get(EXPORT_URI_TAG) != redact_uri(storage.absolute_uri(rd.export(rollout))):
            continue  # the same run id under another storage root: not this run's export
        upload = uploaded_artifact(mv)
        if upload is not None and upload[0] == mlflow_run_id:
            _remove_uploaded(client, tracking_uri, *upload)
        storage.remove_tree(rd.sub("exports", f"rollout_{rollout}"))  # hf/ and a LoRA run's adapter/
        moment("retention-export-removed")  # deleted, not yet tagged
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        client.set_model_version_tag(name, mv.version, EXPORT_REMOVED_TAG,
                                     f"by retention (tracking.keep_exports={keep}) at {stamp}")
        pruned.append(int(mv.version))
    if pruned:
        log.info("registry retention: removed the exports of %s version(s) %s", name, pruned)
    return pruned


def reexport_command(name: str, version: int | str, root: str, tracking_uri: str | None) -> str:
    where = f" --tracking-uri {redact_uri(tracking_uri)}" if tracking_uri else ""
    return f"grpoflow models export {name}/{version} --root {root}{where}"


__all__ = ["EXPORT_REMOVED_TAG", "EXPORT_KEPT_TAG", "exports_to_keep", "prune_exports",
           "uploaded_artifact", "reexport_command"]
