"""HF <-> megatron torch_dist conversion, the tiny model builder and the model registry.

Everything runs in one pytest process: torch.distributed is started once (by the first conversion)
and reused by the others, which is also what the product does in a long-lived worker.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from runtime.errors import ModelError
from runtime.models import get_adapter, load_hf_config
from runtime.models.base import fuse_qkv, normalize_mcore_state_dict, split_qkv
from runtime.models.qwen3 import Qwen3Adapter
from runtime.models.tiny import build_tiny_qwen3

TOL = 1e-4


def _untied_random_norms(path: Path) -> Path:
    """An untied Qwen3 written by HF's own save_pretrained, with norm weights randomised (HF inits
    them to 1, which would hide a swapped norm) and large weights (so attention is far from
    uniform and a wrong q/k/v layout shows)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                      initializer_range=0.15)
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("convert")


@pytest.fixture(scope="module")
def tied(work):
    info = build_tiny_qwen3(work / "tied_hf", seed=0)
    return Path(info["path"]), info


@pytest.fixture(scope="module")
def untied(work):
    return _untied_random_norms(work / "untied_hf")


@pytest.fixture(scope="module")
def converted(work, tied, untied):
    """Both models converted once: name -> (hf_dir, torch_dist_dir, report)."""
    from runtime.mcore.convert import hf_to_torch_dist

    out = {}
    for name, hf_dir in (("tied", tied[0]), ("untied", untied)):
        td = work / f"{name}_torch_dist"
        out[name] = (hf_dir, td, hf_to_torch_dist(hf_dir, td, tolerance=TOL))
    return out


# ---- parity ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tied", "untied"])
def test_conversion_parity_is_reported_and_holds_for_the_saved_checkpoint(converted, name):
    from runtime.mcore.convert import hf_logits, load_torch_dist_into, mcore_logits, probe_batch
    from runtime.mcore.env import build_gpt_model

    hf_dir, td, report = converted[name]
    assert report["max_abs_logit_diff"] <= TOL
    assert report["probe_shape"] == [2, 32] and report["model_type"] == "qwen3"
    assert report["tie_word_embeddings"] == (name == "tied")
    on_disk = json.loads((td / "parity.json").read_text())
    assert on_disk["max_abs_logit_diff"] == report["max_abs_logit_diff"]
    assert on_disk["tolerance"] == TOL

    # Recompute from what was saved: a fresh model loaded from the torch_dist dir against HF.
    cfg = load_hf_config(hf_dir)
    model = build_gpt_model(cfg, init_weights=False).eval()
    load_torch_dist_into(model, td)
    ids = probe_batch(cfg.vocab_size, (2, 32), seed=0)
    ref = hf_logits(hf_dir, ids)
    diff = (mcore_logits(model, ids) - ref).abs().max().item()
    assert diff == pytest.approx(report["max_abs_logit_diff"], abs=1e-7)
    assert ref.abs().max().item() > 100 * TOL  # the logits are not trivially ~0
    # a different probe agrees too
    ids2 = probe_batch(cfg.vocab_size, (1, 48), seed=7)
    assert (mcore_logits(model, ids2) - hf_logits(hf_dir, ids2)).abs().max().item() <= TOL


def _swap_qkv_groups(mcore_state, name):
    w = mcore_state[name]
    groups = list(w.view(2, -1, w.shape[-1]).clone())
    mcore_state[name] = torch.cat([groups[1], groups[0]], dim=0)


def _swap_gate_up(mcore_state, name):
    gate, up = torch.chunk(mcore_state[name], 2, dim=0)
    mcore_state[name] = torch.cat([up, gate], dim=0)


@pytest.mark.parametrize("corrupt,key", [
    (_swap_qkv_groups, "decoder.layers.0.self_attention.linear_qkv.weight"),
    (_swap_gate_up, "decoder.layers.1.mlp.linear_fc1.weight"),
])
def test_a_wrong_mapping_fails_the_parity_check(untied, work, monkeypatch, corrupt, key):
    from runtime.mcore.convert import hf_to_torch_dist

    original = Qwen3Adapter.from_hf

    def wrong_from_hf(self, hf_state_dict, hf_config):
        out = original(self, hf_state_dict, hf_config)
        corrupt(out, key)
        return out

    monkeypatch.setattr(Qwen3Adapter, "from_hf", wrong_from_hf)
    out_dir = work / f"wrong_{corrupt.__name__}"
    with pytest.raises(ModelError, match=r"max \|logit diff\| \d\.\d+e[+-]\d+ > tolerance 0\.0001") as e:
        hf_to_torch_dist(untied, out_dir, tolerance=TOL)
    diff = float(str(e.value).split("max |logit diff| ")[1].split(" ")[0])
    assert diff > 1e-2
    assert not out_dir.exists()  # nothing written for a failed conversion


