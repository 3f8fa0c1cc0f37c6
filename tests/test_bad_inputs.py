"""Bad input, the table: every case is one in-process CLI call that must end with its exit code, exactly
one stderr line (no traceback), and the storage root exactly as it was — no run directory, no MLflow
store, no half-fetched copy. The root already holds a finished run (a copy of the session's reference
run), so the cases that name it (a second writer, a non-resumable --set) are refused without a change.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from cli.main import main
from runtime.run.directory import RunDir
from runtime.run.lease import RunLease
from tests.conftest import REFERENCE_OVERRIDES

GOOD_ROW = '{"prompt": "copy 3 = ?", "label": "3"}'


def _tree(root: Path) -> dict[str, str]:
    """Every file and directory under root, with the sha256 of each file."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, reference_run) -> dict[str, Path]:
    """Broken files and models, outside the storage root, and a good tiny model to pair them with."""
    d = tmp_path_factory.mktemp("bad-inputs")
    f = {}

    def text(name: str, body: str) -> Path:
        f[name] = d / name
        f[name].write_text(body)
        return f[name]

    text("malformed.jsonl", GOOD_ROW + "\n{oops\n")
    text("nolabel.jsonl", GOOD_ROW + '\n{"prompt": "x"}\n')
    text("empty.jsonl", "")
    text("blank.jsonl", "\n   \n\t\n")
    text("data.csv", "prompt,label\ncopy 3 = ?,3\n")
    text("unknown-format.jsonl", '{"question_text": "x", "solution": "1"}\n')
    (d / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9", "label": "1"}\n'.encode("latin-1"))
    f["latin1.jsonl"] = d / "latin1.jsonl"
    (d / "garbage.parquet").write_bytes(b"PAR1 this is not parquet")
    f["garbage.parquet"] = d / "garbage.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq
    f["columns.parquet"] = d / "columns.parquet"
    pq.write_table(pa.table({"text": ["a"], "answer_id": [1]}), f["columns.parquet"])
    f["zero.parquet"] = d / "zero.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "label": pa.array([], pa.string())}), f["zero.parquet"])

    good_model = Path(RunDir(reference_run["root"], "ref").hf_model)
    f["model"] = d / "model"
    shutil.copytree(good_model, f["model"])
    f["empty-model"] = d / "empty-model"
    f["empty-model"].mkdir()
    f["gpt2"] = d / "gpt2"
    shutil.copytree(good_model, f["gpt2"])
    cfg = json.loads((f["gpt2"] / "config.json").read_text())
    (f["gpt2"] / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    f["truncated"] = d / "truncated"
    shutil.copytree(good_model, f["truncated"])
    st = f["truncated"] / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])

    f["empty.yaml"] = text("empty.yaml", "")
    text("list.yaml", "- model\n- data\n")
    text("syntax.yaml", "model: {source: builtin://tiny-qwen3\n")
    text("unknown-key.yaml", "train: {learning_rate: 1.0}\n")
    text("misspelled.yaml", "trian: {lr: 1.0}\n")
    text("key-twice.yaml", "name: twice\ntrain:\n  lr: 1.0e-4\n  seed: 2\n  lr: 5.0e-4\n")
    text("section-twice.yaml", "train: {lr: 1.0e-4}\nrollout: {temperature: 1.0}\ntrain: {seed: 2}\n")
    f["dir.yaml"] = d / "a-directory"
    f["dir.yaml"].mkdir()
    f["loop"] = d / "loop-a"  # a storage root that is a symbolic-link loop: loop-a -> loop-b -> loop-a
    (d / "loop-b").symlink_to(f["loop"])
    f["loop"].symlink_to(d / "loop-b")
    return f


@pytest.fixture(scope="module")
def root(reference_run, tmp_path_factory) -> Path:
    """A storage root holding a finished run `ref` (a copy of the reference run, MLflow store included)."""
    r = tmp_path_factory.mktemp("bad-root") / "root"
    shutil.copytree(reference_run["root"], r)
    return r


# (case id, argv builder (inputs, root) -> argv, exit code, what the line must say)
def _run(*sets: str, config: str = "configs/tiny.yaml", run_id: str = "bad"):
    def argv(f, root):
        extra = [s.format(**{k.replace(".", "_").replace("-", "_"): v for k, v in f.items()}) for s in sets]
        return ["run", str(f.get(config, config)), "--run-id", run_id, "--set", f"storage.root={root}",
                *sum((["--set", s] for s in extra), [])]
    return argv


