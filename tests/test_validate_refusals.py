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
]


@pytest.mark.parametrize("overrides,field", CASES, ids=[c[1] + "-" + str(i) for i, c in enumerate(CASES)])
def test_validate_refuses_what_training_would(overrides, field, capsys):
    args = ["validate", "configs/tiny.yaml"] + [a for o in overrides for a in ("--set", o)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0], err
