"""The run report: one self-contained HTML page of a run's curves, evals, registered versions and config.

``write_report(cfg, rd, tracker_or_uri)`` reads the run's metrics from MLflow (the record the user
also sees in ``mlflow ui``), draws them with matplotlib (Agg) and writes ``runs/<id>/report/`` —
``index.html`` with every picture embedded as a base64 PNG, the PNGs beside it — as one atomic
directory (uploaded with ``index.html`` last on a remote root), then logs it as the MLflow run's
``report/`` artifacts. The page carries the series it draws as JSON (``<script id="grpoflow-series">``)
so what the pictures show can be checked against MLflow.

Metric names are MLflow's (``eval/copy/avg_at_4``); the page shows them with ``@``.
"""
from __future__ import annotations

import base64
import html
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime import storage
from runtime.errors import ConfigError
from runtime.run.directory import RunDir

if TYPE_CHECKING:  # pragma: no cover
    from runtime.config import GrpoConfig

REPORT_DIR = "report"
INDEX = "index.html"
SERIES_ID = "grpoflow-series"
# Time per rollout, in the order of a rollout. The checkpoint of a chunk is charged to its last rollout
# and an eval after N rollouts to rollout N-1 (to rollout 0 when before training).
TIME_PARTS = [("generate", "generate_time_s"), ("reward", "reward_time_s"), ("train", "train_time_s"),
              ("weight sync", "weight_sync_s"), ("checkpoint", "checkpoint_s")]


Series = dict[str, list]  # {"steps": [...], "values": [...]}


@dataclass
class Picture:
    file: str
    title: str
    series: list[str]  # the MLflow metric keys it draws
    png: bytes = b""


@dataclass
class ReportData:
    run_id: str
    mlflow_run_id: str
    tracking_uri: str
    metrics: dict[str, Series]
    versions: list[dict[str, Any]] = field(default_factory=list)
    config_text: str = ""
    # other runs drawn beside this one (`grpoflow report RUN --against OTHER`): run id → its metrics
    against: dict[str, dict[str, Series]] = field(default_factory=dict)


# ---- reading MLflow ---------------------------------------------------------------------------------
def _client_and_run(cfg: "GrpoConfig", rd: RunDir, tracker_or_uri) -> tuple[Any, str, str]:
    """(MlflowClient, tracking URI, MLflow run id) of the run, from a Tracker or a tracking URI
    (None: the run's default store)."""
    from runtime.secrets import redact_uri
    from runtime.tracking.mlflow_tracker import RUN_TAG, default_tracking_uri, make_client

    if hasattr(tracker_or_uri, "run_id") and hasattr(tracker_or_uri, "client"):
        t = tracker_or_uri
        if not t.enabled:
            raise ConfigError(f"run {rd.run_id} is not tracked (tracking.enabled=false): no metrics to report")
        return t.client, t.uri, t.run_id
    if tracker_or_uri is None and not cfg.tracking.enabled:
        raise ConfigError(f"run {rd.run_id} is not tracked (tracking.enabled=false): no metrics to report")
    uri = tracker_or_uri or default_tracking_uri(cfg)
    client = make_client(uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = [] if exp is None else client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{rd.run_id}'",
        order_by=["attributes.start_time ASC"], max_results=1)
    if not runs:
        raise ConfigError(f"no MLflow run of grpoflow run {rd.run_id} in experiment '{cfg.tracking.experiment}' "
                          f"at {redact_uri(uri)}; pass the store the run logged to (--tracking-uri)")
    return client, uri, runs[0].info.run_id


def metric_series(client, mlflow_run_id: str) -> dict[str, Series]:
    """Every metric of the MLflow run as steps and values, in step order (one point per step)."""
    keys = sorted(client.get_run(mlflow_run_id).data.metrics)
    out = {}
    for key in keys:
        points = {}
        for m in sorted(client.get_metric_history(mlflow_run_id, key), key=lambda m: (m.step, m.timestamp)):
            points[int(m.step)] = float(m.value)
        steps = sorted(points)
        out[key] = {"steps": steps, "values": [points[s] for s in steps]}
    return out


def registered_versions(client, name: str, run_id: str) -> list[dict[str, Any]]:
    """The versions of registered model ``name`` made from this run: version, rollout, current aliases,
    the metric that decides ``best`` and its value, source."""
    from mlflow.exceptions import MlflowException

    from runtime.tracking.model_registry import PRIMARY_METRIC_TAG, PRIMARY_VALUE_TAG, aliases_of, all_versions

    try:
        versions = [v for v in all_versions(client, name) if v.tags.get("grpoflow.run_id") == run_id]
        aliases = aliases_of(client, name) if versions else {}
    except MlflowException as err:
        if str(getattr(err, "error_code", "")) == "RESOURCE_DOES_NOT_EXIST":
            return []
        raise
    out = []
    for v in sorted(versions, key=lambda v: int(v.version)):
        out.append({"name": name, "version": int(v.version), "rollout": int(v.tags.get("grpoflow.rollout", -1)),
                    "aliases": sorted(a for a, n in aliases.items() if n == int(v.version)),
                    "primary_metric": v.tags.get(PRIMARY_METRIC_TAG, ""),
                    "primary_value": float(v.tags[PRIMARY_VALUE_TAG]) if PRIMARY_VALUE_TAG in v.tags else None,
                    "source": v.source})
    return out


