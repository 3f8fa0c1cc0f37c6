"""The data stages of a run — fetch, convert, prepare — as plain functions over the run directory.

Each stage writes its outputs, then a marker ``stages/<stage>.json`` holding the hash of its inputs.
A stage whose marker matches its inputs is finished: it returns the recorded result without work.
The run directory, not any orchestrator's memory, says what is done.
"""
from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Callable

from runtime import storage
from runtime.config import GrpoConfig
from runtime.run.directory import RunDir
from runtime.testing.moments import moment


def inputs_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def finished(rd: RunDir, stage: str, inputs: Any) -> dict | None:
    marker = rd.stage_marker(stage)
    if not storage.exists(marker):
        return None
    record = storage.read_json(marker)
    if record.get("inputs_hash") != inputs_hash(inputs):
        return None
    return record["result"]


def run_stage(rd: RunDir, stage: str, inputs: Any, work: Callable[[], dict]) -> dict:
    """Run ``work`` unless the stage already finished with these inputs; returns its result with ``skipped``."""
    done = finished(rd, stage, inputs)
    if done is not None:
        return {**done, "skipped": True}
    t0 = time.time()
    result = work()
    result = {**result, "seconds": round(time.time() - t0, 2)}
    moment(f"{stage}-work-done")  # outputs written, marker not yet
    storage.write_json_atomic(rd.stage_marker(stage), {"stage": stage, "inputs_hash": inputs_hash(inputs),
                                                        "inputs": inputs, "result": result})
    return {**result, "skipped": False}


def fetch_inputs(cfg: GrpoConfig) -> dict:
    """What the fetched copies depend on: each source and its identity (size and mtime of a local
    file, the object listing of an s3:// prefix), so a source fixed in place is fetched again."""
    from runtime.inputs.fetch import source_identity
    d = cfg.data
    out = {"model": cfg.model.source, "builtin_seed": cfg.model.builtin_seed,
           "train": d.train.source, "eval": {k: v.source for k, v in d.eval.items()}}
    ids = {"model": source_identity(cfg.model.source, model=True), "train": source_identity(d.train.source),
           **{f"eval.{k}": source_identity(v.source) for k, v in d.eval.items()}}
    ids = {k: v for k, v in ids.items() if v is not None}
    if ids:  # built-in and hf:// sources: the source string (with its @revision) is the identity
        out["identity"] = ids
    return out


def fetch(cfg: GrpoConfig, rd: RunDir) -> dict:
    from runtime.inputs.datasets import check_dataset
    from runtime.inputs.fetch import fetch_dataset, fetch_model
    from runtime.errors import DataError

    def fetch_checked(spec, name: str, field: str) -> str:
        path = fetch_dataset(spec.source, rd.sub("data", "raw"), name, split=spec.split)
        try:
            check_dataset(path, fmt=spec.format, input_key=spec.input_key, label_key=spec.label_key,
                          metadata_key=spec.metadata_key, field=field)
        except DataError as err:
            raise DataError(str(err).replace(str(path), spec.source)) from None  # the user's file, not our copy
        return str(path)

    def work() -> dict:
        # The datasets first: they are small, and a broken row should not wait for a model download.
        train = fetch_checked(cfg.data.train, "train", "data.train")
        evals = {name: fetch_checked(spec, f"eval-{name}", f"data.eval.{name}") for name, spec in cfg.data.eval.items()}
        moment("fetch-datasets-done")
        model = fetch_model(cfg.model.source, rd.hf_model, builtin_seed=cfg.model.builtin_seed)
        from runtime.models import get_adapter, load_hf_config
        get_adapter(load_hf_config(rd.local(rd.hf_model)))  # an unsupported family is refused before prepare
        return {"model_dir": rd.hf_model, "model": model, "train_file": train, "eval_files": evals}

    return run_stage(rd, "fetch", fetch_inputs(cfg), work)


def convert_dtype(cfg: GrpoConfig) -> str:
    """The dtype the converted model is written in: the one the trainer loads it in (model.dtype)."""
    from runtime.devices import resolve_device, resolve_dtype
    return resolve_dtype(cfg, resolve_device(cfg))


def convert_inputs(cfg: GrpoConfig) -> dict:
    return {"fetch": fetch_inputs(cfg), "tolerance": cfg.model.parity_tolerance, "dtype": convert_dtype(cfg)}


def prepare_inputs(cfg: GrpoConfig) -> dict:
    return {"fetch": fetch_inputs(cfg), "data": cfg.data.model_dump(mode="json")}


def convert(cfg: GrpoConfig, rd: RunDir, fetched: dict) -> dict:
    from runtime.mcore.convert import hf_to_torch_dist

    inputs = convert_inputs(cfg)

    def work() -> dict:
        # A remote run dir: convert into the local scratch, then upload (metadata.json last).
        with storage.output_dir(rd.torch_dist, rd.state_dir, last=["metadata.json"]) as out:
            # On the GPU where this machine has one (in a process of its own, before any actor holds it).
            report = hf_to_torch_dist(rd.local(rd.hf_model), out, tolerance=cfg.model.parity_tolerance,
                                      dtype=convert_dtype(cfg), device="auto")
            moment("convert-written")
        return {"torch_dist": rd.torch_dist, "parity": {**report, "path": rd.torch_dist, "source": rd.hf_model}}

    return run_stage(rd, "convert", inputs, work)


def prepare(cfg: GrpoConfig, rd: RunDir, fetched: dict) -> dict:
    from transformers import AutoTokenizer

    from runtime.inputs.datasets import prepare_dataset
    from runtime.errors import DataError

    d = cfg.data
    inputs = prepare_inputs(cfg)

    def work() -> dict:
        from runtime.inputs.context import longest_response, positions_of
        from runtime.models import load_hf_config
        tokenizer = AutoTokenizer.from_pretrained(rd.local(rd.hf_model))
        common = dict(tokenizer=tokenizer, apply_chat_template=d.apply_chat_template,
                      system_prompt=d.system_prompt, max_prompt_len=d.max_prompt_len,
                      max_positions=positions_of(load_hf_config(rd.local(rd.hf_model))))

        def one(spec, src: str, out: str, field: str) -> dict:
            evals = field.startswith("data.eval") and cfg.eval.max_new_tokens is not None
            try:
                return prepare_dataset(src, out, fmt=spec.format, input_key=spec.input_key, label_key=spec.label_key,
                                       metadata_key=spec.metadata_key, field=field,
                                       max_new_tokens=longest_response(cfg, field),
                                       response_key="eval.max_new_tokens" if evals else "rollout.max_new_tokens",
                                       **common)
            except DataError as err:
                # Name the user's file, not our fetched copy of it.
                raise DataError(str(err).replace(str(src), spec.source)) from None

        train = one(d.train, fetched["train_file"], rd.train_data, "data.train")
        moment("prepare-train-done")
        evals = {name: one(spec, fetched["eval_files"][name], rd.eval_data(name), f"data.eval.{name}")
                 for name, spec in d.eval.items()}
        return {"train": train, "eval": evals}

    return run_stage(rd, "prepare", inputs, work)