# ---- export ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tied", "untied"])
def test_export_is_bitwise_equal_to_the_original(converted, work, name):
    from safetensors.torch import load_file

    from runtime.mcore.convert import torch_dist_to_hf

    hf_dir, td, _ = converted[name]
    out = work / f"{name}_export"
    report = torch_dist_to_hf(td, hf_dir, out)
    assert (out / "model.safetensors").read_bytes() == (hf_dir / "model.safetensors").read_bytes()
    exported = load_file(str(out / "model.safetensors"))
    assert ("lm_head.weight" in exported) == (name == "untied")
    assert (out / "config.json").read_bytes() == (hf_dir / "config.json").read_bytes()
    if name == "tied":  # the tiny model has a tokenizer: it travels with the export
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            assert (out / f).read_bytes() == (hf_dir / f).read_bytes()
            assert f in report["files"]
    assert not list(work.glob(f".{name}_export.tmp-*"))


def test_export_loads_in_transformers_and_generates_like_the_original(converted, work):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.mcore.convert import torch_dist_to_hf

    hf_dir, td, _ = converted["tied"]
    out = work / "tied_export_gen"
    torch_dist_to_hf(td, hf_dir, out)
    tok = AutoTokenizer.from_pretrained(out)
    enc = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    outputs = []
    for d in (hf_dir, out):
        model = AutoModelForCausalLM.from_pretrained(d).eval()
        outputs.append(model.generate(**enc, max_new_tokens=6, do_sample=False,
                                      pad_token_id=tok.pad_token_id))
    assert outputs[0].shape[1] > enc["input_ids"].shape[1]
    assert torch.equal(outputs[0], outputs[1])


# ---- tiny builder and tokenizer -------------------------------------------------------------------
def test_tiny_builder_is_deterministic(tied, work):
    hf_dir, info = tied
    again = Path(build_tiny_qwen3(work / "tied_again", seed=0)["path"])
    other = Path(build_tiny_qwen3(work / "seed1", seed=1)["path"])
    names = sorted(p.name for p in hf_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for n in names:
        assert (hf_dir / n).read_bytes() == (again / n).read_bytes(), n
    assert (other / "model.safetensors").read_bytes() != (hf_dir / "model.safetensors").read_bytes()
    assert info["vocab_size"] == json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    assert info["n_params"] > 0


def test_tiny_weights_are_random_with_unit_norms(tied):
    from safetensors.torch import load_file

    sd = load_file(str(tied[0] / "model.safetensors"))
    assert "lm_head.weight" not in sd  # tied
    for name, t in sd.items():
        if "norm" in name:
            assert torch.equal(t, torch.ones_like(t)), name
        else:
            assert t.std().item() == pytest.approx(0.02, rel=0.2), name


def test_bpe_tokenizer_option_is_byte_level(work):
    from transformers import AutoTokenizer
    info = build_tiny_qwen3(work / "bpe_hf", seed=0, tokenizer="bpe")
    tok = AutoTokenizer.from_pretrained(info["path"])
    assert 300 <= len(tok) <= 512
    text = "What is 12 + 345? ünïcode"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_tokenizer_round_trip_digits_and_chat_template(tied):
    from transformers import AutoTokenizer

    hf_dir, info = tied
    tok = AutoTokenizer.from_pretrained(hf_dir)
    # one token per character: a random policy emits a digit often enough for GRPO to start
    assert 40 <= len(tok) <= 128 and len(tok) == info["vocab_size"] and len(tok) % 8 == 0
    assert (tok.pad_token, tok.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    text = "What is 12 + 345? Answer: 357. \\boxed{-8}"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.decode(tok("é")["input_ids"]) == "<unk>"  # outside the alphabet
    digit_ids = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    assert len(set(digit_ids)) == 10
    assert [tok.decode([i]) for i in tok("9876543210")["input_ids"]] == list("9876543210")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    plain = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not plain.endswith("assistant\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids.count(1) == 3 and ids.count(2) == 2  # im_start / im_end are single special tokens


# ---- mapping details (pure, no megatron) ----------------------------------------------------------
def test_qkv_fuse_split_round_trip_and_layout():
    nh, ng, d, h = 4, 2, 3, 5
    q, k, v = torch.randn(nh * d, h), torch.randn(ng * d, h), torch.randn(ng * d, h)
    fused = fuse_qkv(q, k, v, nh, ng, d)
    # group 0 = [q heads 0,1 | k head 0 | v head 0]
    assert torch.equal(fused[: 2 * d], q[: 2 * d])
    assert torch.equal(fused[2 * d: 3 * d], k[:d]) and torch.equal(fused[3 * d: 4 * d], v[:d])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, nh, ng, d), (q, k, v)))
    bq, bk, bv = torch.randn(nh * d), torch.randn(ng * d), torch.randn(ng * d)  # biases (1-D)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fuse_qkv(bq, bk, bv, nh, ng, d), nh, ng, d),
                                                  (bq, bk, bv)))