def collect(cfg: "GrpoConfig", rd: RunDir, tracker_or_uri=None) -> ReportData:
    """What the report shows, read from MLflow (metrics, registered versions) and the run dir (config)."""
    return _collect(cfg, rd, *_client_and_run(cfg, rd, tracker_or_uri))


def _collect(cfg: "GrpoConfig", rd: RunDir, client, uri: str, mlflow_run_id: str) -> ReportData:
    from runtime.secrets import redact_uri
    from runtime.tracking.mlflow_tracker import mlflow_errors

    with mlflow_errors(uri, f"read run {rd.run_id} for its report"):
        metrics = metric_series(client, mlflow_run_id)
        versions = registered_versions(client, cfg.tracking.registered_model or cfg.name, rd.run_id)
    config_text = storage.read_text(rd.config) if storage.exists(rd.config) else ""
    return ReportData(rd.run_id, mlflow_run_id, redact_uri(uri), metrics, versions, config_text)


# ---- drawing ----------------------------------------------------------------------------------------
def label(key: str) -> str:
    return key.replace("_at_", "@")


def _eval_keys(metrics: dict[str, Series]) -> dict[str, list[str]]:
    """eval set -> its correctness metrics (avg@n, pass@k), from the MLflow keys eval/<set>/<metric>."""
    out: dict[str, list[str]] = {}
    for key in metrics:
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval" and (parts[2].startswith("avg_at_") or parts[2].startswith("pass_at_")):
            out.setdefault(parts[1], []).append(key)
    return {k: sorted(v) for k, v in sorted(out.items())}


def eval_time_key(metrics: dict[str, Series]) -> list[str]:
    return sorted(k for k in metrics if k.startswith("eval/") and k.endswith("/eval_time_s"))


def time_parts(metrics: dict[str, Series]) -> dict[str, dict[int, float]]:
    """Seconds per rollout by part (generate, reward, train, weight sync, checkpoint, eval): {part: {rollout: s}}.
    A run logged before generate_time_s/reward_time_s existed shows their sum, rollout_time_s, as "generate + reward"."""
    parts: dict[str, dict[int, float]] = {}
    names = list(TIME_PARTS)
    if "generate_time_s" not in metrics and "rollout_time_s" in metrics:
        names = [("generate + reward", "rollout_time_s")] + names[2:]
    for name, key in names:
        if key in metrics:
            parts[name] = dict(zip(metrics[key]["steps"], metrics[key]["values"]))
    evals: dict[int, float] = {}
    for key in eval_time_key(metrics):
        for step, v in zip(metrics[key]["steps"], metrics[key]["values"]):
            evals[max(step - 1, 0)] = evals.get(max(step - 1, 0), 0.0) + v
    if evals:
        parts["eval"] = evals
    return parts


def _plot(ax, metrics: dict[str, Series], key: str, **kw) -> bool:
    s = metrics.get(key)
    if not s or not s["steps"]:
        return False
    ax.plot(s["steps"], s["values"], label=label(key), **kw)
    return True


def _plot_against(ax, data: ReportData, keys: list[str]) -> None:
    """The other runs' curves of ``keys``, dashed, each run in a grey of its own, labelled with its run id."""
    for i, (run_id, metrics) in enumerate(data.against.items()):
        for k in keys:
            s = metrics.get(k)
            if s and s["steps"]:
                ax.plot(s["steps"], s["values"], linestyle="--", color=str(0.2 + 0.5 * i / max(len(data.against), 1)),
                        label=f"{run_id}: {label(k)}")


