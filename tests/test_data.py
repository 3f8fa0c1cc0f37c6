"""prepare_dataset / read_prepared / PromptDataset and the built-in arithmetic task."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from runtime.inputs import synthetic
from runtime.inputs.datasets import PromptDataset, prepare_dataset, read_prepared
from runtime.errors import ConfigError, DataError

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PREPARED_SCHEMA = {"prompt": "string", "messages": "string", "label": "string", "metadata": "string",
                   "source_row": "int64", "prompt_tokens": "int32"}


@pytest.fixture(scope="module")
def tokenizer():
    """A real HF fast tokenizer (word level, trained here) with a Qwen-style chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["what is 1 + 2 ? user system assistant you are a math tutor find x copy = - 0 3 4 5 6 7 8 9"]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|im_start|>", "<|im_end|>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", chat_template=CHAT_TEMPLATE,
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])


def write_jsonl(path: Path, rows: list, blank_lines_after: int | None = None) -> str:
    lines = [json.dumps(r) if not isinstance(r, str) else r for r in rows]
    if blank_lines_after is not None:
        lines.insert(blank_lines_after + 1, "")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def table_rows(path: str) -> list[dict]:
    return pq.read_table(path).to_pylist()


def chat(*pairs: tuple[str, str]) -> str:
    return "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in pairs) + "<|im_start|>assistant\n"


# -- formats ---------------------------------------------------------------------------------------
def test_slime_jsonl_with_chat_template(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "train.jsonl", [
        {"prompt": "what is 1 + 2 ?", "label": "3", "metadata": {"level": 1}},
        {"prompt": [{"role": "system", "content": "you are a math tutor"}, {"role": "user", "content": "find x"}],
         "label": 7},
    ], blank_lines_after=0)
    out = str(tmp_path / "out" / "train.parquet")
    report = prepare_dataset(src, out, tokenizer=tokenizer, max_prompt_len=64)

    assert report["format"] == "slime" and report["rows_in"] == 2 and report["rows_out"] == 2
    assert report["filtered_too_long"] == 0 and report["path"] == out
    assert report["schema"] == PREPARED_SCHEMA
    json.dumps(report)  # the report goes into the stage marker
    a, b = table_rows(out)
    assert a["prompt"] == chat(("user", "what is 1 + 2 ?"))
    assert json.loads(a["messages"]) == [{"role": "user", "content": "what is 1 + 2 ?"}]
    assert a["label"] == "3" and json.loads(a["metadata"]) == {"level": 1} and a["source_row"] == 0
    assert a["prompt_tokens"] == len(tokenizer(a["prompt"], add_special_tokens=False)["input_ids"])
    assert b["prompt"] == chat(("system", "you are a math tutor"), ("user", "find x"))
    assert b["label"] == "7" and json.loads(b["metadata"]) == {}
    assert b["source_row"] == 2  # 0-based line: the blank line 1 counts


def test_system_prompt_is_prepended_unless_the_row_has_one(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "t.jsonl", [
        {"prompt": "find x", "label": "1"},
        {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "find x"}], "label": "2"},
    ])
    out = str(tmp_path / "o.parquet")
    prepare_dataset(src, out, tokenizer=tokenizer, system_prompt="you are a math tutor")
    a, b = table_rows(out)
    assert a["prompt"] == chat(("system", "you are a math tutor"), ("user", "find x"))
    assert b["prompt"] == chat(("system", "own"), ("user", "find x"))


def test_without_chat_template_the_prompt_is_kept_as_written(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "what is 1 + 2 ?", "label": "3"}])
    out = str(tmp_path / "o.parquet")
    report = prepare_dataset(src, out, tokenizer=None, apply_chat_template=False)
    (row,) = table_rows(out)
    assert row["prompt"] == "what is 1 + 2 ?" and row["prompt_tokens"] is None
    assert report["max_prompt_tokens"] is None
    prepare_dataset(src, out, tokenizer=tokenizer, apply_chat_template=False)
    (row,) = table_rows(out)
    assert row["prompt"] == "what is 1 + 2 ?" and row["prompt_tokens"] == 6  # six words, one token each


def test_tokenizer_without_chat_template_is_a_config_error(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "x", "label": "3"}])
    bare = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, unk_token="[UNK]")
    bare.chat_template = None
    with pytest.raises(ConfigError, match="apply_chat_template=false"):
        prepare_dataset(src, str(tmp_path / "o.parquet"), tokenizer=bare)


