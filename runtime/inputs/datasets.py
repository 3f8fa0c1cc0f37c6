"""Prompt datasets: prepare (any supported input → one prepared parquet) and read (a resumable cursor).

Inputs: slime jsonl (``prompt`` string or chat messages, ``label``, optional ``metadata``), the DAPO
parquet (``prompt`` chat messages, label at ``reward_model.ground_truth``), aime-style files
(``problem``/``Problem``/``question`` or ``prompt``; ``answer``/``Answer`` or ``label``), as .jsonl,
.json (a list of objects) or .parquet, local or on S3.

The prepared parquet has one row per kept prompt:
  prompt         the text the policy sees (after the chat template when one is applied)
  messages       JSON string of the chat messages the prompt was rendered from
  label          the ground truth as a string
  metadata       JSON string (the row's metadata; for DAPO/aime the other fields of the row)
  source_row     0-based row of the input (for jsonl: the 0-based line, so line = source_row + 1)
  prompt_tokens  length of ``prompt`` in tokens (null when prepared without a tokenizer)
"""
from __future__ import annotations

import copy
import io
import json
import random
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from runtime import storage
from runtime.errors import ConfigError, DataError

FORMATS = ("auto", "slime", "dapo", "aime")
EXTENSIONS = (".jsonl", ".json", ".parquet")
# aime-style files spell their fields in several ways (Maxwell-Jia/AIME_2024: Problem/Answer/ID;
# others problem/answer, question/answer; slime's aime-2024 jsonl: prompt/label). First present wins.
AIME_INPUT_KEYS = ("problem", "Problem", "question", "Question", "prompt")
AIME_LABEL_KEYS = ("answer", "Answer", "label", "ground_truth")
DAPO_LABEL_KEY = "reward_model.ground_truth"
DAPO_METADATA_KEYS = ("data_source", "ability", "extra_info")
PREPARED_COLUMNS = ("prompt", "messages", "label", "metadata", "source_row", "prompt_tokens")


# -- reading inputs -------------------------------------------------------------------------------
def _extension(uri: str) -> str:
    name = str(uri).rsplit("/", 1)[-1].lower()
    for ext in EXTENSIONS:
        if name.endswith(ext):
            return ext
    return ""


def _where(path: str, ext: str, index: int) -> str:
    """How an error names one row: file:line for jsonl, the 0-based row/item otherwise."""
    if ext == ".jsonl":
        return f"{path}:{index + 1}"
    return f"{path}: {'item' if ext == '.json' else 'row'} {index}"


def _read_rows(path: str, field: str) -> tuple[str, list[tuple[int, dict]]]:
    """(extension, [(source_row, row)]) of an input file; every problem is a one-line DataError."""
    if not storage.exists(path):
        raise DataError(f"dataset file not found: {path} (check {field}.source)")
    ext = _extension(path)
    if ext == ".parquet":
        try:
            fs, fs_path = storage.fs_for(path)
            with fs.open(fs_path, "rb") as f:
                table = pq.read_table(f)
        except Exception as err:  # pyarrow raises ArrowInvalid & co. for a broken file
            raise DataError(f"{path}: not a readable parquet file ({err})") from None
        rows = list(enumerate(table.to_pylist()))
    elif ext in (".jsonl", ".json"):
        try:
            text = storage.read_text(path)
        except UnicodeDecodeError as err:
            raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
        rows = _parse_json_text(path, ext, text)
    else:
        raise DataError(f"{path}: unsupported file type (give a {', '.join(EXTENSIONS)} file)")
    for index, row in rows:
        if not isinstance(row, dict):
            raise DataError(f"{_where(path, ext, index)}: expected a JSON object, got {type(row).__name__}")
    return ext, rows


def _parse_json_text(path: str, ext: str, text: str) -> list[tuple[int, Any]]:
    if ext == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            # Many "*.json" dataset files are JSON lines; read them as such when the first line is an object.
            first = text.lstrip().split("\n", 1)[0]
            if err.msg == "Extra data" and first.startswith("{"):
                return _parse_json_text(path, ".jsonl", text)
            raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno})") from None
        if isinstance(data, dict):  # {"data": [...]} and similar single-list wrappers
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) != 1:
                raise DataError(f"{path}: expected a JSON list of objects (or a .jsonl file)")
            data = lists[0]
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
        return list(enumerate(data))
    rows = []
    for lineno, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            rows.append((lineno, json.loads(line)))
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{lineno + 1}: not valid JSON ({err.msg}, column {err.colno})") from None
    return rows