def figures(data: ReportData) -> list[Picture]:
    """The report's pictures (PNG bytes) and the metric keys each one draws."""
    # matplotlib's object API renders with Agg and touches no pyplot state (no GUI backend, no open figures).
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    m = data.metrics
    out: list[Picture] = []

    def subplots(ncols: int = 1, figsize=(8, 3.6)):
        fig = Figure(figsize=figsize, dpi=100, layout="constrained")
        axes = fig.subplots(1, ncols, squeeze=False)[0]
        for ax in axes:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        return fig, axes

    def save(fig, spec: Picture) -> None:
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        spec.png = buf.getvalue()
        out.append(spec)

    if "reward_mean" in m:
        spec = Picture("reward.png", "Reward per rollout (mean ± std over the rollout's samples)",
                      [k for k in ("reward_mean", "reward_std") if k in m])
        fig, (ax,) = subplots()
        s = m["reward_mean"]
        _plot(ax, m, "reward_mean", color="C0", marker="." if len(s["steps"]) < 60 else None)
        _plot_against(ax, data, ["reward_mean"])
        if "reward_std" in m:
            std = dict(zip(m["reward_std"]["steps"], m["reward_std"]["values"]))
            lo = [v - std.get(st, 0.0) for st, v in zip(s["steps"], s["values"])]
            hi = [v + std.get(st, 0.0) for st, v in zip(s["steps"], s["values"])]
            ax.fill_between(s["steps"], lo, hi, color="C0", alpha=0.2, label="± reward_std")
        ax.set_xlabel("rollout")
        ax.set_ylabel("reward")
        fig.legend(loc="outside right upper")
        ax.grid(alpha=0.3)
        save(fig, spec)

    evals = _eval_keys(m)
    if evals:
        keys = [k for ks in evals.values() for k in ks]
        spec = Picture("eval.png", "Evaluation at each eval point (rollouts trained so far)", keys)
        fig, (ax,) = subplots()
        for k in keys:
            _plot(ax, m, k, marker="o")
        _plot_against(ax, data, keys)
        ax.set_xlabel("rollouts trained")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.02, 1.02)
        fig.legend(loc="outside right upper")
        ax.grid(alpha=0.3)
        save(fig, spec)

    pairs = [k for k in ("kl", "entropy") if k in m]
    if pairs:
        spec = Picture("kl_entropy.png", "KL to the reference policy and entropy of the policy", pairs)
        fig, axes = subplots(len(pairs), figsize=(8, 3.2))
        for ax, k in zip(axes, pairs):
            _plot(ax, m, k, color="C2" if k == "kl" else "C3")
            ax.set_title(k)
            ax.set_xlabel("rollout")
            ax.grid(alpha=0.3)
        save(fig, spec)

    lens = [k for k in ("response_len_mean", "response_len_max") if k in m]
    if lens or "truncated_frac" in m:
        spec = Picture("length.png", "Response length (tokens) and share of responses cut at max_new_tokens",
                      lens + (["truncated_frac"] if "truncated_frac" in m else []))
        fig, axes = subplots(2, figsize=(8, 3.2))
        for k in lens:
            _plot(axes[0], m, k)
        axes[0].set_title("response length")
        axes[0].legend(loc="best", fontsize="small")
        _plot(axes[1], m, "truncated_frac", color="C1")
        axes[1].set_title("truncated_frac")
        axes[1].set_ylim(-0.02, 1.02)
        for ax in axes:
            ax.set_xlabel("rollout")
            ax.grid(alpha=0.3)
        save(fig, spec)

    parts = time_parts(m)
    if parts:
        keys = ([k for _, k in TIME_PARTS if k in m] or ["rollout_time_s"]) + eval_time_key(m)
        spec = Picture("time.png", "Seconds per rollout by part (checkpoint: on a chunk's last rollout; "
                                  "eval after N rollouts: on rollout N-1)", [k for k in keys if k in m])
        steps = sorted({s for p in parts.values() for s in p})
        fig, (ax,) = subplots()
        bottom = [0.0] * len(steps)
        for i, (name, values) in enumerate(parts.items()):
            heights = [values.get(s, 0.0) for s in steps]
            ax.bar(steps, heights, bottom=bottom, width=0.85, label=name, color=f"C{i}")
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_xlabel("rollout")
        ax.set_ylabel("seconds")
        fig.legend(loc="outside right upper", fontsize="small")
        ax.grid(alpha=0.3, axis="y")
        save(fig, spec)
    return out


