"""Conversion (HF -> torch_dist) and export (torch_dist -> HF) of GLM-Z1-9B's shape on the GPU in bf16, as the
product's convert stage and registration run them (issue 57 item 3): seconds, disk, parity.

    python3 bench/convert_gpu.py --out $OUT                 # nvidia-h200 (one GPU, 64 GiB of disk), < 10 min
    python3 bench/convert_gpu.py --cpu                      # CPU smoke: the host path on a 2-layer GLM4 of width 256

A random-init model with GLM-4-9B-0414's config (runtime/models/known_configs; GLM-Z1-9B has the same shape),
built in bf16 on the device and saved as HF safetensors (5 GB shards); then `hf_to_torch_dist(dtype=bfloat16,
device="auto")` (on the GPU, in a process of its own, parity against HF fp32 there) and
`torch_dist_to_hf(device="auto")`. The export must give back the source's bf16 tensors bitwise.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
GLM4_9B = json.loads((ROOT / "runtime" / "models" / "known_configs" / "GLM-4-9B-0414.json").read_text())


def du(path: Path) -> float:
    return round(sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 1e9, 2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/convert_gpu_out")
    ap.add_argument("--work", default="/tmp/convert_gpu_work")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the 9B's 40")
    ap.add_argument("--cpu", action="store_true", help="the host path (bf16 written) on a small GLM4 shape")
    a = ap.parse_args()

    import torch

    import glm4_engine
    from runtime.mcore.convert import hf_to_torch_dist, load_hf_state_dict, torch_dist_to_hf
    from runtime.models.tiny import build_tiny_qwen3

    W, out = Path(a.work), Path(a.out)
    shutil.rmtree(W, ignore_errors=True)
    W.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if a.cpu else "cuda"
    res: dict = {"benchmark": "convert_gpu", "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                 "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}

    t0 = time.time()
    build_tiny_qwen3(W / "tok")  # a tokenizer for the side files
    cfg = dict(GLM4_9B, **({"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
                            "pad_token_id": 0, "eos_token_id": 1}
                           if a.cpu else {}))
    if a.layers:
        cfg["num_hidden_layers"] = a.layers
    model = glm4_engine.build(cfg, device, torch.bfloat16)
    model.config.architectures = ["Glm4ForCausalLM"]
    model.save_pretrained(W / "hf", max_shard_size="5GB")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (W / "tok" / f).exists():
            shutil.copyfile(W / "tok" / f, W / "hf" / f)
    res["params"] = sum(p.numel() for p in model.parameters())
    res["layers"] = cfg["num_hidden_layers"]
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    res["setup_s"] = round(time.time() - t0, 1)
    res["hf_GB"] = du(W / "hf")
    print(json.dumps(res), flush=True)

    t = time.time()
    conv = hf_to_torch_dist(W / "hf", W / "td", dtype="bfloat16", device="cpu" if a.cpu else "auto")
    res["convert"] = {**{k: conv[k] for k in ("device", "dtype", "max_abs_logit_diff", "reference_noise", "tolerance",
                                             "max_abs_logit", "max_abs_logprob_diff", "seconds", "seconds_load",
                                             "seconds_save")},
                      "wall_s": round(time.time() - t, 1), "torch_dist_GB": du(W / "td")}
    print(json.dumps(res["convert"]), flush=True)

    t = time.time()
    exp = torch_dist_to_hf(W / "td", W / "hf", W / "export", device="cpu" if a.cpu else "auto")
    res["export"] = {"device": exp["device"], "dtype": exp["dtype"], "seconds": exp["seconds"],
                     "wall_s": round(time.time() - t, 1), "export_GB": du(W / "export")}
    src, back = load_hf_state_dict(W / "hf"), load_hf_state_dict(W / "export")
    res["export"]["bitwise_equal_to_source"] = set(src) == set(back) and all(torch.equal(src[k], back[k]) for k in src)
    del src, back
    print(json.dumps(res["export"]), flush=True)
    res["model_dir_GB_after"] = {"hf": res["hf_GB"], "torch_dist": res["convert"]["torch_dist_GB"],
                                 "total": round(res["hf_GB"] + res["convert"]["torch_dist_GB"], 2)}
    (out / "convert_gpu.json").write_text(json.dumps(res, indent=2) + "\n")
    shutil.rmtree(W, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