def test_to_hf_reads_transformer_engine_names(untied):
    from runtime.mcore.convert import load_hf_state_dict

    cfg = load_hf_config(untied)
    adapter = get_adapter(cfg)
    hf = load_hf_state_dict(untied)
    local = adapter.from_hf(hf, cfg)
    te = {}
    for name, t in local.items():
        name = name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
        name = name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        te["module." + name] = t
        te["module." + name.rsplit(".", 1)[0] + "._extra_state"] = None
    assert set(normalize_mcore_state_dict(te)) == set(local)
    back = adapter.to_hf(te, cfg)
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_qwen3_config_mapping(tied):
    cfg = load_hf_config(tied[0])
    adapter = get_adapter(cfg)
    tc = adapter.transformer_config_kwargs(cfg)
    assert (tc["num_query_groups"], tc["kv_channels"], tc["qk_layernorm"], tc["add_qkv_bias"]) == (2, 32, True, False)
    assert tc["layernorm_epsilon"] == 1e-6
    gk = adapter.gpt_model_kwargs(cfg)
    assert gk["rotary_base"] == 1000000.0 and gk["share_embeddings_and_output_weights"] is True
    assert gk["vocab_size"] == cfg.vocab_size and gk["rotary_percent"] == 1.0
    cfg.attention_bias = True  # Qwen3's o_proj bias has no megatron home: refused, not dropped
    with pytest.raises(ModelError, match="attention_bias=true"):
        adapter.transformer_config_kwargs(cfg)


# ---- user mistakes --------------------------------------------------------------------------------
def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_missing_dir_and_dir_without_config(work):
    from runtime.mcore.convert import hf_to_torch_dist

    missing = work / "nope"
    with pytest.raises(ModelError) as e:
        hf_to_torch_dist(missing, work / "out_missing")
    assert _one_line(e) == f"model path does not exist: {missing} (give a local dir, hf://org/name or s3://...)"
    empty = work / "empty_dir"
    empty.mkdir()
    with pytest.raises(ModelError) as e:
        hf_to_torch_dist(empty, work / "out_empty")
    assert _one_line(e) == f"{empty} has no config.json: not a Hugging Face model directory"


def test_unsupported_model_type(work):
    d = work / "gpt2_dir"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ModelError) as e:
        load_hf_config(d)
    msg = _one_line(e)
    assert msg.startswith("model_type 'gpt2' is not supported (supported: ") and "qwen3" in msg
    assert "add a family in runtime/models/" in msg
    with pytest.raises(ModelError, match="model_type 'mistral' is not supported"):
        get_adapter("mistral")


def test_truncated_safetensors(tied, work):
    from runtime.mcore.convert import hf_to_torch_dist

    bad = work / "truncated_hf"
    shutil.copytree(tied[0], bad)
    st = bad / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError) as e:
        hf_to_torch_dist(bad, work / "out_truncated")
    msg = _one_line(e)
    assert msg.startswith(f"{st} is truncated or corrupt (") and msg.endswith("); re-download the model")
    assert not (work / "out_truncated").exists()


def test_export_of_a_missing_checkpoint(tied, work):
    from runtime.mcore.convert import torch_dist_to_hf

    with pytest.raises(ModelError) as e:
        torch_dist_to_hf(work / "no_ckpt", tied[0], work / "out_no_ckpt")
    assert _one_line(e) == f"torch_dist checkpoint does not exist: {work / 'no_ckpt'}"
    with pytest.raises(ModelError, match="is not a torch_dist checkpoint"):
        torch_dist_to_hf(tied[0], tied[0], work / "out_not_ckpt")


