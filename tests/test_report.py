"""The run report shows what MLflow holds: the series drawn equal the run's metric histories (the page
carries them as JSON beside the pictures), the PNGs decode and are real pictures, the page names the
registered versions and the config, and it is logged as the MLflow run's artifacts."""
from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import pytest

from runtime.run.directory import RunDir
from runtime.run.frozen_config import frozen_config
from runtime.tracking.mlflow_tracker import make_client, store_uri_for_root
from runtime.tracking.report import INDEX, REPORT_DIR, series_of_page, write_report


@pytest.fixture(scope="module")
def report(reference_run):
    root, run_id = reference_run["root"], reference_run["run_id"]
    rd = RunDir(root, run_id)
    cfg = frozen_config(rd)
    uri = store_uri_for_root(root)
    path = write_report(cfg, rd, uri)
    return {"path": Path(path), "page": Path(path).read_text(), "uri": uri, "rd": rd, "cfg": cfg,
            "result": reference_run["result"]}


def _pixels(png: bytes):
    import matplotlib.image as mpimg
    return mpimg.imread(io.BytesIO(png), format="png")


def test_series_on_the_page_equal_mlflow(report):
    client = make_client(report["uri"])
    mlflow_run = report["result"]["train"]["mlflow_run_id"]
    series = series_of_page(report["page"])
    # what the pictures draw: reward, evals, kl, entropy, lengths, truncation, each part of a rollout's time
    for key in ("reward_mean", "reward_std", "eval/copy/avg_at_4", "eval/copy/pass_at_1", "eval/copy/pass_at_4",
                "kl", "entropy", "response_len_mean", "response_len_max", "truncated_frac", "generate_time_s",
                "reward_time_s", "train_time_s", "weight_sync_s", "checkpoint_s", "eval/copy/eval_time_s"):
        assert key in series, key
    for key, s in series.items():
        history = sorted(client.get_metric_history(mlflow_run, key), key=lambda m: m.step)
        assert s["steps"] == [m.step for m in history], key
        assert s["values"] == [m.value for m in history], key
    assert series["reward_mean"]["steps"] == [0, 1, 2, 3]
    assert series["checkpoint_s"]["steps"] == [1, 3]  # each chunk's save, on its last rollout
    assert series["eval/copy/avg_at_4"]["steps"] == [4]
    flow_rewards = [m["reward_mean"] for c in report["result"]["train"]["chunks"] for m in c["metrics"]]
    assert series["reward_mean"]["values"] == flow_rewards


def test_pictures_decode_and_are_not_blank(report):
    files = sorted(p.name for p in report["path"].parent.glob("*.png"))
    assert files == ["eval.png", "kl_entropy.png", "length.png", "reward.png", "time.png"]
    embedded = re.findall(r'src="data:image/png;base64,([^"]+)" data-file="([^"]+)"', report["page"])
    assert sorted(name for _, name in embedded) == files
    for data, name in embedded:
        png = base64.b64decode(data)
        assert png == (report["path"].parent / name).read_bytes(), name
        pixels = _pixels(png)
        h, w = pixels.shape[:2]
        assert 200 <= h <= 2000 and 400 <= w <= 3000, (name, pixels.shape)
        colours = {tuple(px) for px in pixels.reshape(-1, pixels.shape[-1])[::7].tolist()}
        assert len(colours) > 20, (name, len(colours))  # lines, labels and text, not one flat colour


def test_page_names_versions_and_config_and_is_an_mlflow_artifact(report):
    page, result = report["page"], report["result"]
    version = result["train"]["versions"][4]
    assert re.search(rf"<td>{version['name']}</td><td>{version['version']}</td><td>4</td><td>[^<]*best", page)
    assert f"name: {report['cfg'].name}" in page and "num_rollout: 4" in page  # the frozen config
    assert report["path"] == Path(report["rd"].sub(REPORT_DIR, INDEX))
    assert not list(report["path"].parent.parent.glob(".report.tmp-*"))  # written atomically, nothing left over
    client = make_client(report["uri"])
    logged = {Path(a.path).name for a in client.list_artifacts(result["train"]["mlflow_run_id"], REPORT_DIR)}
    assert {INDEX, "reward.png", "time.png"} <= logged


