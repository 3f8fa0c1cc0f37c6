"""Every shipped config passes `grpoflow validate` (GPU, host and its disk), and the 4-GPU GLM-Z1-9B configs for the
lent machines (issue 57 item 6) and Qwen3-30B-A3B's (issue 60 item 5) say what they need: GPU and host fit, the disk
row names the storage they assume, and the lent machine's 235 GiB disk is refused in one line that says why and what
would do."""
from __future__ import annotations

from pathlib import Path

import pytest

from cli.main import main
from runtime.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
H200 = "configs/glm-z1-9b-dapo-4xh200.yaml"
H100 = "configs/glm-z1-9b-dapo-4x80gb.yaml"
QWEN_MOE = "configs/qwen3-30b-a3b-dapo-4xh200.yaml"


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_validates(name, capsys):
    code = main(["validate", f"configs/{name}"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "config is valid" in out


def _validate(capsys, *args) -> tuple[int, str, list[str]]:
    code = main(["validate", *args])
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def _row(out: str, section: str, name: str) -> str:
    rows = out[out.index(section):].splitlines()
    return next(r for r in rows[1:] if r.strip().startswith(name))


@pytest.mark.parametrize("config, gpu, host", [(H200, "of 139.8 GiB", "of 512 GiB"), (H100, "of 79.2 GiB", "of 512 GiB")])
def test_the_4_gpu_configs_fit_gpu_host_and_the_disk_they_assume(config, gpu, host, capsys):
    code, out, err = _validate(capsys, config)
    assert code == 0, err
    assert gpu in _row(out, "memory per GPU", "total") and _row(out, "memory per GPU", "total").endswith("fits")
    assert host in _row(out, "host memory per node", "total") and "fits" in _row(out, "host memory per node", "total")
    disk = _row(out, "disk of the run directory", "total")
    assert "(storage.disk_gb): fits" in disk
    checkpoints = _row(out, "disk of the run directory", "checkpoints")
    assert "2 x 105.06 GiB: keep_last 1 + the one being written" in checkpoints  # 12 B x 9.4 B parameters
    assert "3 x 17.51 GiB of 150 eval points" in _row(out, "disk of the run directory", "exports")
    cfg, seed = load_config(ROOT / config), load_config(ROOT / "configs/glm-z1-9b-dapo.yaml")
    # the seed's run, laid out for 4 GPUs and a disk: only layout, memory placement and retention differ
    assert (cfg.rollout, cfg.data, cfg.algorithm, cfg.eval) == (seed.rollout, seed.data, seed.algorithm, seed.eval)
    assert cfg.train.optimizer_on_host == (config == H100)


def test_the_lent_machines_235_gib_disk_is_refused_with_the_storage_it_needs(capsys):
    code, _, err = _validate(capsys, H200, "--set", "storage.disk_gb=235")
    assert code == 2 and len(err) == 1, err
    line = err[0]
    assert "disk: the run directory needs 297.7 GiB of disk at its peak but storage.disk_gb allows 235.0 GiB" in line
    assert "cannot hold one durable checkpoint while the next is written beside the models (245.1 GiB)" in line
    assert "a larger disk for storage.root" in line and "s3://" in line


def test_the_qwen3_30b_a3b_config_fits_gpu_and_host_and_names_its_experts_terms(capsys):
    code, out, err = _validate(capsys, QWEN_MOE)
    assert code == 0, err
    gpu = _row(out, "memory per GPU", "total")
    assert "of 139.8 GiB" in gpu and gpu.endswith("fits")
    assert "of 512 GiB" in _row(out, "host memory per node", "total") and "fits" in _row(out, "host memory per node", "total")
    assert "128 of 128 experts per EP rank" in _row(out, "mixture of experts", "experts' weights")
    assert "host" in _row(out, "mixture of experts", "experts' optimizer")
    for term in ("router weights", "router acts", "dispatcher", "experts' acts", "engine experts"):
        gib = _row(out, "mixture of experts", term).split()[len(term.split())]  # the GiB after the term's name
        assert float(gib) > 0, term
    assert "(storage.disk_gb): fits" in _row(out, "disk of the run directory", "total")
    assert "2 x 341.22 GiB: keep_last 1 + the one being written; 12 B per parameter" in \
        _row(out, "disk of the run directory", "checkpoints")  # 12 B x 30.5 B parameters
    cfg, seed = load_config(ROOT / QWEN_MOE), load_config(ROOT / "configs/glm-z1-9b-dapo.yaml")
    # the dapo-math recipe and its AIME eval, on another model
    assert (cfg.rollout, cfg.data, cfg.algorithm, cfg.eval) == (seed.rollout, seed.data, seed.algorithm, seed.eval)
    assert cfg.model.source == "hf://Qwen/Qwen3-30B-A3B"


def test_the_lent_machines_disk_cannot_hold_one_qwen3_30b_a3b_checkpoint(capsys):
    code, _, err = _validate(capsys, QWEN_MOE, "--set", "storage.disk_gb=235")
    assert code == 2 and len(err) == 1, err
    line = err[0]
    assert "storage.disk_gb allows 235.0 GiB" in line
    assert "cannot hold even one checkpoint (341.2 GiB: 12 B x 30.53B parameters) beside the models (113.7 GiB)" in line
    assert "a larger disk for storage.root" in line and "a depth-truncated shape" in line
    assert "train.lora" not in line  # the trainer refuses LoRA on a mixture of experts