def test_a_conversion_leaves_the_parallel_state_as_it_found_it(converted, tied, work, monkeypatch):
    """A conversion in the driver left its CPU state and shims up, and the GPU trainer built there next ran
    on them (found on 2 x H200: the paged engine's compile and CUDA graphs failed on a "cpu" current device).
    None before: none after. A CPU state (a CPU trainer in this process): used and left up. A GPU state:
    the conversion runs in a spawned process (faked here: the state says cuda, and this process's loader
    is broken, which the child does not see)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from runtime.mcore import convert, cpu_job, env
    from runtime.mcore.convert import hf_to_torch_dist, torch_dist_to_hf
    env.destroy_parallel()
    real_current_device = torch.cuda.current_device
    hf_to_torch_dist(tied[0], work / "td_again", tolerance=TOL)
    assert not dist.is_initialized() and torch.cuda.current_device is real_current_device

    env.init_parallel()
    env.init_parallel()  # idempotent
    torch_dist_to_hf(converted["tied"][1], tied[0], work / "hf_beside_a_cpu_state")
    assert env.parallel_device() == "cpu" and mpu.get_tensor_model_parallel_world_size() == 1
    assert torch.cuda.current_device() == "cpu"  # the CPU shim, still up for the CPU trainer
    with env.cuda_to_cpu():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
    with pytest.raises(RuntimeError, match="parallel state is for cpu, not cuda"):
        env.init_parallel(device="cuda")

    monkeypatch.setitem(env._state, "device", "cuda")
    monkeypatch.setattr(convert, "load_torch_dist_into", lambda *a, **k: 1 / 0)
    try:
        workers = []
        for name in ("hf_beside_a_gpu_state", "hf_beside_a_gpu_state_again"):
            report = torch_dist_to_hf(converted["tied"][1], tied[0], work / name)
            assert (work / name / "config.json").is_file() and report["seconds"] >= 0
            workers.append(_spawned_children())
        assert env._state["device"] == "cuda" and dist.is_initialized()  # this process's state untouched
        # one worker, started by the first export and kept for the next (each used to start its own)
        assert len(workers[0]) == 1 and workers[1] == workers[0], workers
    finally:
        cpu_job.shutdown_cpu_worker()
    assert not _spawned_children()


def _spawned_children(pid: int | None = None) -> list:
    """The multiprocessing-spawned descendants of process ``pid`` (this one by default)."""
    import psutil
    return sorted((p for p in psutil.Process(pid).children(recursive=True)
                   if any("spawn_main" in part for part in p.cmdline())), key=lambda p: p.pid)


_DRIVER_WITH_A_CPU_WORKER = """
import sys
from runtime.mcore import env
from runtime.mcore.convert import torch_dist_to_hf
env.init_parallel()
env._state["device"] = "cuda"  # a GPU state, as the local backend's trainer holds it in the driver
torch_dist_to_hf(sys.argv[1], sys.argv[2], sys.argv[3])
print("exported", flush=True)
sys.stdin.read()  # held until the test kills this process
"""


def test_the_cpu_worker_dies_with_a_killed_driver(converted, tied, work):
    """A driver SIGKILLed mid-run (the kill-anywhere tests' driver kill) leaves no export worker behind
    (issue 32's orphans)."""
    import os
    import signal
    import subprocess
    import sys

    import psutil
    root = Path(__file__).resolve().parents[1]
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER_WITH_A_CPU_WORKER, str(converted["tied"][1]),
                               str(tied[0]), str(work / "hf_from_a_killed_driver")], cwd=root, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        assert driver.stdout.readline().strip() == "exported"
        workers = _spawned_children(driver.pid)
        assert len(workers) == 1, workers
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        gone, alive = psutil.wait_procs(workers, timeout=60)  # returns as soon as the worker has exited
        assert not alive, f"the export worker outlived its driver: {alive}"
    finally:
        driver.kill()
        driver.wait()


def test_a_torch_dist_save_leaves_no_process_running(converted):
    """megatron's writer used to keep a spawned Manager process from the first save to the end of the
    process; a trainer actor killed with its Ray node left it running, orphaned (issue 32)."""
    spawned = _spawned_children()
    assert not spawned, [p.cmdline() for p in spawned]


# ---- conversion in the trained dtype --------------------------------------------------------------------
def _stored_dtypes(td: Path) -> set:
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(td)).read_metadata().state_dict_metadata
    return {m.properties.dtype for k, m in meta.items() if getattr(m, "properties", None) is not None}


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_a_bf16_conversion_writes_bf16_and_holds_parity_at_the_bf16_bound(converted, work, name):  # ~15 s
    """What a bf16 run converts to (on the GPU in the product; the same code on the CPU here): bf16 tensors,
    half the bytes of fp32, off HF's fp32 logits by no more than twice HF's own bf16 model is."""
    from runtime.mcore.convert import NOISE_FACTOR, hf_to_torch_dist, torch_dist_to_hf
    from runtime.tracking.model_registry import stored_dtype

    hf_dir, fp32_td, fp32_report = converted[name]
    td = work / f"{name}_bf16_torch_dist"
    report = hf_to_torch_dist(hf_dir, td, tolerance=TOL, dtype="bfloat16", device="cpu")
    assert report["dtype"] == "bfloat16" and report["device"] == "cpu"
    assert _stored_dtypes(td) == {torch.bfloat16} and stored_dtype(td) == torch.bfloat16
    assert _stored_dtypes(fp32_td) == {torch.float32}
    size = lambda d: sum(f.stat().st_size for f in Path(d).glob("*.distcp"))  # noqa: E731
    assert size(td) < 0.55 * size(fp32_td)
    noise = report["reference_noise"]
    assert report["tolerance"] == NOISE_FACTOR * noise + TOL and 0 < noise < 0.05 * report["max_abs_logit"]
    assert TOL < report["max_abs_logit_diff"] <= report["tolerance"]  # bf16 rounding: within the bound, not exact
    assert json.loads((td / "parity.json").read_text())["tolerance"] == report["tolerance"]

    # the host export loads it in fp32: the HF weights come back as the bf16 rounding of the source's
    out = torch_dist_to_hf(td, hf_dir, work / f"{name}_from_bf16", dtype=torch.float32)
    assert out["dtype"] == "float32" and out["device"] == "cpu"
    from runtime.mcore.convert import load_hf_state_dict
    src, back = load_hf_state_dict(hf_dir), load_hf_state_dict(work / f"{name}_from_bf16")
    assert set(back) == set(src)
    for k, v in src.items():
        assert torch.equal(back[k], v.to(torch.bfloat16).float()), k


