"""Built-in reward functions with the ``reward_func(queries, prompts, labels, **kwargs)`` signature.

- `exact_match`: 1.0 when the response, stripped, equals the label.
- `math_answer`: extracts the last ``\\boxed{...}`` of the response (brace-matched) and compares it
  with the label: equal after normalisation, or symbolically equal (sympy) for answers parsed
  by a whitelisting `ast` walker — never evaluated as Python. Anything else scores 0.
- `boxed_format`: 1.0 when the response contains exactly one ``\\boxed{...}`` answer.

Each uses its ``responses`` keyword (the decoded completions alone, which the executors pass)
and falls back to the query with the prompt removed.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sympy

_SAFE_EXPR = re.compile(r"^[0-9a-z+\-*/^().,\s]*$")
_LATEX_REPLACEMENTS = (
    (r"\left", ""),
    (r"\right", ""),
    (r"\!", ""),
    (r"\,", ""),
    (r"\dfrac", r"\frac"),
    (r"\tfrac", r"\frac"),
    (r"\cdot", "*"),
    (r"\times", "*"),
    (r"\pi", "pi"),
    ("$", ""),
)


def _responses(
    queries: Sequence[str], prompts: Sequence[str], responses: Iterable[object] | None
) -> list[str]:
    if responses is not None:
        return [str(r) for r in responses]
    return [q[len(p) :] if q.startswith(p) else q for q, p in zip(queries, prompts, strict=True)]


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def normalize_answer(answer: str) -> str:
    """Canonical text form of a short math answer (spacing, LaTeX sizing, trailing period)."""
    out = answer.strip()
    for old, new in _LATEX_REPLACEMENTS:
        out = out.replace(old, new)
    out = re.sub(r"\\text\{([^{}]*)\}", r"\1", out)
    out = re.sub(r"\s+", "", out).rstrip(".")
    return out


MAX_ANSWER_CHARS = 200
MAX_EXPONENT = 64
_NAMES = {"pi", "e"}


def _to_python_source(answer: str) -> str | None:
    text = normalize_answer(answer)
    if len(text) > MAX_ANSWER_CHARS:
        return None
    for _ in range(5):  # nested \frac / \sqrt
        text = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", text)
        text = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", text)
    text = text.replace("^", "**").replace("{", "(").replace("}", ")")
    return text if _SAFE_EXPR.match(text.replace("**", "^")) else None


def _to_sympy(node: ast.AST) -> sympy.Expr:
    """Build a sympy expression from a whitelisted AST; nothing is ever evaluated as Python.

    Allowed: int/float literals, single-letter symbols, pi and e, + - * / and ** with an
    integer exponent of at most 64 in magnitude, unary minus/plus, and sqrt(x).
    """
    import sympy

    if isinstance(node, ast.Expression):
        return _to_sympy(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return (
            sympy.nsimplify(node.value)
            if isinstance(node.value, float)
            else sympy.Integer(node.value)
        )
    if isinstance(node, ast.Name):
        if node.id == "pi":
            return sympy.pi
        if node.id == "e":
            return sympy.E
        if len(node.id) == 1:
            return sympy.Symbol(node.id)
        raise ValueError(f"name {node.id!r} is not allowed")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        inner = _to_sympy(node.operand)
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp):
        left, right = _to_sympy(node.left), _to_sympy(node.right)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.Div):
            return left / right
        if isinstance(node.op, ast.Pow):
            if not (right.is_Integer and abs(int(right)) <= MAX_EXPONENT):
                raise ValueError("only small integer exponents are allowed")
            return left**right
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "sqrt"
        and len(node.args) == 1
        and not node.keywords
    ):
        return sympy.sqrt(_to_sympy(node.args[0]))
    raise ValueError(f"{type(node).__name__} is not allowed in an answer")


def answers_equal(predicted: str, label: str) -> bool:
    """Textual equality after normalisation, else symbolic equality of safely parsed answers.

    Model output is never evaluated as Python: answers are parsed with `ast` and only a small
    whitelist of nodes is turned into sympy objects (see `_to_sympy`); long answers and large
    exponents are refused.
    """
    if normalize_answer(predicted) == normalize_answer(label):
        return True
    a, b = _to_python_source(predicted), _to_python_source(label)
    if not a or not b:
        return False
    try:
        import sympy

        difference = _to_sympy(ast.parse(a, mode="eval")) - _to_sympy(ast.parse(b, mode="eval"))
        return bool(sympy.expand(difference) == 0 or sympy.simplify(difference) == 0)
    except (ValueError, TypeError, SyntaxError, ZeroDivisionError, RecursionError, AttributeError):
        return False


def exact_match(
    queries: Sequence[str],
    prompts: Sequence[str],
    labels: Sequence[object],
    *,
    responses: Iterable[object] | None = None,
    **kwargs: object,
) -> list[float]:
    """1.0 where the stripped response equals the stripped label."""
    return [
        float(r.strip() == str(label).strip())
        for r, label in zip(_responses(queries, prompts, responses), labels, strict=True)
    ]


def math_answer(
    queries: Sequence[str],
    prompts: Sequence[str],
    labels: Sequence[object],
    *,
    responses: Iterable[object] | None = None,
    **kwargs: object,
) -> dict[str, list[float] | dict[str, list[float]]]:
    """1.0 where the last boxed answer equals the label; ``extra_logs`` records whether a boxed
    answer was found at all."""
    rewards, found = [], []
    for response, label in zip(_responses(queries, prompts, responses), labels, strict=True):
        boxed = last_boxed(response)
        found.append(float(boxed is not None))
        rewards.append(float(boxed is not None and answers_equal(boxed, str(label))))
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"math/boxed_found": found}}


def boxed_format(
    queries: Sequence[str],
    prompts: Sequence[str],
    labels: Sequence[object],
    *,
    responses: Iterable[object] | None = None,
    **kwargs: object,
) -> list[float]:
    """1.0 where the response holds exactly one ``\\boxed{...}`` answer."""
    return [
        float(r.count("\\boxed{") == 1 and last_boxed(r) is not None)
        for r in _responses(queries, prompts, responses)
    ]


NAMES = ("exact_match", "math_answer", "boxed_format")
"""The built-in reward functions, as a run names them (``builtin:<name>``)."""
