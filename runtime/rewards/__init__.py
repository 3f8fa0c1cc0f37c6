"""Rule-based rewards: fn(response, label, metadata=None, *, finish_reason=None) -> float, and bounded-time scoring.

A reward gets the sample's finish reason ("stop", "length", "abort") when it declares a `finish_reason`
parameter (`contract.call_reward`; a user's three-argument reward is called as before). The built-ins
are bounded in time for any caller: through `score_batch` by its deadline, called directly by
`timeout.DIRECT_CALL_TIMEOUT_S` (`timeout.bounded`).

The rule each built-in reward follows (its module says more; `catalog.grader_record` names the
rule's version beside every score that is kept):

`math` (and `is_correct`, which evaluation uses for avg@k / pass@k whatever reward trained):
  format: none required. The final answer is, after the last `</think>`, the later of the last
    \\boxed and the last `Answer:` line, unless a complete "answer is" sentence after it names a value;
    without either, the last "answer is" sentence (not one that supposes: "if the answer is 41, ...");
    without that, a one-line response read whole. A multi-line response that states none of these scores 0.
  several final answers (docs/grading.md): a hedge, two or more distinct answers offered as alternatives
    (`either \\boxed{44} or \\boxed{45}`, `\\boxed{7}, or possibly \\boxed{8}`), states nothing: 0. A
    retraction states what it ends on (`I first wrote \\boxed{42}, but ... the correct answer is 24`
    states 24; `\\boxed{42}, but that is wrong` with nothing after states nothing). A negated answer
    (`Answer: not 42`, `\\boxed{\\neq 42}`) states no value: 0; a contrast after a value is not part of it
    (`42, not 24` states 42). Alternatives inside one answer (`\\boxed{2 \\text{ or } -2}`) are one
    answer, a set, as math-verify reads it. Boxes one after another not offered as alternatives (`case 1
    gives \\boxed{2}, ... in total \\boxed{5}`) are steps: the last one is the answer.
  truncation: an unclosed last box scores 0; no earlier box or number stands in for it. A `<think>`
    never closed states no answer. A sample that ran out of tokens (finish reason "length") states one
    only after a `</think>`, and an `Answer:` line, "answer is" sentence or one-line response that runs
    to the cut states none (the model was still writing it); a complete box, line or sentence before
    the cut stands. Without a finish reason (a direct call) a text that ends mid-sentence counts as cut
    ("... the number of such pairs is 46, and the" states nothing); one that ends with an end-of-turn
    marker (`<|im_end|>`, `</s>`) was ended by the model, and the marker is not part of the answer.
  leniency: the answer's text is read as LaTeX, the way a box is (`Answer: 2^{10}` is 1024), after
    `answers.clean_answer` drops `$` delimiters, `\\$`, `\\text{}`, units (unit words, symbols after a
    number and a space or a slash: `45 km/h`, `9.8 m/s^2`, and any `\\text{}`/`\\mathrm{}` after a number:
    `12\\,\\text{m}^2`), degree (`^\\circ`, `°`) and percent signs (a percent sign is a unit: `300\\%`
    states 300), thousands separators (`1{,}000`, `1\\,000`, `1,\\!000`) and a space-form box's punctuation
    (`\\boxed 7.`), and writes a repeating decimal as its fraction (`0.\\overline{3}` is 1/3) and
    e-notation as a power of ten (`1e3` is 1000, not Euler's e); math-verify decides equality (1/2 = 0.5 =
    \\tfrac12, \\sqrt{50} = 5\\sqrt{2}, x = 3 states 3).

`dapo` (+1 / -1):
  format: only the last `Answer:` line within the last 300 characters counts.
  truncation: an unclosed box on that line scores -1; so does a line inside a `<think>` never closed,
    or one that runs to the cut (as in `math`).
  leniency: canonical strings (cleaned as above, as DAPO's reference drops `\\$` and unit words)
    equal, or else math-verify equality as in `math`.

`deepscaler` (1 / 0):
  format: only the last box after `</think>` counts; `<think>` never closed scores 0.
  truncation: an unclosed last box scores 0; so does a sample that ran out of tokens without `</think>`.
  leniency: as `math`.
"""

from runtime.rewards.dapo import dapo_reward
from runtime.rewards.deepscaler import deepscaler_reward
from runtime.rewards.math_reward import is_correct, math_reward
from runtime.rewards.catalog import BUILTIN_REWARDS, get_reward_fn, grader_record
from runtime.rewards.timeout import reward_fail_value, score_batch, shutdown_pool

__all__ = [
    "BUILTIN_REWARDS",
    "dapo_reward",
    "deepscaler_reward",
    "get_reward_fn",
    "grader_record",
    "is_correct",
    "math_reward",
    "reward_fail_value",
    "score_batch",
    "shutdown_pool",
]
