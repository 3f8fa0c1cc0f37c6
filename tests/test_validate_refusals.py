"""Whatever the train stage would refuse, `grpoflow validate` refuses first: exit 2, one line."""
from __future__ import annotations

import pytest

from cli.main import main

NOT_A_FUNCTION = 17

CASES = [
    (["algorithm.entropy_coef=0.01", "train.tensor_parallel=2"], "entropy_coef"),
    (["rollout.n_samples_per_prompt=1", "train.global_batch_size=8", "train.micro_batch_size=8"],
     "n_samples_per_prompt"),
    (["rollout.top_k=0"], "top_k"),
    (["rollout.top_k=-5"], "top_k"),
    (["eval.temperature=-1"], "eval.temperature"),
    (["eval.top_p=1.5"], "eval.top_p"),
    (["eval.max_new_tokens=0"], "eval.max_new_tokens"),
    (["rollout.reward=no_such_reward"], "rollout.reward"),
    (["rollout.reward=no_such_module_xyz:fn"], "rollout.reward"),
    (["rollout.custom_rollout=no_such_module_xyz:fn"], "rollout.custom_rollout"),
    ([f"rollout.custom_rollout={__name__}:NOT_A_FUNCTION"], "rollout.custom_rollout"),
    (["train.lora.enabled=true", "rollout.engine=sglang"], "train.lora"),  # SGLang's adapters: not wired yet
    (["train.lora.enabled=true", "train.optimizer_on_host=true"], "train.optimizer_on_host: false"),  # adapters: on the GPU
    (["rollout.weights_dtype=fp8", "rollout.engine=sglang"], "rollout.weights_dtype"),  # the built-in engine's
    (["rollout.weights_dtype=fp8", "rollout.decode_path=hf"], "rollout.decode_path: auto"),  # the paged decoder's
    # R3: the built-in engine's paged decoder records the routes; a custom rollout's samples carry none
    (["rollout.routing_replay=true", "rollout.engine=sglang"], "rollout.routing_replay"),
    (["rollout.routing_replay=true", "rollout.decode_path=hf"], "rollout.decode_path: auto"),
    (["rollout.routing_replay=true", f"rollout.custom_rollout={__name__}:NOT_A_FUNCTION"], "rollout.routing_replay"),
]


@pytest.mark.parametrize("overrides,field", CASES, ids=[c[1] + "-" + str(i) for i, c in enumerate(CASES)])
def test_validate_refuses_what_training_would(overrides, field, capsys):
    args = ["validate", "configs/tiny.yaml"] + [a for o in overrides for a in ("--set", o)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0], err


# -- numbers outside their domain (issue 62, class 6): no float setting takes inf or nan, each its range ----
def _float_fields(model, prefix: str = "") -> list[str]:
    """Every float setting of the config, by its dotted name (sections walked, dict-valued ones skipped)."""
    import typing

    from pydantic import BaseModel
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        args = typing.get_args(ann) or (ann,)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _float_fields(ann, f"{prefix}{name}.")
        elif float in args:
            out.append(f"{prefix}{name}")
    return out


def test_every_float_setting_refuses_inf_and_nan(capsys):
    """The one mechanism on the base section, checked on every float field the config has (~40): `.inf`,
    `-.inf` and `.nan` each exit 2 with one line naming the field."""
    from runtime.config import GrpoConfig
    fields = _float_fields(GrpoConfig)
    assert {"train.lr", "train.adam_beta1", "rollout.temperature", "algorithm.eps_clip"} <= set(fields)
    for field in fields:
        for value in (".inf", "-.inf", ".nan"):
            assert main(["validate", "configs/tiny.yaml", "--set", f"{field}={value}"]) == 2, (field, value)
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and f"{field}: Input should be a finite number" in err[0], err