def dapo_table(rows: int = 2, drop_truth_at: int | None = None) -> pa.Table:
    """The dapo-math-17k schema: prompt = chat messages, reward_model struct, extra_info struct."""
    records = []
    for i in range(rows):
        reward_model = {"ground_truth": str(10 + i), "style": "rule-lighteval/MATH_v2"}
        if i == drop_truth_at:
            reward_model = {"ground_truth": None, "style": "rule"}
        records.append({
            "data_source": "math_dapo",
            "prompt": [{"content": f"what is {i} + 2 ?", "role": "user"}],
            "ability": "MATH",
            "reward_model": reward_model,
            "extra_info": {"index": f"id-{i}"},
        })
    return pa.Table.from_pylist(records)


def test_dapo_parquet_nested_label_and_metadata(tmp_path, tokenizer):
    src = tmp_path / "dapo.parquet"
    pq.write_table(dapo_table(3), src)
    out = str(tmp_path / "o.parquet")
    report = prepare_dataset(str(src), out, tokenizer=tokenizer)
    assert report["format"] == "dapo" and report["label_key"] == "reward_model.ground_truth"
    rows = table_rows(out)
    assert [r["label"] for r in rows] == ["10", "11", "12"]
    assert [r["source_row"] for r in rows] == [0, 1, 2]
    assert rows[1]["prompt"] == chat(("user", "what is 1 + 2 ?"))
    meta = json.loads(rows[1]["metadata"])
    assert meta["data_source"] == "math_dapo" and meta["ability"] == "MATH"
    assert meta["extra_info"] == {"index": "id-1"} and meta["reward_model.style"] == "rule-lighteval/MATH_v2"


def test_aime_maxwell_jia_schema_and_json_list(tmp_path, tokenizer):
    # Maxwell-Jia/AIME_2024: ID, Problem, Solution, Answer (an integer)
    src = write_jsonl(tmp_path / "aime.jsonl", [
        {"ID": "2024-I-1", "Problem": "find x", "Solution": "x = 204", "Answer": 204},
        {"ID": "2024-I-2", "Problem": "what is 1 + 2 ?", "Solution": "3", "Answer": 25},
    ])
    out = str(tmp_path / "o.parquet")
    report = prepare_dataset(src, out, tokenizer=tokenizer)
    assert report["format"] == "aime" and (report["input_key"], report["label_key"]) == ("Problem", "Answer")
    a, b = table_rows(out)
    assert a["label"] == "204" and b["label"] == "25"
    assert a["prompt"] == chat(("user", "find x"))
    assert json.loads(a["metadata"]) == {"ID": "2024-I-1", "Solution": "x = 204"}

    # lower-case problem/answer in a .json list of objects
    src2 = tmp_path / "aime.json"
    src2.write_text(json.dumps([{"problem": "find x", "answer": "033", "year": 2024}]))
    prepare_dataset(str(src2), out, tokenizer=tokenizer)
    (row,) = table_rows(out)
    assert row["label"] == "033" and json.loads(row["metadata"]) == {"year": 2024}

    # slime's aime-2024 jsonl: prompt/label, read as slime by auto and as aime when asked
    src3 = write_jsonl(tmp_path / "aime-2024.jsonl", [{"prompt": "find x", "label": "204"}])
    assert prepare_dataset(src3, out, tokenizer=tokenizer)["format"] == "slime"
    report = prepare_dataset(src3, out, fmt="aime", tokenizer=tokenizer)
    assert (report["input_key"], report["label_key"]) == ("prompt", "label")
    assert table_rows(out)[0]["label"] == "204"


def test_configurable_and_dotted_keys_and_jsonl_named_json(tmp_path, tokenizer):
    src = tmp_path / "custom.json"  # JSON lines under a .json name, as many hub files are
    src.write_text(json.dumps({"q": "find x", "meta": {"answer": "5"}}) + "\n"
                   + json.dumps({"q": "what is 1 + 2 ?", "meta": {"answer": "3"}}) + "\n")
    out = str(tmp_path / "o.parquet")
    report = prepare_dataset(str(src), out, input_key="q", label_key="meta.answer", tokenizer=tokenizer)
    assert report["rows_out"] == 2
    assert [r["label"] for r in table_rows(out)] == ["5", "3"]


