"""Built-in reward functions with the ``reward_func(queries, prompts, labels, **kwargs)`` signature.

- `exact_match`: 1.0 when the response, stripped, equals the label.
- `math_answer`: extracts the last ``\\boxed{...}`` of the response (brace-matched) and compares it
  with the label: equal after normalisation, or symbolically equal (sympy) for numeric/algebraic
  answers built from a safe character set. Anything that cannot be parsed scores 0.
- `boxed_format`: 1.0 when the response contains exactly one ``\\boxed{...}`` answer.

Each uses ``kwargs["responses"]`` (the decoded completion alone, which the executors pass) and
falls back to the query with the prompt removed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

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


def _responses(queries: Sequence[str], prompts: Sequence[str], kwargs: dict[str, Any]) -> list[str]:
    responses = kwargs.get("responses")
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


def _to_sympy_source(answer: str) -> str | None:
    text = normalize_answer(answer)
    for _ in range(5):  # nested \frac / \sqrt
        text = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", text)
        text = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", text)
    text = text.replace("^", "**").replace("{", "(").replace("}", ")")
    return text if _SAFE_EXPR.match(text.replace("**", "^")) else None


def answers_equal(predicted: str, label: str) -> bool:
    """Textual equality after normalisation, else symbolic equality with sympy."""
    if normalize_answer(predicted) == normalize_answer(label):
        return True
    a, b = _to_sympy_source(predicted), _to_sympy_source(label)
    if not a or not b:
        return False
    try:
        import sympy
        from sympy.parsing.sympy_parser import parse_expr

        diff = sympy.simplify(parse_expr(a, evaluate=True) - parse_expr(b, evaluate=True))
        return bool(diff == 0)
    except Exception:
        return False


def exact_match(
    queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any], **kwargs: Any
) -> list[float]:
    """1.0 where the stripped response equals the stripped label."""
    return [
        float(r.strip() == str(label).strip())
        for r, label in zip(_responses(queries, prompts, kwargs), labels, strict=True)
    ]


def math_answer(
    queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any], **kwargs: Any
) -> dict[str, Any]:
    """1.0 where the last boxed answer equals the label; ``extra_logs`` records whether a boxed
    answer was found at all."""
    rewards, found = [], []
    for response, label in zip(_responses(queries, prompts, kwargs), labels, strict=True):
        boxed = last_boxed(response)
        found.append(float(boxed is not None))
        rewards.append(float(boxed is not None and answers_equal(boxed, str(label))))
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"math/boxed_found": found}}


def boxed_format(
    queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any], **kwargs: Any
) -> list[float]:
    """1.0 where the response holds exactly one ``\\boxed{...}`` answer."""
    return [
        float(r.count("\\boxed{") == 1 and last_boxed(r) is not None)
        for r in _responses(queries, prompts, kwargs)
    ]