def test_a_wrong_mapping_fails_the_bf16_parity_check(tied, work, monkeypatch):  # ~5 s
    """The bf16 bound still catches what the fp32 one does: a swapped gate/up on the tiny model moves its logits
    by 0.07, 8x HF's own bf16 error there (a 5 %-of-the-logits bound would have let it through)."""
    from runtime.mcore.convert import hf_to_torch_dist

    original = Qwen3Adapter.from_hf

    def wrong_from_hf(self, hf_state_dict, hf_config):
        out = original(self, hf_state_dict, hf_config)
        _swap_gate_up(out, "decoder.layers.1.mlp.linear_fc1.weight")
        return out

    monkeypatch.setattr(Qwen3Adapter, "from_hf", wrong_from_hf)
    out_dir = work / "wrong_bf16"
    with pytest.raises(ModelError, match=r"\(bfloat16, cpu\) differ from Hugging Face fp32 by max \|logit diff\| "
                                         r"\S+ > tolerance \S+ \(2 x \S+, HF's own bfloat16 error"):
        hf_to_torch_dist(tied[0], out_dir, tolerance=TOL, dtype="bfloat16", device="cpu")
    assert not out_dir.exists()


def test_device_and_dtype_are_checked(tied, work):
    from runtime.mcore.convert import hf_to_torch_dist

    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'auto', not 'gpu'"):
        hf_to_torch_dist(tied[0], work / "never", dtype="bfloat16", device="gpu")
    assert not (work / "never").exists()


def test_auto_keeps_a_small_model_on_the_host(tied, work, monkeypatch):  # ~3 s
    """On a GPU machine "auto" converts a model this small on the host: a GPU process would cost ~20 s to start
    (runtime/mcore/cpu_job.py's GPU_WORTH_BYTES); what a 9B does there is bench/convert_gpu.py's."""
    from runtime.mcore import cpu_job
    from runtime.mcore.convert import hf_to_torch_dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    class NoProcess(cpu_job.concurrent.futures.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            raise AssertionError("a conversion process was started")

    monkeypatch.setattr(cpu_job.concurrent.futures, "ProcessPoolExecutor", NoProcess)
    report = hf_to_torch_dist(tied[0], work / "auto_td", tolerance=TOL, device="auto")
    assert report["device"] == "cpu" and report["dtype"] == "float32"