# ---- the page ---------------------------------------------------------------------------------------
def _num(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _table(head: list[str], rows: list[list[Any]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_num(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _eval_table(metrics: dict[str, Series]) -> str:
    cols = [k for ks in _eval_keys(metrics).values() for k in ks]
    if not cols:
        return "<p>No evaluation was logged.</p>"
    steps = sorted({s for k in cols for s in metrics[k]["steps"]})
    rows = [[s] + [dict(zip(metrics[k]["steps"], metrics[k]["values"])).get(s) for k in cols] for s in steps]
    return _table(["rollouts trained"] + [label(k) for k in cols], rows)


def _summary_rows(metrics: dict[str, Series]) -> list[list[Any]]:
    rows = []
    for key in ("reward_mean", "kl", "entropy", "response_len_mean", "truncated_frac", "step_time_s"):
        s = metrics.get(key)
        if s and s["values"]:
            v = s["values"]
            rows.append([key, v[0], v[-1], sum(v[-5:]) / len(v[-5:]), len(v)])
    return rows


def render_html(data: ReportData, figs: list[Picture]) -> str:
    drawn = {k for f in figs for k in f.series}
    shown = {k: data.metrics[k] for k in sorted(drawn)}
    shown.update({f"{run_id}/{k}": metrics[k] for run_id, metrics in data.against.items()
                  for k in sorted(drawn) if k in metrics})  # the other runs' series, under "<run id>/<key>"
    series_json = json.dumps(shown, sort_keys=True)
    series_json = series_json.replace("</", "<\\/")  # never closes the script element early
    pictures = "".join(
        f'<figure><img alt="{html.escape(f.title)}" src="data:image/png;base64,{base64.b64encode(f.png).decode()}"'
        f' data-file="{html.escape(f.file)}" data-series="{html.escape(",".join(f.series))}">'
        f"<figcaption>{html.escape(f.title)}</figcaption></figure>" for f in figs)
    versions = _table(["model", "version", "rollout", "aliases", "best decided by", "value", "source"],
                      [[v["name"], v["version"], v["rollout"], ", ".join(v["aliases"]) or "-",
                        label(v["primary_metric"]) or "-", v["primary_value"], v["source"]] for v in data.versions]
                      ) if data.versions else "<p>No version of this run is registered.</p>"
    title = f"grpoflow run {html.escape(data.run_id)}"
    against = (", dashed beside them those of run " + ", ".join(f"<code>{html.escape(r)}</code>" for r in data.against)
               ) if data.against else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: right; }}
th {{ background: #f3f3f3; }}
figure {{ margin: 1em 0; }} img {{ max-width: 100%; }}
pre {{ background: #f6f6f6; padding: 1em; overflow-x: auto; }}
</style></head><body>
<h1>{title}</h1>
<p>MLflow run <code>{html.escape(data.mlflow_run_id)}</code> at <code>{html.escape(data.tracking_uri)}</code>.
The curves below are this run's MLflow metrics (step = rollout){against}; their values are in the JSON block
<code>#{SERIES_ID}</code> of this page.</p>
<h2>At a glance</h2>
{_table(["metric", "first", "last", "mean of last 5", "points"], _summary_rows(data.metrics))}
<h2>Evaluations</h2>
{_eval_table(data.metrics)}
<h2>Registered versions</h2>
{versions}
<h2>Curves</h2>
{pictures}
<h2>Config</h2>
<pre>{html.escape(data.config_text)}</pre>
<script type="application/json" id="{SERIES_ID}">{series_json}</script>
</body></html>
"""


def series_of_page(page: str) -> dict[str, Series]:
    """The series a report page carries (what its pictures draw)."""
    start = page.index(f'id="{SERIES_ID}">') + len(f'id="{SERIES_ID}">')
    return json.loads(page[start:page.index("</script>", start)].replace("<\\/", "</"))


def write_report(cfg: "GrpoConfig", rd: RunDir, tracker_or_uri=None,
                 against: list[tuple["GrpoConfig", RunDir]] = ()) -> str:
    """Write ``runs/<id>/report/`` (index.html + PNGs) atomically and log it as the MLflow run's
    ``report/`` artifacts; returns the path of index.html. ``tracker_or_uri``: the run's Tracker, a
    tracking URI, or None for the run's default store. ``against``: other runs (their config and run dir, tracked in
    the same store) whose reward and eval curves are drawn beside this run's."""
    from runtime.tracking.mlflow_tracker import mlflow_errors

    client, uri, mlflow_run_id = _client_and_run(cfg, rd, tracker_or_uri)
    data = _collect(cfg, rd, client, uri, mlflow_run_id)
    for other_cfg, other_rd in against:
        other_client, other_uri, other_run = _client_and_run(other_cfg, other_rd, uri)
        with mlflow_errors(other_uri, f"read run {other_rd.run_id} for the report of run {rd.run_id}"):
            data.against[other_rd.run_id] = metric_series(other_client, other_run)
    figs = figures(data)
    page = render_html(data, figs)
    final = rd.sub(REPORT_DIR)
    with storage.output_dir(final, rd.state_dir, last=[INDEX]) as out:
        with storage.atomic_dir(out) as tmp:
            for f in figs:
                (tmp / f.file).write_bytes(f.png)
            (tmp / INDEX).write_text(page, encoding="utf-8")
        local = Path(out)
    with mlflow_errors(uri, f"log the report of run {rd.run_id}"):
        client.log_artifacts(mlflow_run_id, str(local), REPORT_DIR)
    return storage.join(final, INDEX)


__all__ = ["write_report", "collect", "figures", "render_html", "series_of_page", "metric_series",
           "registered_versions", "time_parts", "ReportData", "Picture"]
