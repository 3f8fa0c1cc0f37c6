"""Prompts that with their response exceed the model's positions (issue 62, class 7) are refused at prepare, the
one place every model's config is at hand (validate refuses data.max_prompt_len + max_new_tokens past them where
the model's config is known before the fetch: tests/test_validate_refusals.py). Here the prepare stage itself
runs, as a run whose model was not known at validate (hf://, s3://) reaches it: the line says how many prompts,
the longest, the limit and the fix; prompts that fit are prepared as before."""
from __future__ import annotations

import json

import pytest

from runtime.config import load_config
from runtime.errors import DataError
from runtime.run import stages
from runtime.run.directory import RunDir


def _rows(*repeats: int) -> str:
    # the built-in model's tokenizer reads one token per character: "copy 4 = ? " is 11 tokens
    return "".join(json.dumps({"prompt": "copy 4 = ? " * n, "label": "4"}) + "\n" for n in repeats)


def test_prepare_refuses_prompts_past_the_models_positions(tmp_path):
    data = tmp_path / "long.jsonl"
    data.write_text(_rows(1, 300, 250, 2))  # two prompts of ~3300 and ~2750 tokens; the tiny model has 2048 positions
    cfg = load_config("configs/tiny.yaml", [f"storage.root={tmp_path / 'root'}", f"data.train.source={data}",
                                            "data.max_prompt_len=4096"])
    rd = RunDir(str(tmp_path / "root"), "ctx")
    fetched = stages.fetch(cfg, rd)
    with pytest.raises(DataError) as err:
        stages.prepare(cfg, rd, fetched)
    line = str(err.value)
    assert line.startswith(f"{data}: 2 of 4 prompts with rollout.max_new_tokens=2 exceed the model's 2048 positions "
                           f"(longest prompt "), line
    assert "room for 2046); set data.max_prompt_len: 2046 to leave them out" in line, line
    # the fix it names: the long prompts are left out, the rest prepared
    fixed = load_config("configs/tiny.yaml", [f"storage.root={tmp_path / 'root'}", f"data.train.source={data}",
                                              "data.max_prompt_len=2046"])
    report = stages.prepare(fixed, rd, fetched)
    assert (report["train"]["rows_out"], report["train"]["filtered_too_long"]) == (2, 2)