def _model(source_key: str):
    return "model.source={" + source_key + "}"


def _data(key: str):
    return "data.train.source={" + key + "}"


LOCAL_MODEL = _model("model")

CASES = [
    # -- config ---------------------------------------------------------------------------------------
    ("wrong-type", _run("train.lr=abc"), 2, "--set train.lr=abc: train.lr: Input should be a valid number"),
    ("negative-size", _run("rollout.rollout_batch_size=-1"), 2, "rollout.rollout_batch_size: Input should be greater than 0"),
    ("zero-size", _run("train.global_batch_size=0"), 2, "train.global_batch_size: Input should be greater than 0"),
    ("golden-rule", _run("train.global_batch_size=64"), 2, "golden rule violated"),
    ("eval-interval", _run("eval.interval=3"), 2, "eval.interval=3 must be a multiple of checkpoint.interval=2"),
    ("unknown-key-yaml", _run(config="unknown-key.yaml"), 2, "unknown-key.yaml: unknown key 'train.learning_rate'"),
    ("unknown-key-set", _run("train.learning_rate=1"), 2, "--set train.learning_rate=1: unknown key 'train.learning_rate'"),
    ("misspelled-section", _run(config="misspelled.yaml"), 2, "unknown key 'trian'"),
    ("yaml-syntax", _run(config="syntax.yaml"), 2, "YAML syntax error"),
    ("empty-file", _run(config="empty.yaml"), 2, "empty.yaml: the file is empty"),
    ("list-top-level", _run(config="list.yaml"), 2, "the top level must be a mapping of sections"),
    ("directory", _run(config="dir.yaml"), 2, "is a directory; give the path of a YAML config file"),
    ("yaml-key-twice", _run(config="key-twice.yaml"), 2, "key-twice.yaml:5: train.lr is given twice (first on line 3)"),
    ("yaml-section-twice", _run(config="section-twice.yaml"), 2,
     "section-twice.yaml:3: train is given twice (first on line 1); merge the two train: sections into one"),
    ("set-syntax", _run("train.lr"), 2, "--set 'train.lr': expected section.key=value"),
    ("set-not-a-section", _run("train.lr.x=1"), 2, "--set train.lr.x: 'lr' is not a section"),
    ("top-p-range", _run("rollout.top_p=1.5"), 2, "--set rollout.top_p=1.5: rollout.top_p: Input should be less than or equal to 1"),
    ("unknown-backend", _run("cluster.backend=slurm"), 2, "cluster.backend: Input should be 'ray' or 'local'"),
    ("fa4-deterministic", _run("train.packed_attention=fa4"), 2,
     "train.packed_attention=fa4 has no deterministic backward and train.deterministic (on by default) needs one: "
     "set train.deterministic=false to train with fa4"),
    ("host-optimizer-fp32", _run("train.optimizer_on_host=true"), 2,
     "train.optimizer_on_host keeps an fp32 master of half-precision weights on the host, but model.dtype: auto"),
    ("unknown-format", _run("data.train.format=xml"), 2, "data.train.format: Input should be"),
    ("scheme-gs-model", _run("model.source=gs://bucket/qwen"), 2, "unsupported scheme 'gs://'"),
    ("scheme-foo-data", _run("data.train.source=foo://x/train.jsonl"), 2, "unsupported scheme 'foo://'"),
    ("scheme-ftp-data", _run("data.train.source=ftp://host/train.jsonl"), 2, "unsupported scheme 'ftp://'"),
    ("scheme-gs-root", _run("storage.root=gs://bucket/runs"), 2, "storage.root: unsupported scheme 'gs://'"),
    # -- a storage root that cannot be written (checked by a probe write, so it holds for root too: chmod
    # does not stop root, a path under a file and sysfs (read-only in containers) do) --------------------
    ("root-under-a-file", _run("storage.root={malformed_jsonl}/root"), 2, "malformed.jsonl is a file, not a directory"),
    ("root-in-sysfs", _run("storage.root=/sys/grpoflow-data"), 2,
     "storage.root /sys/grpoflow-data cannot be written ("),
    ("state-dir-under-a-file", _run("storage.state_dir={malformed_jsonl}/state"), 2,
     "malformed.jsonl/state cannot be written ("),
    ("run-id-escape", _run(run_id="../../escape"), 2, "run id '../../escape': use 1-128 letters"),
    ("run-id-nested", _run(run_id="a/b"), 2, "run id 'a/b'"),
    # -- data (a good local model: the data is checked before the model is fetched) ------------------
    ("jsonl-malformed", _run(LOCAL_MODEL, _data("malformed_jsonl")), 2, "malformed.jsonl:2: not valid JSON"),
    ("jsonl-no-label", _run(LOCAL_MODEL, _data("nolabel_jsonl")), 2, "nolabel.jsonl:2: row has no 'label'"),
    ("jsonl-empty", _run(LOCAL_MODEL, _data("empty_jsonl")), 2, "empty.jsonl: the file has no rows"),
    ("jsonl-whitespace", _run(LOCAL_MODEL, _data("blank_jsonl")), 2, "blank.jsonl: the file has no rows"),
    ("jsonl-not-utf8", _run(LOCAL_MODEL, _data("latin1_jsonl")), 2, "latin1.jsonl: not UTF-8 text"),
    ("jsonl-unknown-fields", _run(LOCAL_MODEL, _data("unknown_format_jsonl")), 2, "cannot tell the dataset format"),
    ("parquet-columns", _run(LOCAL_MODEL, _data("columns_parquet")), 2, "cannot tell the dataset format"),
    ("parquet-zero-rows", _run(LOCAL_MODEL, _data("zero_parquet")), 2, "zero.parquet: the file has no rows"),
    ("parquet-garbage", _run(LOCAL_MODEL, _data("garbage_parquet")), 2, "not a readable parquet file"),
    ("csv", _run(LOCAL_MODEL, _data("data_csv")), 2, "data.train.source must be a .jsonl, .json, .parquet file"),
    ("data-missing", _run(LOCAL_MODEL, "data.train.source=/no/such/train.jsonl"), 2, "dataset file not found: /no/such/train.jsonl"),
    ("builtin-task", _run(LOCAL_MODEL, "data.train.source=builtin://nope/train"), 2, "unknown built-in dataset"),
    ("data-before-model", _run("model.source=hf://no-such-org/no-such-model", _data("malformed_jsonl")), 2,
     "malformed.jsonl:2: not valid JSON"),
    ("rows-too-long", _run(LOCAL_MODEL, "data.max_prompt_len=2"), 2, "0 rows left after filtering"),
    # -- model ------------------------------------------------------------------------------------------
    ("model-empty-dir", _run(_model("empty_model")), 2, "no config.json"),
    ("model-type", _run(_model("gpt2")), 2, "not supported"),
    ("model-truncated", _run(_model("truncated")), 2, "truncated or corrupt"),
    ("model-hf-offline", _run("model.source=hf://no-such-org/no-such-model"), 2, "pre-seed the Hugging Face cache"),
    ("model-missing", _run("model.source=/no/such/model"), 2, "model path does not exist: /no/such/model"),
    ("model-builtin", _run("model.source=builtin://huge-qwen"), 2, "unknown built-in model"),
    # -- CLI --------------------------------------------------------------------------------------------
    ("resume-unknown", lambda f, r: ["resume", "no-such-run", "--root", str(r)], 2, "unknown run id 'no-such-run'"),
    ("resume-bad-id", lambda f, r: ["resume", "../ref", "--root", str(r)], 2, "run id '../ref'"),
    ("resume-bad-set", lambda f, r: ["resume", "ref", "--root", str(r), "--set", "train.lr=abc"], 2,
     "--set train.lr=abc: train.lr: Input should be a valid number"),
    ("resume-finished-not-resumable", lambda f, r: ["resume", "ref", "--root", str(r), "--set", "train.lr=0.1"], 2,
     "already exists with a different train.lr"),
    ("resume-drops-rollouts", lambda f, r: ["resume", "ref", "--root", str(r), "--set", "train.num_rollout=2"], 2,
     "run 'ref' has trained or evaluated past train.num_rollout=2 (checkpoints/rollout_4"),
    ("run-drops-rollouts", _run(*REFERENCE_OVERRIDES, "train.num_rollout=2",
                                run_id="ref"), 2, "a resume never drops rollouts that exist"),
    # -- the machine: a storage root that is a symbolic-link loop ----------------------------------------
    ("root-link-loop", _run("storage.root={loop}"), 2, "is a symbolic link loop"),
    ("runs-root-link-loop", lambda f, r: ["runs", "--root", str(f["loop"])], 2, "is a symbolic link loop"),
    ("models-root-link-loop", lambda f, r: ["models", "list", "--root", str(f["loop"])], 2, "is a symbolic link loop"),
    ("models-show-unknown", lambda f, r: ["models", "show", "no-such-model", "--root", str(r)], 2, "no-such-model"),
]