_MISSING = object()


def _get(row: dict, key: str) -> Any:
    """``row[key]``; a dotted key walks nested objects (``reward_model.ground_truth``)."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if isinstance(node, str) and node.lstrip().startswith("{"):
            try:
                node = json.loads(node)  # nested fields stored as JSON strings
            except json.JSONDecodeError:
                return _MISSING
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


# -- formats --------------------------------------------------------------------------------------
def detect_format(row: dict) -> str | None:
    if _get(row, DAPO_LABEL_KEY) is not _MISSING:
        return "dapo"
    if "prompt" in row and "label" in row:
        return "slime"
    if any(k in row for k in AIME_INPUT_KEYS) and any(k in row for k in AIME_LABEL_KEYS):
        return "aime"
    if "prompt" in row:
        return "slime"  # a slime row that lacks its label: reported as such below, not as "unknown format"
    return None


def _resolve_keys(fmt: str, first: dict, input_key: str | None, label_key: str | None) -> tuple[str, str]:
    if fmt == "slime":
        return input_key or "prompt", label_key or "label"
    if fmt == "dapo":
        return input_key or "prompt", label_key or DAPO_LABEL_KEY
    # aime: the first spelling the file uses (a missing one is then reported on the first row)
    if input_key is None:
        input_key = next((k for k in AIME_INPUT_KEYS if k in first), AIME_INPUT_KEYS[0])
    if label_key is None:
        label_key = next((k for k in AIME_LABEL_KEYS if k in first), AIME_LABEL_KEYS[0])
    return input_key, label_key


def _metadata(fmt: str, row: dict, input_key: str, label_key: str, metadata_key: str | None) -> dict:
    meta: dict = {}
    own = _get(row, metadata_key) if metadata_key else _MISSING
    if isinstance(own, str):
        try:
            own = json.loads(own)
        except json.JSONDecodeError:
            own = {"value": own}
    if isinstance(own, dict):
        meta.update(own)
    elif own is not _MISSING and own is not None:
        meta[metadata_key] = own
    top_label = label_key.split(".", 1)[0]
    if fmt == "dapo":
        meta.update({k: row[k] for k in DAPO_METADATA_KEYS if k in row})
        reward_model = row.get("reward_model")
        if isinstance(reward_model, dict):
            meta.update({f"reward_model.{k}": v for k, v in reward_model.items() if k != "ground_truth"})
    elif fmt == "aime":  # small files; keep every other field (ID, Solution, year, url, ...)
        meta.update({k: v for k, v in row.items() if k not in (input_key, top_label, metadata_key)})
    return meta


def _label_text(value: Any, where: str, label_key: str) -> str:
    if isinstance(value, bool) or value is None:
        raise DataError(f"{where}: '{label_key}' is {value!r}; it must be a string or a number")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: '{label_key}' is empty")
        return value.strip()
    raise DataError(f"{where}: '{label_key}' is a {type(value).__name__}; it must be a string or a number")


def _messages(value: Any, where: str, input_key: str, system_prompt: str | None) -> list[dict]:
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: '{input_key}' is empty")
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list) and value:
        messages = []
        for m in value:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: '{input_key}' must be a string or a list of "
                                f"{{\"role\": str, \"content\": str}} messages")
            messages.append({"role": m["role"], "content": m["content"]})
    else:
        raise DataError(f"{where}: '{input_key}' must be a string or a non-empty list of chat messages")
    # A system message already in the data wins over data.system_prompt.
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _render(messages: list[dict], tokenizer, apply_chat_template: bool) -> str:
    if apply_chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # No template: the contents in order (a string prompt without a system prompt stays as it is).
    return "\n\n".join(m["content"] for m in messages)


# -- check (no tokenizer: cheap, before the model is fetched) -------------------------------------
def check_dataset(source_file_uri: str, *, fmt: str = "auto", input_key: str | None = None,
                  label_key: str | None = None, metadata_key: str | None = "metadata",
                  system_prompt: str | None = None, field: str = "data.train") -> dict:
    """Read and check every row of one input file (format, keys, prompt and label of each row); every
    problem is a one-line DataError. Returns ``{format, input_key, label_key, rows, records}``."""
    path = str(source_file_uri)
    if fmt not in FORMATS:
        raise DataError(f"{path}: unknown format {fmt!r} (set {field}.format to one of {', '.join(FORMATS)})")
    ext, rows = _read_rows(path, field)
    if not rows:
        raise DataError(f"{path}: the file has no rows (check {field}.source)")

    first_index, first = rows[0]
    if fmt == "auto":
        fmt = detect_format(first) or ""
        if not fmt and input_key and label_key:
            fmt = "slime"  # explicit keys: read the fields as given
        if not fmt:
            raise DataError(f"{_where(path, ext, first_index)}: cannot tell the dataset format from the fields "
                            f"{sorted(first)}; set {field}.format (slime, dapo, aime) or "
                            f"{field}.input_key and {field}.label_key")
    input_key, label_key = _resolve_keys(fmt, first, input_key, label_key)

    records = []
    for index, row in rows:
        where = _where(path, ext, index)
        raw_prompt = _get(row, input_key)
        if raw_prompt is _MISSING:
            raise DataError(f"{where}: row has no '{input_key}' (set {field}.input_key)")
        raw_label = _get(row, label_key)
        if raw_label is _MISSING:
            raise DataError(f"{where}: row has no '{label_key}' (set {field}.label_key)")
        records.append({
            "messages": _messages(raw_prompt, where, input_key, system_prompt),
            "label": _label_text(raw_label, where, label_key),
            "metadata": json.dumps(_metadata(fmt, row, input_key, label_key, metadata_key),
                                   ensure_ascii=False, sort_keys=True, default=str),
            "source_row": index,
        })
    return {"format": fmt, "input_key": input_key, "label_key": label_key, "rows": rows, "records": records}


# -- prepare --------------------------------------------------------------------------------------
def prepare_dataset(source_file_uri: str, out_parquet_uri: str, *, fmt: str = "auto", input_key: str | None = None,
                    label_key: str | None = None, metadata_key: str | None = "metadata", tokenizer=None,
                    apply_chat_template: bool = True, system_prompt: str | None = None,
                    max_prompt_len: int = 1024, field: str = "data.train", max_new_tokens: int | None = None,
                    max_positions: int | None = None, response_key: str = "rollout.max_new_tokens") -> dict:
    """Turn one input file into the prepared parquet; returns a JSON-able report.

    ``field`` is the config section the dataset came from (``data.train``, ``data.eval.<name>``); the
    error messages name it so the user knows what to change. With ``max_positions`` (the model's) a kept prompt
    that leaves fewer than ``max_new_tokens`` (set by ``response_key``) of them is refused. Everything is validated before the
    output is written (atomically), so a failed prepare never replaces a good earlier output.
    """
    path = str(source_file_uri)
    if apply_chat_template and tokenizer is None:
        raise ValueError("apply_chat_template=True needs a tokenizer")
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the model's tokenizer has no chat template; set data.apply_chat_template=false "
                          "(prompts are then used as written) or use a model with one")
    checked = check_dataset(path, fmt=fmt, input_key=input_key, label_key=label_key, metadata_key=metadata_key,
                            system_prompt=system_prompt, field=field)
    fmt, input_key, label_key, rows = checked["format"], checked["input_key"], checked["label_key"], checked["rows"]
    prepared = [{"prompt": _render(r["messages"], tokenizer, apply_chat_template),
                 **{k: v for k, v in r.items() if k != "messages"},
                 "messages": json.dumps(r["messages"], ensure_ascii=False)} for r in checked["records"]]

    too_long = 0
    if tokenizer is not None:
        # The rendered prompt already carries the template's special tokens: count without adding more.
        ids = tokenizer([r["prompt"] for r in prepared], add_special_tokens=False)["input_ids"]
        for r, toks in zip(prepared, ids):
            r["prompt_tokens"] = len(toks)
        kept = [r for r in prepared if r["prompt_tokens"] <= max_prompt_len]
        too_long = len(prepared) - len(kept)
    else:
        kept = [{**r, "prompt_tokens": None} for r in prepared]
    if not kept:
        raise DataError(f"{path}: 0 rows left after filtering ({too_long} longer than "
                        f"data.max_prompt_len={max_prompt_len}); raise max_prompt_len")
    if tokenizer is not None and max_new_tokens is not None:
        from runtime.inputs.context import check_prompts_fit
        check_prompts_fit(path, [r["prompt_tokens"] for r in kept], max_new_tokens=max_new_tokens,
                          positions=max_positions, response_key=response_key)

    table = _prepared_table(kept)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    storage.write_bytes_atomic(str(out_parquet_uri), buf.getvalue())
    return {"path": str(out_parquet_uri), "source": path, "format": fmt, "input_key": input_key,
            "label_key": label_key, "rows_in": len(rows), "rows_out": len(kept), "filtered_too_long": too_long,
            "max_prompt_tokens": max((r["prompt_tokens"] or 0) for r in kept) if tokenizer is not None else None,
            "schema": {f.name: str(f.type) for f in table.schema}}


def _prepared_table(rows: list[dict]) -> pa.Table:
    schema = pa.schema([("prompt", pa.string()), ("messages", pa.string()), ("label", pa.string()),
                        ("metadata", pa.string()), ("source_row", pa.int64()), ("prompt_tokens", pa.int32())])
    return pa.Table.from_pylist(rows, schema=schema)


def read_prepared(parquet_uri: str) -> list[dict]:
    """Rows of a prepared parquet, with ``messages`` and ``metadata`` decoded from JSON."""
    uri = str(parquet_uri)
    if not storage.exists(uri):
        raise DataError(f"prepared dataset not found: {uri} (run the prepare stage first)")
    fs, path = storage.fs_for(uri)
    with fs.open(path, "rb") as f:
        table = pq.read_table(f)
    missing = [c for c in PREPARED_COLUMNS if c not in table.column_names]
    if missing:
        raise DataError(f"{uri}: not a prepared dataset (missing columns {', '.join(missing)}); re-run prepare")
    rows = table.to_pylist()
    for r in rows:
        r["messages"] = json.loads(r["messages"])
        r["metadata"] = json.loads(r["metadata"])
    return rows


# -- the resumable cursor -------------------------------------------------------------------------
class PromptDataset:
    """Prompts in a deterministic order per epoch, read through a small JSON-able cursor.

    A cursor is ``{"epoch": e, "position": p, "seed": s}``. Epoch e visits every row once, in a
    permutation seeded by (s, e) alone; ``batch`` is pure — the same cursor always gives the same rows
    and the same next cursor — so a checkpoint that stores the cursor resumes the exact data stream.
    """

    def __init__(self, source: str | list[dict], *, shuffle: bool = True):
        """``source``: the URI of a prepared parquet, or its rows (as ``read_prepared`` returns them)."""
        rows = read_prepared(source) if isinstance(source, str) else list(source)
        if not rows:
            raise DataError("prompt dataset is empty; check the prepare stage's report")
        self.rows = rows
        self.shuffle = shuffle
        self._orders: dict[tuple[int, int], list[int]] = {}

    def __len__(self) -> int:
        return len(self.rows)

    @staticmethod
    def initial_cursor(seed: int) -> dict:
        return {"epoch": 0, "position": 0, "seed": int(seed)}

    def order(self, seed: int, epoch: int) -> list[int]:
        """Row indices in the order of one epoch."""
        key = (seed, epoch)
        if key not in self._orders:
            order = list(range(len(self.rows)))
            if self.shuffle:
                # A string seed is hashed by sha512 inside random.seed: stable across Python versions.
                random.Random(f"grpoflow-epoch:{seed}:{epoch}").shuffle(order)
            if len(self._orders) > 8:
                self._orders.clear()
            self._orders[key] = order
        return self._orders[key]

    def batch(self, cursor: dict, n: int) -> tuple[list[dict], dict]:
        """The next ``n`` rows after ``cursor`` (crossing epochs as needed) and the cursor after them."""
        epoch, position, seed = _check_cursor(cursor, len(self.rows))
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        out = []
        while len(out) < n:
            order = self.order(seed, epoch)
            take = min(n - len(out), len(order) - position)
            out.extend(copy.deepcopy(self.rows[i]) for i in order[position:position + take])
            position += take
            if position == len(order):
                epoch, position = epoch + 1, 0
        return out, {"epoch": epoch, "position": position, "seed": seed}


def _check_cursor(cursor: dict, size: int) -> tuple[int, int, int]:
    try:
        epoch, position, seed = int(cursor["epoch"]), int(cursor["position"]), int(cursor["seed"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"bad data cursor {cursor!r}: expected {{'epoch': int, 'position': int, 'seed': int}}") from None
    if epoch < 0 or not 0 <= position < size:
        raise DataError(f"data cursor {cursor} does not fit a dataset of {size} rows; the prepared data "
                        f"changed since the checkpoint was written (re-prepare it as it was, or start a new run)")
    return epoch, position, seed

