"""The plan's disk term (issue 57 item 4, runtime/plan/disk.py): the run directory's peak bytes by term, `grpoflow
validate`'s disk row and its one-line refusal, the run refused before it writes anything, and the plan against what
the reference run left on disk."""
from __future__ import annotations

from pathlib import Path

import pytest

from cli.main import main
from runtime.config import load_config
from runtime.plan import disk
from runtime.plan.memory import param_counts
from runtime.plan.summary import known_config

ROOT = Path(__file__).resolve().parents[1]
GLM = ROOT / "configs/glm-z1-9b-dapo.yaml"
QWEN = "configs/qwen3-0.6b-dapo.yaml"


def test_the_disk_terms_of_the_seed_config_add_up_byte_for_byte():
    """GLM-Z1-9B's shape: the HF weights and the converted model 2 B a parameter (bf16), 4 checkpoints of 12 B
    (keep_last 3 + the one being written), and of the seed's 150 eval points the 4 exports the default retention
    keeps (best, latest, the last 2, the new one among them)."""
    glm = known_config("zai-org/GLM-Z1-9B-0414")
    n, _ = param_counts(glm)
    cfg = load_config(GLM)
    d = disk.disk_terms(cfg, glm, device="cuda")
    b = d["bytes"]
    assert d["registered_n"] == 150 and cfg.tracking.keep_exports == 2 and d["exports_n"] == 4
    assert b["hf_model"] == b["converted"] == 2 * n
    assert b["checkpoints"] == 4 * 12 * n and d["checkpoints_n"] == 4
    assert b["exports"] == 4 * 2 * n
    assert b["files"] == (2 + 4 + 4) * disk.FILES_BYTES + 5 * glm.vocab_size * disk.TOKENIZER_BYTES_PER_TOKEN
    assert b["total"] == sum(v for k, v in b.items() if k != "total")
    # every export kept (keep_exports: null): all 150 at once
    assert disk.disk_terms(load_config(GLM, ["tracking.keep_exports=null"]), glm, device="cuda")["exports_n"] == 150
    # no more checkpoints than chunks; no exports without tracking
    few = disk.disk_terms(load_config(GLM, ["train.num_rollout=40", "checkpoint.interval=20",
                                            "tracking.enabled=false"]), glm, device="cuda")
    assert few["checkpoints_n"] == 2 and few["exports_n"] == 0 and few["bytes"]["exports"] == 0


def test_checkpoint_and_export_counts():
    assert disk.checkpoint_bytes_per_param(2) == 12  # fp32 master + Adam m, v: the bf16 weights left to the master
    assert disk.checkpoint_bytes_per_param(4) == 12  # fp32 weights are their own master
    assert [disk.exports_at_peak(150, k) for k in (None, 0, 1, 2, 5)] == [150, 3, 3, 4, 7]
    assert disk.exports_at_peak(1, 2) == 1


def test_a_lora_checkpoint_holds_the_adapters_and_their_optimizer_only():
    from runtime.plan import lora_memory
    from runtime.plan.shape import model_shape
    glm = known_config("zai-org/GLM-Z1-9B-0414")
    cfg = load_config(ROOT / "configs/glm-z1-9b-dapo-lora-32gb.yaml")
    adapters, _ = lora_memory.adapter_params(model_shape(glm), lora_memory.config_lora(cfg), 1)
    d = disk.disk_terms(cfg, glm, device="cuda")
    assert d["checkpoint_bytes"] == 12 * adapters and d["lora"]
    assert d["export_bytes"] == 2 * (param_counts(glm)[0] + adapters)  # the merged model and the adapter


def test_validate_prints_the_disk_row_and_refuses_a_disk_too_small_in_one_line(capsys):
    code = main(["validate", QWEN, "--set", "storage.disk_gb=20"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "disk of the run directory at its peak:" in out and "of 20.0 GiB (storage.disk_gb): DOES NOT FIT" in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert "disk: the run directory needs 33.4 GiB" in line and "storage.disk_gb allows 20.0 GiB" in line
    for fix in ("checkpoint.keep_last", "tracking.keep_exports", "a larger disk for storage.root", "s3://"):
        assert fix in line, (fix, line)
    # what the line names is enough
    code = main(["validate", QWEN, "--set", "storage.disk_gb=22", "--set", "checkpoint.keep_last=1", "--set",
                 "tracking.keep_exports=0"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "of 22.0 GiB (storage.disk_gb): fits" in out


def test_validate_measures_this_machine_and_leaves_the_refusal_to_the_run(tmp_path, capsys):
    """The seed config needs more than this machine's disk: validate says so on the disk row, exits 0 (it checks a
    config for any machine), and names where it measured."""
    code = main(["validate", str(GLM), "--set", f"storage.root={tmp_path / 'not-yet'}"])
    out = capsys.readouterr().out
    assert code == 0
    row = next(line for line in out.splitlines() if line.strip().startswith("total") and "free at" in line)
    assert f"(free at {tmp_path / 'not-yet'} on this machine; the run checks where it starts)" in row
    assert row.split()[1] == "525.34"


def test_an_s3_root_counts_its_local_mirrors_where_state_dir_is(tmp_path, capsys):
    """Under an s3:// root the writers build each checkpoint (and export) in a local mirror under storage.state_dir
    and keep it: the disk row is checked there, with the same bytes."""
    state = tmp_path / "state"
    cfg = load_config(ROOT / QWEN, ["storage.root=s3://bucket/prefix", f"storage.state_dir={state}"])
    assert disk.local_dir(cfg) == str(state / "scratch")
    code = main(["validate", QWEN, "--set", "storage.root=s3://bucket/prefix", "--set", f"storage.state_dir={state}"])
    out = capsys.readouterr().out
    assert code == 0 and f"(free at {state / 'scratch'} on this machine" in out
    assert "33.36 GiB" in out  # as a local root's


def test_run_on_a_disk_too_small_is_refused_before_anything_is_written(prefect_harness, tiny_checkpoint, tmp_path,
                                                                       capsys):
    hf, _ = tiny_checkpoint
    root = tmp_path / "root"
    code = main(["run", "configs/tiny.yaml", "--run-id", "small", "--set", f"model.source={hf}", "--set",
                 f"storage.root={root}", "--set", "storage.disk_gb=0.001"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: disk: the run directory needs") and "storage.disk_gb allows 0.0 GiB" in lines[0]
    assert not (root / "runs").exists()


def test_the_plan_is_within_ten_percent_of_what_the_reference_run_left_on_disk(reference_run):
    from runtime.models import load_hf_config
    from tests.conftest import REFERENCE_OVERRIDES
    run_dir = Path(reference_run["root"]) / "runs" / reference_run["run_id"]
    cfg = load_config(ROOT / "configs/tiny.yaml", REFERENCE_OVERRIDES)
    planned = disk.disk_terms(cfg, load_hf_config(run_dir / "model" / "hf"), device="cpu")
    measured = disk.used_bytes(str(run_dir))
    assert planned["checkpoints_n"] == 2 and planned["exports_n"] == 1  # 2 chunks, the final eval's export
    assert planned["bytes"]["total"] == pytest.approx(measured, rel=0.10), (planned["bytes"], measured)
