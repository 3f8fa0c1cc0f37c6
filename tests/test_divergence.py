"""A run whose training diverges (issue 62, class 6): a learning rate the config accepts (finite, within float32)
but far too large turns the weights or the loss non-finite; the run stops at that rollout with one line naming
it, the quantity and the fix, exit 2, before any checkpoint is written or any version registered."""
from __future__ import annotations

from cli.main import main
from tests.conftest import SMALL_BATCH


def test_a_diverging_run_stops_before_a_checkpoint_or_a_version(prefect_harness, capsys, tmp_path):
    from mlflow.tracking import MlflowClient

    from runtime.tracking.mlflow_tracker import store_uri_for_root
    root = tmp_path / "root"
    # SMALL_BATCH's entropy bonus gives every update a gradient, which Adam turns into steps of about lr
    sets = [f"storage.root={root}", "train.lr=1e30", "train.num_rollout=2", "checkpoint.interval=2",
            "eval.interval=null", *SMALL_BATCH]
    code = main(["run", "configs/tiny.yaml", "--run-id", "diverge", *sum((["--set", s] for s in sets), [])])
    out, err = capsys.readouterr()
    # (MLflow logs two INFO lines when it creates its store: not ours to judge here)
    lines = [line for line in err.strip().splitlines() if "mlflow.store.db.utils" not in line]
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("error: rollout ") and "training diverged: " in lines[0], lines[0]
    assert lines[0].endswith("(train.lr=1e+30); the run stopped before anything of it was saved or registered; "
                             "lower train.lr and start a new run"), lines[0]
    assert not list(root.glob("runs/*/checkpoints/*"))
    store = root / "mlflow.db"
    if store.exists():
        client = MlflowClient(store_uri_for_root(str(root)))
        assert not client.search_model_versions()
