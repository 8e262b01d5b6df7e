"""The reward: 1 when the last \\boxed{...} of the completion is the answer, else 0."""

import re

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def boxed_answer_reward(prompt, completions, prompt_ids, completion_ids, answer, **_data) -> float:
    found = BOXED.findall(completions)
    return 1.0 if found and found[-1].strip() == str(answer).strip() else 0.0