def test_report_command_rewrites_the_page(report, capsys):
    from cli.main import main
    rd = report["rd"]
    before = report["path"].stat().st_mtime_ns
    assert main(["report", rd.run_id, "--root", rd.root]) == 0
    out = capsys.readouterr().out
    assert str(report["path"]) in out and "file://" in out
    assert report["path"].stat().st_mtime_ns >= before
    assert series_of_page(report["path"].read_text()) == series_of_page(report["page"])


def test_report_of_an_unknown_run_is_one_line(reference_run, capsys):
    from cli.main import main
    assert main(["report", "no-such-run", "--root", reference_run["root"]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown run id 'no-such-run'") and "\n" not in err


def test_closing_summary_lists_evals_versions_and_next_commands(reference_run, capsys, monkeypatch):
    from cli.main import _summary, as_typed
    monkeypatch.setenv("COLUMNS", "300")  # the table on one line per row
    result, root = reference_run["result"], reference_run["root"]
    _summary(result, root)
    out = capsys.readouterr().out
    avg = result["train"]["evals"][4]["copy"]["avg@4"]
    version = result["train"]["versions"][4]
    assert re.search(rf"eval after 4\s.*done\s.*copy avg@4 {avg:.3f} pass@1 ", out), out
    assert re.search(rf"register\s.*{version['name']} version {version['version']} \(ref/rollout_4\) "
                     rf"aliases: best, latest", out), out
    tail = out.strip().splitlines()[-4:]
    grpoflow = as_typed("grpoflow")  # how this shell runs them (tests/test_demo.py runs them as printed)
    assert tail == ["next:", f"  {grpoflow} report ref --root {root}", f"  {grpoflow} models list --root {root}",
                    f"  {as_typed('mlflow')} ui --backend-store-uri {store_uri_for_root(root)}"], tail


def test_report_against_another_run_draws_both_and_carries_the_others_series(prefect_harness, tmp_path, capsys):
    """`grpoflow report B --against A`: A's reward (and eval) series, read from the same MLflow store, drawn dashed
    beside B's and carried on the page under "A/<key>", equal to A's MLflow history; an unknown run is one line."""
    from cli.main import main
    from tests.conftest import SMALL_BATCH
    sets = ["train.num_rollout=2", "checkpoint.interval=2", "eval.interval=null", *SMALL_BATCH,
            f"storage.root={tmp_path}"]
    for run_id, extra in (("a", ["train.lr=0.0"]), ("b", [])):
        assert main(["run", "configs/tiny.yaml", "--run-id", run_id, *sum((["--set", s] for s in sets + extra), [])]) == 0
    capsys.readouterr()
    assert main(["report", "b", "--root", str(tmp_path), "--against", "a"]) == 0
    assert "(beside a)" in capsys.readouterr().out
    page = (tmp_path / "runs" / "b" / REPORT_DIR / INDEX).read_text()
    series = series_of_page(page)
    client = make_client(store_uri_for_root(str(tmp_path)))
    [run_a] = client.search_runs([client.get_experiment_by_name(frozen_config(RunDir(str(tmp_path), "a"))
                                                                .tracking.experiment).experiment_id],
                                 filter_string="tags.`grpoflow.run_id` = 'a'")
    history = sorted(client.get_metric_history(run_a.info.run_id, "reward_mean"), key=lambda m: m.step)
    assert series["a/reward_mean"] == {"steps": [m.step for m in history], "values": [m.value for m in history]}
    # b's own curves beside a's: the same first rollout (same seed and weights), then b's update (a has lr 0)
    assert series["entropy"]["values"][0] == series["a/entropy"]["values"][0]
    assert series["entropy"]["values"][1] != series["a/entropy"]["values"][1]
    assert "dashed beside them those of run <code>a</code>" in page
    assert main(["report", "b", "--root", str(tmp_path), "--against", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown run id 'nope'") and "\n" not in err