DOMAIN_CASES = [
    ("train.adam_beta1=5", "train.adam_beta1: Input should be less than 1"),
    ("train.adam_beta2=1", "train.adam_beta2: Input should be less than 1"),
    ("train.lr=-1e-5", "train.lr: Input should be greater than or equal to 0"),
    ("train.lr=1e39", "train.lr: 1e+39 is past float32's largest value"),
    ("train.min_lr=1", "train.min_lr=1 is above train.lr"),
    ("train.weight_decay=-0.1", "train.weight_decay"),
    ("train.clip_grad=-1", "train.clip_grad"),
    ("algorithm.eps_clip=1.5", "algorithm.eps_clip: Input should be less than 1"),
    ("algorithm.eps_clip_high=-0.1", "algorithm.eps_clip_high"),
    ("algorithm.entropy_coef=-0.01", "algorithm.entropy_coef"),
    ("train.lora.dropout=1", "train.lora.dropout"),
    ("model.parity_tolerance=0", "model.parity_tolerance"),
    ("data.max_prompt_len=0", "data.max_prompt_len"),
    ("eval.interval=0", "eval.interval"),
    ("rollout.temperature=0", "rollout.temperature"),
]


@pytest.mark.parametrize("override,expect", DOMAIN_CASES, ids=[c[0].split("=")[0] for c in DOMAIN_CASES])
def test_numbers_outside_their_domain_are_refused(override, expect, capsys):
    assert main(["validate", "configs/tiny.yaml", "--set", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0], err


# -- prompts and responses past the model's positions (class 7): refused where the model's config is known ----
@pytest.mark.parametrize("overrides,expect", [
    (["data.max_prompt_len=4096"], "data.max_prompt_len + rollout.max_new_tokens = 4096 + 2 = 4098 exceeds the 2048 "
                                   "positions of builtin://tiny-qwen3 (max_position_embeddings); lower "
                                   "data.max_prompt_len to 2046"),
    (["eval.max_new_tokens=2000"], "data.max_prompt_len + eval.max_new_tokens = 64 + 2000 = 2064 exceeds the 2048 "
                                   "positions"),
    (["rollout.max_new_tokens=4096"], "rollout.max_new_tokens=4096 leaves no room for a prompt"),
], ids=["prompt-len", "eval-response", "response-alone"])
def test_validate_refuses_what_exceeds_the_models_positions(overrides, expect, capsys):
    args = ["validate", "configs/tiny.yaml"] + [a for o in overrides for a in ("--set", o)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0], err


# -- error lines are bounded (class 8): an alias bomb, a huge value ------------------------------------------
def _alias_bomb(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\ntrain:\n  lr: *a{levels}\n"


@pytest.mark.parametrize("case", ["bomb", "small-bomb", "recursive", "huge-value", "huge-set"])
def test_error_lines_are_bounded(case, tmp_path, capsys):
    """A 1.5 KB alias bomb gave a 3.9 MB "line": it is refused when read; aliases that do expand, a value of
    megabytes and a recursive alias all end in one line of at most MAX_ERROR_LINE characters naming the file."""
    from runtime.errors import MAX_ERROR_LINE
    path = tmp_path / f"{case}.yaml"
    args = ["validate", str(path)]
    expect = {"bomb": "its aliases expand to more than 100,000 values",
              "small-bomb": "train.lr: Input should be a valid number",
              "recursive": "an alias refers to the node that contains it",
              "huge-value": "train.lr: Input should be a valid number",
              "huge-set": "nests lists or mappings more than 100 deep"}[case]
    path.write_text({"bomb": _alias_bomb(8), "small-bomb": _alias_bomb(3), "recursive": "train: &t\n  x: *t\n",
                     "huge-value": f"train:\n  lr: {'9' * 300_000}x\n", "huge-set": "name: ok\n"}[case])
    if case == "huge-set":
        args += ["--set", "train.lr=" + "[" * 5_000 + "]" * 5_000]
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) <= len("error: ") + MAX_ERROR_LINE, (len(err), err[:500])
    assert expect in lines[0] and (case == "huge-set" or str(path) in lines[0]), lines[0][:500]