def test_long_prompts_are_filtered_and_counted(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "t.jsonl", [
        {"prompt": "find x", "label": "1"},
        {"prompt": " ".join(["x"] * 50), "label": "2"},
        {"prompt": "what is 1 + 2 ?", "label": "3"},
    ])
    out = str(tmp_path / "o.parquet")
    report = prepare_dataset(src, out, tokenizer=tokenizer, max_prompt_len=20)
    assert (report["rows_in"], report["rows_out"], report["filtered_too_long"]) == (3, 2, 1)
    assert [r["source_row"] for r in table_rows(out)] == [0, 2]
    assert report["max_prompt_tokens"] <= 20

    with pytest.raises(DataError) as err:
        prepare_dataset(src, str(tmp_path / "none.parquet"), tokenizer=tokenizer, max_prompt_len=3)
    assert str(err.value) == (f"{src}: 0 rows left after filtering (3 longer than data.max_prompt_len=3); "
                              f"raise max_prompt_len")
    assert not (tmp_path / "none.parquet").exists()


# -- errors ----------------------------------------------------------------------------------------
def test_missing_file(tmp_path, tokenizer):
    with pytest.raises(DataError) as err:
        prepare_dataset(str(tmp_path / "nope.jsonl"), str(tmp_path / "o.parquet"), tokenizer=tokenizer)
    assert str(err.value) == f"dataset file not found: {tmp_path / 'nope.jsonl'} (check data.train.source)"


def test_malformed_jsonl_line_names_file_and_line(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "label": "1"}, '{"prompt": "b", "label": ', ])
    with pytest.raises(DataError, match=rf"^{src}:2: not valid JSON \("):
        prepare_dataset(src, str(tmp_path / "o.parquet"), tokenizer=tokenizer)


def test_row_without_label_names_the_key_and_field(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "label": "1"}, {"prompt": "b"}])
    with pytest.raises(DataError) as err:
        prepare_dataset(src, str(tmp_path / "o.parquet"), tokenizer=tokenizer, field="data.eval.aime")
    assert str(err.value) == f"{src}:2: row has no 'label' (set data.eval.aime.label_key)"

    first_row = write_jsonl(tmp_path / "f.jsonl", [{"prompt": "b"}, {"prompt": "a", "label": "1"}])
    with pytest.raises(DataError) as err:
        prepare_dataset(first_row, str(tmp_path / "o.parquet"), tokenizer=tokenizer)
    assert str(err.value) == f"{first_row}:1: row has no 'label' (set data.train.label_key)"

    dapo = tmp_path / "dapo.parquet"
    pq.write_table(dapo_table(3, drop_truth_at=2), dapo)
    with pytest.raises(DataError) as err:
        prepare_dataset(str(dapo), str(tmp_path / "o.parquet"), tokenizer=tokenizer)
    assert str(err.value) == f"{dapo}: row 2: 'reward_model.ground_truth' is None; it must be a string or a number"

    no_input = write_jsonl(tmp_path / "q.jsonl", [{"question_text": "a", "label": "1"}])
    with pytest.raises(DataError, match=r":1: row has no 'prompt' \(set data.train.input_key\)$"):
        prepare_dataset(no_input, str(tmp_path / "o.parquet"), fmt="slime", tokenizer=tokenizer)


def test_unknown_and_undetectable_format(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": "a", "target": "1"}])
    with pytest.raises(DataError, match="unknown format 'alpaca'"):
        prepare_dataset(src, str(tmp_path / "o.parquet"), fmt="alpaca", tokenizer=tokenizer)
    with pytest.raises(DataError, match=rf"^{src}:1: cannot tell the dataset format .*set data.train.format"):
        prepare_dataset(src, str(tmp_path / "o.parquet"), tokenizer=tokenizer)
    csv = tmp_path / "t.csv"
    csv.write_text("prompt,label\n")
    with pytest.raises(DataError, match="unsupported file type"):
        prepare_dataset(str(csv), str(tmp_path / "o.parquet"), tokenizer=tokenizer)
    bad_prompt = write_jsonl(tmp_path / "b.jsonl", [{"prompt": [{"role": "user"}], "label": "1"}])
    with pytest.raises(DataError, match=rf"^{bad_prompt}:1: 'prompt' must be a string or a list of"):
        prepare_dataset(bad_prompt, str(tmp_path / "o.parquet"), tokenizer=tokenizer)


def test_failed_prepare_leaves_the_previous_output_untouched(tmp_path, tokenizer):
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "find x", "label": "1"}])
    out = tmp_path / "data" / "train.parquet"
    prepare_dataset(good, str(out), tokenizer=tokenizer)
    before = out.read_bytes()
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "find x", "label": "1"}, "{oops"])
    with pytest.raises(DataError):
        prepare_dataset(bad, str(out), tokenizer=tokenizer)
    with pytest.raises(DataError):
        prepare_dataset(good, str(out), tokenizer=tokenizer, max_prompt_len=1)
    assert out.read_bytes() == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["train.parquet"]  # no temp files left


