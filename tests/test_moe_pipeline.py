"""A tiny Qwen3-MoE through `grpoflow run` on the CPU: fetched from a local dir, converted with logit parity,
trained (the router's load-balancing loss in the live table and MLflow), evaluated, exported with the hub's
per-expert keys and registered."""
from __future__ import annotations

from pathlib import Path

from cli.main import main
from runtime.run.directory import RunDir
from tests.conftest import SMALL_BATCH


def test_a_tiny_qwen3_moe_runs_end_to_end(prefect_harness, tmp_path, capsys):
    import torch
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    from runtime.models.tiny import build_tiny_qwen3
    from runtime.tracking.mlflow_tracker import store_uri_for_root

    model = Path(build_tiny_qwen3(tmp_path / "moe", seed=0, num_experts=4)["path"])
    root = tmp_path / "root"
    sets = ["train.num_rollout=2", "checkpoint.interval=2", "eval.interval=2", "eval.max_prompts=8", *SMALL_BATCH,
            f"model.source={model}", f"storage.root={root}"]
    code = main(["run", "configs/tiny.yaml", "--run-id", "moe", *sum((["--set", s] for s in sets), [])])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    head = next(line.split() for line in out.splitlines() if line.split()[:3] == ["rollout", "elapsed", "eta"])
    assert head[-1] == "aux", head  # the router's loss, a column of its own

    rd = RunDir(str(root), "moe")
    client = MlflowClient(store_uri_for_root(str(root)))
    run_id = client.search_runs([client.get_experiment_by_name("grpoflow").experiment_id])[0].info.run_id
    aux = client.get_metric_history(run_id, "router_aux_loss")
    assert sorted(m.step for m in aux) == [0, 1] and all(1.0 <= m.value <= 2.0 for m in aux)
    (version,) = client.search_model_versions("name = 'tiny'")
    assert version.tags["grpoflow.rollout"] == "2"
    exported = load_file(str(Path(rd.export(2)) / "model.safetensors"))
    source = load_file(str(model / "model.safetensors"))
    assert exported.keys() == source.keys() and "model.layers.1.mlp.experts.3.down_proj.weight" in exported
    assert any(not torch.equal(exported[k], source[k]) for k in source)  # trained
