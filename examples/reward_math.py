"""Example reward file: 1.0 for a correct \\boxed{} answer plus 0.1 for the format.

Use with ``FunctionReward.from_file("examples/reward_math.py")`` (or ``--reward.func_path`` in
the CLI). Rows need a ``label`` holding the reference answer.
"""

from rlhf.agents.builtin_rewards import boxed_format, math_answer


def reward_func(queries, prompts, labels, **kwargs):
    correct = math_answer(queries, prompts, labels, **kwargs)
    fmt = boxed_format(queries, prompts, labels, **kwargs)
    rewards = [c + 0.1 * f for c, f in zip(correct["rewards"], fmt, strict=True)]
    return {
        "rewards": rewards,
        "scores": correct["rewards"],
        "extra_logs": {"format": fmt, **correct["extra_logs"]},
    }