def test_read_prepared(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "find x", "label": "1", "metadata": {"k": [1, 2]}}])
    out = str(tmp_path / "o.parquet")
    prepare_dataset(src, out, tokenizer=tokenizer)
    (row,) = read_prepared(out)
    assert row["messages"] == [{"role": "user", "content": "find x"}] and row["metadata"] == {"k": [1, 2]}
    assert row["label"] == "1" and row["source_row"] == 0
    with pytest.raises(DataError, match="prepared dataset not found"):
        read_prepared(str(tmp_path / "missing.parquet"))
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "other.parquet")
    with pytest.raises(DataError, match="not a prepared dataset"):
        read_prepared(str(tmp_path / "other.parquet"))


# -- PromptDataset cursor ----------------------------------------------------------------------------
def rows_of(n: int) -> list[dict]:
    return [{"prompt": f"p{i}", "label": str(i % 10), "source_row": i, "metadata": {"k": i}} for i in range(n)]


def test_cursor_is_pure_and_json_able():
    ds = PromptDataset(rows_of(10))
    cursor = PromptDataset.initial_cursor(seed=7)
    a, next_a = ds.batch(cursor, 4)
    b, next_b = PromptDataset(rows_of(10)).batch(json.loads(json.dumps(cursor)), 4)  # fresh object, round-tripped
    assert a == b and next_a == next_b == {"epoch": 0, "position": 4, "seed": 7}
    assert ds.batch(cursor, 4) == (a, next_a)
    a[0]["prompt"] = "mutated"  # callers may mutate rows; the dataset must not change
    a[0]["metadata"]["k"] = "mutated"
    assert ds.batch(cursor, 4)[0][0] == b[0]


