"""An OpenRLHF 0.11 agent file, run by ``rlhf`` unchanged but for its import line.

OpenRLHF's contract: an ``AgentInstance`` with async ``reset(states)`` / ``step(states)`` and an
``AgentExecutor`` over it. This one plays guess-the-number (the label is the secret); each
step returns a reward, the feedback text, ``done``, a ``scores`` value for filtering, the next
turn's ``sampling_params`` (a lower temperature after the first turn) and ``extra_logs``. Run it
with ``rlhf train grpo --train.agent_func_path examples/openrlhf_agent_guess.py ...``.
"""

import re

import torch

from rlhf.agents.openrlhf import (
    AgentInstanceBase,
    MultiTurnAgentExecutor,
)  # was openrlhf.utils.agent


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.secret, self.guesses = None, 0

    async def reset(self, states: dict, **kwargs):
        self.secret = int(states["label"])
        self.guesses = 0
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.guesses += 1
        found = re.findall(r"-?\d+", states["action_text"])
        right = bool(found) and int(found[-1]) == self.secret
        done = right or self.guesses >= 3
        if right:
            feedback = ""
        elif not found:
            feedback = "\nAnswer with a number: "
        else:
            feedback = "\nToo low: " if int(found[-1]) < self.secret else "\nToo high: "
        params = states["sampling_params"]
        params.temperature = 0.5  # the next turns sample closer to the policy's best guess
        return {
            "rewards": torch.tensor(1.0 if right else 0.0),
            "scores": torch.tensor(1.0 if right else 0.0),
            "environment_feedback": feedback,
            "done": done,
            "sampling_params": params,
            "extra_logs": {"guesses": torch.tensor(float(self.guesses))},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
