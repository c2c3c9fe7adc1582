"""Example tool-use environment: the policy may call ``calc(<expression>)`` before answering.

A turn containing ``calc(...)`` gets the evaluated result back as feedback (only digits,
+ - * / and parentheses are evaluated, never arbitrary code). A turn with a ``\\boxed{}`` answer
ends the episode with reward 1 if it equals the label. The environment is async, to show that
``reset`` and ``step`` may be coroutines, and is created through an async ``create``.
"""

import ast
import operator
import re

from rlhf.agents import StepResult
from rlhf.agents.builtin_rewards import answers_equal, last_boxed

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    raise ValueError("unsupported expression")


class Environment:
    @classmethod
    async def create(cls, **kwargs):
        return cls(**kwargs)

    def __init__(self, tool_limit: int = 3):
        self.tool_limit = tool_limit
        self.label = None
        self.calls = 0

    async def reset(self, prompt, label):
        self.label = str(label)
        self.calls = 0

    async def step(self, action_text):
        answer = last_boxed(action_text)
        if answer is not None:
            correct = answers_equal(answer, self.label)
            return StepResult(
                reward=float(correct),
                done=True,
                score=float(correct),
                metrics={"tool_calls": self.calls},
            )
        call = re.search(r"calc\(([^()]*(?:\([^()]*\)[^()]*)*)\)", action_text)
        if call is None or self.calls >= self.tool_limit:
            return StepResult(reward=0.0, done=True, score=0.0, metrics={"tool_calls": self.calls})
        self.calls += 1
        try:
            value = _evaluate(ast.parse(call.group(1), mode="eval"))
            feedback = f"calc result: {value}"
        except (SyntaxError, ValueError, ArithmeticError) as exc:
            feedback = f"calc error: {exc}"
        return StepResult(feedback=feedback, reward=0.0, done=False)
