"""The pipeline end to end through the real Prefect flow and the CLI: run, re-run skips, bad inputs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import main
from runtime.run import checkpoint
from runtime.run.directory import RunDir


def test_reference_run_writes_every_stage(reference_run):
    rd = RunDir(reference_run["root"], "ref")
    res = reference_run["result"]
    assert Path(rd.config).is_file()
    assert (Path(rd.hf_model) / "config.json").is_file()
    parity = json.loads((Path(rd.torch_dist) / "parity.json").read_text())
    assert parity["max_abs_logit_diff"] <= 1e-4
    assert Path(rd.train_data).is_file() and Path(rd.eval_data("copy")).is_file()
    assert res["prepare"]["train"]["rows_out"] > 0
    ck = checkpoint.latest(rd)
    assert ck is not None and ck.rollout == 4
    metrics = [m for c in res["train"]["chunks"] for m in c["metrics"]]
    assert [m["rollout"] for m in metrics] == [0, 1, 2, 3]
    # weight sync: the engine sampled with the trainer's weights (log-probs of the sampled tokens agree)
    assert all(m["train_rollout_logp_absdiff"] <= 1e-4 for m in metrics), [m["train_rollout_logp_absdiff"] for m in metrics]
    for key in ("loss", "reward_mean", "reward_std", "kl", "entropy", "clip_frac", "grad_norm",
                "response_len_mean", "response_len_max", "truncated_frac", "rollout_tok_s", "train_tok_s",
                "step_time_s"):
        assert key in metrics[0], key
    assert res["train"]["actor_builds"] == 1  # actors were reused across the 2 chunks
    pids = {c["trainer_pid"] for c in res["train"]["chunks"]}
    assert len(pids) == 1, pids


def test_rerun_same_run_id_skips_finished_work(reference_run, capsys):
    code = main(["run", "configs/tiny.yaml", "--run-id", "ref", *sum((["--set", o] for o in reference_run["overrides"]), [])])
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("skipped (done before)") >= 3, out
    assert "(2 skipped)" in out  # both train chunks
    assert "model/torch_dist" in out and "train.parquet" in out


def _run(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    err = capsys.readouterr().err.strip()
    return code, err


def _config(tmp_path: Path, body: str) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(body)
    return str(p)


@pytest.mark.parametrize("body, expect", [
    ("model: {source: builtin://tiny-qwen3\n", "YAML syntax error"),
    ("train: {learning_rate: 1}\n", "unknown key 'train.learning_rate'"),
    ("train: {global_batch_size: 32}\n", "golden rule violated"),
    ("eval: {interval: 3}\n", "eval.interval=3 must be a multiple of checkpoint.interval"),
    # a key given twice: YAML loaders keep the last one silently
    ("train:\n  lr: 1.0e-5\n  seed: 2\n  lr: 2.0e-5\n", "c.yaml:4: train.lr is given twice (first on line 2); keep one"),
    ("train: {lr: 1.0e-5}\nmodel: {source: builtin://tiny-qwen3}\ntrain: {seed: 2}\n",
     "c.yaml:3: train is given twice (first on line 1); merge the two train: sections into one"),
])
def test_validate_rejects_bad_configs(tmp_path, capsys, body, expect):
    code, err = _run(["validate", _config(tmp_path, body)], capsys)
    assert code == 2
    assert expect in err and len(err.splitlines()) == 1, err


def test_validate_missing_file(capsys):
    code, err = _run(["validate", "no/such.yaml"], capsys)
    assert code == 2 and "config file not found: no/such.yaml" in err


def test_validate_prints_plan(capsys):
    assert main(["validate", "configs/tiny.yaml"]) == 0
    out = capsys.readouterr().out
    assert "8 × 16 = 128" in out and "3 chunks of 2 rollouts" in out


def _write_jsonl(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _bad_data_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    no_cfg = tmp_path / "no-config"
    no_cfg.mkdir()
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    import torch
    from safetensors.torch import save_file
    save_file({"wte.weight": torch.zeros(4, 4)}, str(gpt2 / "model.safetensors"))
    good = '{"prompt": "1 + 1 = ?", "label": "2"}'
    return [
        (["model.source=/no/such/model"], "model path does not exist: /no/such/model"),
        ([f"model.source={no_cfg}"], "no config.json"),
        ([f"model.source={gpt2}"], "not supported"),
        (["data.train.source=/no/such.jsonl"], "not found"),
        ([f"data.train.source={_write_jsonl(tmp_path / 'bad.jsonl', [good, '{oops'])}"], "bad.jsonl:2"),
        ([f"data.train.source={_write_jsonl(tmp_path / 'nolabel.jsonl', [good, json.dumps({'prompt': 'x'})])}"],
         "nolabel.jsonl:2"),
        ([f"data.train.source={_write_jsonl(tmp_path / 'long.jsonl', [good])}", "data.max_prompt_len=2"],
         "0 rows left after filtering"),
        (["model.source=hf://no-such-org/no-such-model"], "pre-seed"),
    ]


def test_run_bad_inputs_fail_with_one_line(prefect_harness, tmp_path, capsys):
    for i, (overrides, expect) in enumerate(_bad_data_cases(tmp_path)):
        sets = sum((["--set", o] for o in overrides + [f"storage.root={tmp_path / 'root'}"]), [])
        code = main(["run", "configs/tiny.yaml", "--run-id", f"bad{i}", *sets])
        err = capsys.readouterr().err.strip()
        assert code == 2, (overrides, err)
        assert expect in err and len(err.splitlines()) == 1, (overrides, err)
        # nothing of a failed stage is left behind as if it were finished
        assert not (tmp_path / "root" / "runs" / f"bad{i}" / "stages" / "prepare.json").exists()


def test_truncated_safetensors_is_a_clear_error(prefect_harness, tmp_path, capsys):
    from runtime.models.tiny import build_tiny_qwen3
    model = Path(build_tiny_qwen3(tmp_path / "m", seed=0)["path"])
    st = model / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    code = main(["run", "configs/tiny.yaml", "--run-id", "trunc", "--set", f"model.source={model}",
                 "--set", f"storage.root={tmp_path / 'root'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "truncated or corrupt" in err and len(err.splitlines()) == 1, err


def test_a_frozen_config_with_a_key_given_twice_is_one_line_and_left_as_it_is(capsys, tmp_path):
    from runtime.config import dump_config, load_config
    rd = RunDir(str(tmp_path), "dup")
    text = dump_config(load_config("configs/tiny.yaml")) + "train:\n  lr: 0.1\n"  # edited by hand
    Path(rd.config).parent.mkdir(parents=True)
    Path(rd.config).write_text(text)
    line = text.splitlines().index("train:", text.splitlines().index("train:") + 1) + 1
    code, err = _run(["resume", "dup", "--root", str(tmp_path)], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{rd.config}:{line}: train is given twice" in err, err
    assert Path(rd.config).read_text() == text


def test_resume_unknown_run_id(capsys, tmp_path):
    code, err = _run(["resume", "nope", "--root", str(tmp_path)], capsys)
    assert code == 2 and "unknown run id 'nope'" in err


def test_tracking_has_one_point_per_rollout_after_rerun(reference_run):
    # runs after test_rerun_same_run_id_skips_finished_work, which logged the same chunks again
    from mlflow.tracking import MlflowClient
    train = reference_run["result"]["train"]
    client = MlflowClient(train["tracking_uri"])
    for metric in ("reward_mean", "loss", "grad_norm"):
        steps = [m.step for m in client.get_metric_history(train["mlflow_run_id"], metric)]
        assert sorted(steps) == [0, 1, 2, 3], (metric, steps)
    version = train["versions"][4]
    assert version is not None and version["checkpoint"].endswith("rollout_4")
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(version["export_uri"])
    assert model.config.model_type == "qwen3"


def test_validate_prints_a_memory_estimate_for_a_local_model(reference_run, capsys):
    model = RunDir(reference_run["root"], "ref").hf_model
    assert main(["validate", "configs/tiny.yaml", "--set", f"model.source={model}"]) == 0
    out = capsys.readouterr().out
    assert "memory per GPU" in out and "KV cache" in out and "config is valid" in out
    # a config that does not fit is an error: exit 2, one line (its 1 GiB overhead alone exceeds 0.5 GiB)
    assert main(["validate", "configs/tiny.yaml", "--set", f"model.source={model}", "--gpu-mem-gb", "0.5"]) == 2
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out and "config is valid" not in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: configs/tiny.yaml: memory: "), err


def test_validate_the_24gb_recipe_and_the_80gb_one_on_24gb(capsys):
    """hf:// models not fetched: the plan uses the shipped config.json and says so."""
    assert main(["validate", "configs/qwen3-0.6b-dapo-24gb.yaml"]) == 0
    out = capsys.readouterr().out
    assert "of 24 GiB" in out and "assumed: Qwen/Qwen3-0.6B is not fetched yet" in out
    assert "the plan chooses rollout.kv_cache_gb=" in out
    assert main(["validate", "configs/qwen3-0.6b-dapo.yaml", "--gpu-mem-gb", "24"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fits with train.recompute=" in err[0], err