def test_epochs_are_permutations_and_cross_deterministically():
    ds = PromptDataset(rows_of(10))
    cursor = PromptDataset.initial_cursor(seed=3)
    stream = []
    for _ in range(5):  # 5 × 7 = 35 rows: epochs 0, 1, 2 and half of 3
        rows, cursor = ds.batch(cursor, 7)
        stream += [r["source_row"] for r in rows]
    assert cursor == {"epoch": 3, "position": 5, "seed": 3}
    epochs = [stream[i:i + 10] for i in range(0, 30, 10)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3  # each epoch reshuffled
    assert epochs[0] == ds.order(3, 0) and epochs[1] == ds.order(3, 1)

    # resuming from a saved mid-epoch cursor gives the same continuation as never stopping
    _, saved = ds.batch(PromptDataset.initial_cursor(seed=3), 14)
    resumed, _ = PromptDataset(rows_of(10)).batch(saved, 21)
    assert [r["source_row"] for r in resumed] == stream[14:35]
    # one batch larger than the dataset spans several epochs
    big, after = ds.batch(PromptDataset.initial_cursor(seed=3), 25)
    assert [r["source_row"] for r in big] == stream[:25] and after == {"epoch": 2, "position": 5, "seed": 3}
    # another seed, another order; no shuffle, identity order
    assert ds.order(4, 0) != ds.order(3, 0)
    assert PromptDataset(rows_of(10), shuffle=False).order(3, 5) == list(range(10))


def test_cursor_that_does_not_fit_the_data():
    ds = PromptDataset(rows_of(4))
    with pytest.raises(DataError, match="does not fit a dataset of 4 rows"):
        ds.batch({"epoch": 0, "position": 9, "seed": 0}, 1)
    with pytest.raises(ValueError, match="bad data cursor"):
        ds.batch({"epoch": 0}, 1)
    with pytest.raises(DataError):
        PromptDataset([])


# -- the built-in arithmetic task --------------------------------------------------------------------
def answer_of(meta: dict) -> int:
    a, b = meta["a"], meta.get("b", 0)
    return {"copy": a, "add": a + b, "sub": a - b}[meta["op"]]


def test_arith_deterministic_correct_single_digit():
    train = synthetic.generate_arith("train")
    assert len(train) == 2000 and train == synthetic.generate_arith("train", 2000, seed=0)
    assert synthetic.generate_arith("train", 50, seed=1) != synthetic.generate_arith("train", 50, seed=0)
    evals = synthetic.generate_arith("eval")
    assert 0 < len(evals) <= 64 and len({r["prompt"] for r in evals}) == len(evals)  # eval never repeats
    for r in train + evals:
        assert set(r) == {"prompt", "label", "metadata"}
        assert len(r["label"]) == 1 and r["label"].isdigit()
        assert int(r["label"]) == answer_of(r["metadata"])
        assert r["prompt"].endswith("= ?") and len(r["prompt"].split()) <= 5
        m = r["metadata"]
        assert r["prompt"] == (f"copy {m['a']} = ?" if m["op"] == "copy"
                               else f"{m['a']} {'+' if m['op'] == 'add' else '-'} {m['b']} = ?")
    assert {r["metadata"]["op"] for r in train} == {"copy", "add", "sub"}
    assert {r["label"] for r in train} == {str(d) for d in range(10)}


def test_arith_labels_are_graded_by_math_verify():
    from math_verify import parse, verify

    for r in synthetic.generate_arith("eval"):
        assert verify(parse(r["label"]), parse(f"\\boxed{{{r['label']}}}"))
        assert verify(parse(r["label"]), parse(r["label"]))


def test_arith_eval_disjoint_from_train_for_any_seed_and_difficulty():
    for difficulty in synthetic.DIFFICULTIES:
        train = {r["prompt"] for s in (0, 1) for r in synthetic.generate_arith("train", 3000, s, difficulty)}
        evals = {r["prompt"] for s in (0, 5) for r in synthetic.generate_arith("eval", 1000, s, difficulty)}
        assert evals and train and not train & evals, difficulty


def test_arith_difficulty_selects_operations():
    assert {r["metadata"]["op"] for r in synthetic.generate_arith("train", 300, difficulty="copy")} == {"copy"}
    assert {r["metadata"]["op"] for r in synthetic.generate_arith("train", 300, difficulty="easy")} == {"copy", "add"}
    assert {r["metadata"]["op"] for r in synthetic.generate_arith("train", 300, difficulty=["sub"])} == {"sub"}
    with pytest.raises(ValueError, match="difficulty"):
        synthetic.generate_arith("train", 3, difficulty="mul")


def test_arith_jsonl_prepares_as_slime(tmp_path, tokenizer):
    path = synthetic.write_arith_jsonl(str(tmp_path / "arith.jsonl"), "train", 20)
    lines = Path(path).read_text().splitlines()
    assert [json.loads(line) for line in lines] == synthetic.generate_arith("train", 20)
    out = str(tmp_path / "arith.parquet")
    report = prepare_dataset(path, out, tokenizer=tokenizer, max_prompt_len=64)
    assert report["format"] == "slime" and report["rows_out"] == 20
    rows = read_prepared(out)
    assert rows[0]["metadata"]["source"] == "builtin://arith"
    assert max(r["prompt_tokens"] for r in rows) < 16  # short enough for a tiny model's context


def test_prepare_and_read_through_fsspec(tmp_path, tokenizer):
    """Any fsspec URI works like a local path (in-memory here; S3 itself is tested elsewhere)."""
    import fsspec

    mem = fsspec.filesystem("memory")
    root = f"memory://grpoflow-data-{tmp_path.name}"
    mem.pipe_file(f"{root}/raw/train.jsonl".removeprefix("memory://"), b'{"prompt": "find x", "label": "4"}\n')
    try:
        report = prepare_dataset(f"{root}/raw/train.jsonl", f"{root}/data/train.parquet", tokenizer=tokenizer)
        assert report["rows_out"] == 1
        (row,) = PromptDataset(f"{root}/data/train.parquet").batch(PromptDataset.initial_cursor(0), 1)[0]
        assert row["label"] == "4" and row["prompt"] == chat(("user", "find x"))
    finally:
        mem.rm(root.removeprefix("memory://"), recursive=True)