@pytest.mark.parametrize("argv, code, expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_changes_nothing(prefect_harness, inputs, root, capsys, argv, code, expect):
    args = argv(inputs, root)
    before = _tree(root)
    got = main(args)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert got == code, (args, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert expect in lines[0], lines[0]
    assert "Traceback" not in out + err
    assert _tree(root) == before


@pytest.mark.parametrize("command", ["run", "resume"])
def test_a_prefect_api_that_does_not_answer_is_one_line(prefect_harness, inputs, root, capsys, command):
    """PREFECT_API_URL set to a server that is down: one line saying so (it was Prefect's traceback, exit 1)."""
    import socket

    from prefect.settings import PREFECT_API_URL, temporary_settings
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/api"
    before = _tree(root)
    argv = _run()(inputs, root) if command == "run" else ["resume", "ref", "--root", str(root), "--set",
                                                           "train.num_rollout=6"]
    with temporary_settings(updates={PREFECT_API_URL: dead}):
        code = main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: the Prefect API at {dead} does not answer"), lines
    assert _tree(root) == before


def test_resume_hint_names_the_root_it_was_given(prefect_harness, inputs, root, capsys):
    """`run` with another config on an existing run id: the hint to resume it carries --root."""
    before = _tree(root)
    code = main(["run", "configs/tiny.yaml", "--run-id", "ref", "--set", f"storage.root={root}", "--set", "train.lr=0.1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"grpoflow resume ref --root {root}" in err, err
    assert _tree(root) == before


@pytest.mark.parametrize("command", ["run", "resume"])
def test_second_writer_is_refused_while_the_lease_is_held(prefect_harness, root, capsys, command):
    rd = RunDir(str(root), "ref")
    with RunLease(rd, timeout_s=600, heartbeat_s=600):
        before = _tree(root)
        if command == "run":
            code = main(["run", "configs/tiny.yaml", "--run-id", "ref", "--set", f"storage.root={root}",
                         *sum((["--set", o] for o in _reference_sets()), [])])
        else:
            code = main(["resume", "ref", "--root", str(root)])
        err = capsys.readouterr().err.strip()
        after = _tree(root)
    assert code == 2 and len(err.splitlines()) == 1 and "is being written by pid" in err, err
    assert after == before


def _reference_sets() -> list[str]:
    from tests.conftest import REFERENCE_OVERRIDES
    return REFERENCE_OVERRIDES


def test_a_fetched_copy_follows_its_source(inputs, tmp_path):
    """The fetch stage is keyed on its source's identity (size, mtime): a model fixed in place is fetched
    again on the same run id, not served from the run's earlier (broken) copy."""
    from runtime.config import load_config
    from runtime.run import stages
    model = tmp_path / "model"
    shutil.copytree(inputs["truncated"], model)
    cfg = load_config("configs/tiny.yaml", [f"model.source={model}"])
    rd = RunDir(str(tmp_path / "root"), "fixme")
    first = stages.fetch(cfg, rd)
    broken = (Path(rd.hf_model) / "model.safetensors").read_bytes()
    assert not first["skipped"] and broken == (model / "model.safetensors").read_bytes()
    assert stages.fetch(cfg, rd)["skipped"]  # unchanged source: the copy is reused
    shutil.copyfile(inputs["model"] / "model.safetensors", model / "model.safetensors")  # the user's fix
    again = stages.fetch(cfg, rd)
    assert not again["skipped"]
    assert (Path(rd.hf_model) / "model.safetensors").read_bytes() == (inputs["model"] / "model.safetensors").read_bytes()
