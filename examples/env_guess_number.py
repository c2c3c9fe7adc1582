"""Example multi-turn environment: guess the number in [lo, hi] with "higher"/"lower" hints.

The label is the secret number. Each turn the policy answers with a number; the environment
replies "Too low.", "Too high." or ends the episode with reward 1 when it is right. A turn
without a number costs -0.1. Load it with
``EnvironmentFactory.from_file("examples/env_guess_number.py")``.
"""

import re

from rlhf.agents import StepResult


class Environment:
    def __init__(self, max_guesses: int = 8):
        self.max_guesses = max_guesses
        self.secret = None
        self.guesses = 0

    def reset(self, prompt, label):
        self.secret = int(label)
        self.guesses = 0

    def step(self, action_text):
        self.guesses += 1
        found = re.findall(r"-?\d+", action_text)
        if not found:
            return StepResult(feedback="Answer with a number.", reward=-0.1, done=False)
        guess = int(found[-1])
        if guess == self.secret:
            return StepResult(reward=1.0, done=True, score=1.0, metrics={"guesses": self.guesses})
        if self.guesses >= self.max_guesses:
            return StepResult(reward=0.0, done=True, score=0.0, metrics={"guesses": self.guesses})
        hint = "Too low." if guess < self.secret else "Too high."
        return StepResult(feedback=hint, reward=0.0, done=False)
