"""Registry retention (tracking.keep_exports) through `grpoflow run`: the registry as MLflow serves it, the
disk, `grpoflow models show` and `grpoflow models export`, and a second registration pass (what a resume
does) that neither re-exports a pruned version nor fails on one whose checkpoint is gone.

The run is of a tiny Qwen3-MoE (one `grpoflow run` proves both): fetched from a local dir, converted with logit
parity, trained with the router's load-balancing loss in the live table and MLflow, and its registered versions
exported with the hub's per-expert keys."""
from __future__ import annotations

from pathlib import Path

import pytest

from runtime.tracking.export_retention import exports_to_keep

pytest.importorskip("mlflow")


def test_exports_to_keep_best_latest_and_the_runs_last_n():  # < 0.1 s
    assert exports_to_keep([1, 2, 3, 4], keep=2, best=1, latest=4) == {1, 3, 4}
    assert exports_to_keep([1, 2, 3, 4], keep=0, best=2, latest=4) == {2, 4}
    # another run registered the model's newest (9): this run still keeps its own newest, 4
    assert exports_to_keep([1, 2, 3, 4], keep=0, best=7, latest=9) == {4, 7, 9}
    assert exports_to_keep([], keep=2, best=None, latest=None) == set()


def test_a_moe_run_keeps_best_latest_and_the_last_n_exports(prefect_harness, tmp_path, capsys):  # ~100 s
    import torch
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    from cli.main import main
    from runtime.grpo.evaluation import load_eval
    from runtime.grpo.registration import register_eval_point
    from runtime.run.directory import RunDir
    from runtime.run.frozen_config import frozen_config
    from runtime.tracking.export_retention import EXPORT_KEPT_TAG, EXPORT_REMOVED_TAG
    from runtime.tracking.mlflow_tracker import Tracker, store_uri_for_root
    from runtime.models.tiny import build_tiny_qwen3
    from runtime.tracking.model_registry import aliases_of, all_versions, export_complete
    from tests.conftest import SMALL_BATCH

    model = Path(build_tiny_qwen3(tmp_path / "moe", seed=0, num_experts=4)["path"])
    root = tmp_path / "root"
    sets = ["train.num_rollout=8", "checkpoint.interval=2", "eval.interval=2", "checkpoint.keep_last=2",
            "tracking.keep_exports=1", *SMALL_BATCH, f"model.source={model}", f"storage.root={root}",
            # as a GPU runs it: bf16 weights (a checkpoint leaves them to their fp32 masters, which megatron's chained
            # optimizers store under their own prefixes), expert parallelism 2, the optimizer on the host, and the
            # engine's experts split over two engines (rollout.expert_shards), one beside each trainer rank
            "model.dtype=bfloat16", "train.expert_parallel=2", "train.data_parallel=2", "cluster.trainer_gpus=2",
            "train.optimizer_on_host=true", "cluster.rollout_gpus=2", "rollout.expert_shards=2"]
    assert main(["run", "configs/tiny.yaml", "--run-id", "keep", *sum((["--set", s] for s in sets), [])]) == 0
    out = capsys.readouterr().out
    head = next(line.split() for line in out.splitlines() if line.split()[:3] == ["rollout", "elapsed", "eta"])
    assert head[-1] == "aux", head  # the router's loss, a column of its own
    rd = RunDir(str(root), "keep")
    uri = store_uri_for_root(str(root))
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    run_id = client.search_runs([client.get_experiment_by_name("grpoflow").experiment_id])[0].info.run_id
    aux = client.get_metric_history(run_id, "router_aux_loss")
    assert sorted(m.step for m in aux) == list(range(8)) and all(1.0 <= m.value <= 2.0 for m in aux)
    gap = client.get_metric_history(run_id, "train_rollout_logp_absdiff")
    # the engines and the trainer agree (0.0005-0.001 a rollout in bf16); two shards that did not add their parts gave
    # 0.005-0.015
    assert len(gap) == 8 and max(m.value for m in gap) < 0.003, [m.value for m in gap]
    # the latest version's export: the hub's per-expert keys, trained
    exported = load_file(str(Path(rd.export(8)) / "model.safetensors"))
    source = load_file(str(model / "model.safetensors"))
    assert exported.keys() == source.keys() and "model.layers.1.mlp.experts.3.down_proj.weight" in exported
    assert any(not torch.equal(exported[k], source[k]) for k in source)

    def versions() -> dict[int, object]:
        return {int(v.version): client.get_model_version("tiny", v.version) for v in all_versions(client, "tiny")}

    before = versions()
    assert {v: mv.tags["grpoflow.rollout"] for v, mv in before.items()} == {1: "2", 2: "4", 3: "6", 4: "8"}
    aliases = aliases_of(client, "tiny")
    # every eval scores 0 on the tiny task at 2 new tokens: ties keep best on the first version
    assert aliases == {"best": 1, "latest": 4}
    kept = {1, 4}  # best; latest, which is also the run's last 1
    for v, mv in before.items():
        rollout = int(mv.tags["grpoflow.rollout"])
        assert export_complete(rd.export(rollout)) == (v in kept), v
        assert Path(rd.sub("exports", f"rollout_{rollout}")).exists() == (v in kept), v
        assert (EXPORT_REMOVED_TAG in mv.tags) == (v not in kept), v
        if v not in kept:
            assert mv.tags[EXPORT_REMOVED_TAG].startswith("by retention (tracking.keep_exports=1) at "), v
        # the version stays whole: its source, metrics and lineage
        assert mv.source == Path(rd.export(rollout)).resolve().as_uri()
        assert mv.tags["grpoflow.run_id"] == "keep" and "grpoflow.metric.eval/copy/avg_at_4" in mv.tags
    # checkpoint.keep_last=2 kept rollouts 6 and 8: version 3 can be exported again, version 2 cannot
    assert sorted(p.name for p in Path(rd.checkpoints).glob("rollout_*")) == ["rollout_6", "rollout_8"]

    assert main(["models", "show", "tiny/3", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "export removed by retention (tracking.keep_exports=1)" in out
    assert f"grpoflow models export tiny/3 --root {root}" in out and "from_pretrained" not in out
    assert main(["models", "show", "tiny/2", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "export removed by retention" in out and "cannot be exported again" in out
    assert "checkpoint.keep_last" in out and "grpoflow models export" not in out
    assert main(["models", "show", "tiny@best", "--root", str(root)]) == 0
    assert f'from_pretrained("{rd.export(2)}")' in capsys.readouterr().out

    # what a resume does: every eval point registered again. Nothing is exported again (version 2's checkpoint
    # is gone: an export would fail), no version is added, the pruned stay pruned.
    cfg = frozen_config(rd)
    tracker = Tracker(cfg, rd)
    for rollout in (2, 4, 6, 8):
        info = register_eval_point(cfg, rd, tracker, rollout, load_eval(rd, rollout))
        assert not info["created"] and info["exports_removed"] == []
    assert sorted(p.name for p in Path(rd.sub("exports")).iterdir()) == ["rollout_2", "rollout_8"]
    assert {v: mv.tags for v, mv in versions().items()} == {v: mv.tags for v, mv in before.items()}

    # `grpoflow models export`: version 3 again from its checkpoint; retention leaves it from then on
    assert main(["models", "export", "tiny/3", "--root", str(root)]) == 0
    assert "exported rollout 6 of run keep" in capsys.readouterr().out
    assert export_complete(rd.export(6))
    v3 = client.get_model_version("tiny", "3")
    assert EXPORT_REMOVED_TAG not in v3.tags and EXPORT_KEPT_TAG in v3.tags
    info = register_eval_point(cfg, rd, tracker, 8, load_eval(rd, 8))
    assert info["exports_removed"] == [] and export_complete(rd.export(6))
    assert main(["models", "show", "tiny/3", "--root", str(root)]) == 0
    assert f'from_pretrained("{rd.export(6)}")' in capsys.readouterr().out
    assert main(["models", "export", "tiny/2", "--root", str(root)]) == 2
    assert "checkpoint" in capsys.readouterr().err and not Path(rd.export(4)).exists()


def _fake_export(rd, rollout: int) -> str:
    out = Path(rd.export(rollout))
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / "grpoflow_export.json").write_text("{}")
    return str(out)


def test_a_run_prunes_only_its_own_and_a_cut_pass_is_finished_by_the_next(tmp_path, monkeypatch):  # ~10 s
    """Versions of another run, and of the same run id under another storage root (its export elsewhere; the
    registry keys a checkpoint by run id and rollout, so this is a later rollout), are left alone; a pass
    stopped between deleting an export and tagging its version (the moment a kill would hit) is finished by
    the next pass, which then tags it."""
    from runtime.config import GrpoConfig
    from runtime.run.directory import RunDir
    from runtime.tracking import export_retention
    from runtime.tracking.export_retention import EXPORT_REMOVED_TAG, prune_exports
    from runtime.tracking.mlflow_tracker import Tracker
    from runtime.tracking.model_registry import register_checkpoint

    store = tmp_path / "store"
    cfg = GrpoConfig.model_validate({"name": "tiny", "storage": {"root": str(store)},
                                     "tracking": {"uri": f"sqlite:///{store / 'mlflow.db'}"}})
    store.mkdir()
    mine, other, twin = RunDir(str(tmp_path / "a"), "r1"), RunDir(str(tmp_path / "a"), "r2"), RunDir(str(tmp_path / "b"), "r1")
    tracker = Tracker(cfg, mine)

    def register(rd, rollout, value):
        return register_checkpoint(tracker, name="shared", export_uri=_fake_export(rd, rollout), rollout=rollout,
                                   run_id=rd.run_id, metrics={"eval/a/avg@4": value}, primary_metric="eval/a/avg@4",
                                   run_root=rd.root)["version"]
    versions = {("other", 2): register(other, 2, 0.1), ("twin", 10): register(twin, 10, 0.1),
                ("mine", 2): register(mine, 2, 0.9), ("mine", 4): register(mine, 4, 0.2),
                ("mine", 6): register(mine, 6, 0.3), ("mine", 8): register(mine, 8, 0.4)}
    assert versions[("mine", 2)] == 3  # best (0.9); latest is mine/8 (6)
    prune = dict(tracking_uri=tracker.uri, name="shared", rd=mine, keep=1, mlflow_run_id=tracker.run_id)

    class Cut(Exception):
        pass

    def cut(name, index=None):
        if name == "retention-export-removed":
            raise Cut(name)
    monkeypatch.setattr(export_retention, "moment", cut)
    with pytest.raises(Cut):
        prune_exports(tracker.client, **prune)
    assert not Path(mine.export(4)).exists()  # deleted, not yet tagged
    assert EXPORT_REMOVED_TAG not in tracker.client.get_model_version("shared", str(versions[("mine", 4)])).tags
    monkeypatch.undo()

    assert prune_exports(tracker.client, **prune) == [versions[("mine", 4)], versions[("mine", 6)]]
    assert prune_exports(tracker.client, **prune) == []
    for (who, rollout), v in versions.items():
        removed = EXPORT_REMOVED_TAG in tracker.client.get_model_version("shared", str(v)).tags
        assert removed == (who == "mine" and rollout in (4, 6)), (who, rollout)
    rd_of = {"mine": mine, "other": other, "twin": twin}
    assert {(w, r) for (w, r) in versions if Path(rd_of[w].export(r)).exists()} == {
        ("other", 2), ("twin", 10), ("mine", 2), ("mine", 8)}
