"""Built-in reward functions: boxed extraction, normalisation and symbolic equivalence."""

import pytest

from rlhf.agents.builtin_rewards import (
    answers_equal,
    boxed_format,
    exact_match,
    last_boxed,
    math_answer,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\\boxed{42}", "42"),
        ("first \\boxed{1} then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
        ("\\boxed{{a}+{b}}", "{a}+{b}"),
        ("\\boxed{unclosed", None),
        ("no box", None),
    ],
)
def test_last_boxed(text, expected) -> None:
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        ("\\frac{1}{2}", "0.5", True),
        ("\\dfrac{2}{4}", "1/2", True),
        ("\\sqrt{16}", "4", True),
        ("2^{10}", "1024", True),
        ("3.", "3", True),
        ("x + x", "2x", False),  # implicit multiplication is not parsed: no false positives
        ("\\left( 1 \\right)", "1", True),
        ("5", "6", False),
        ("x + x", "2*x", True),
        ("9^9^9^9", "1", False),  # refused (exponent too large), answers quickly
        ("factorial(10^7)", "1", False),  # names other than sqrt/pi/e are refused
    ],
)
def test_answers_equal(a, b, equal) -> None:
    assert answers_equal(a, b) is equal


def test_the_names_list_every_reward_function_of_the_module() -> None:
    import inspect

    from rlhf.agents import builtin_rewards

    rewards = {
        name
        for name, f in vars(builtin_rewards).items()
        if inspect.isfunction(f)
        and f.__module__ == builtin_rewards.__name__
        and list(inspect.signature(f).parameters)[:3] == ["queries", "prompts", "labels"]
    }
    assert set(builtin_rewards.NAMES) == rewards


def test_reward_functions_use_responses_when_given() -> None:
    responses = ["\\boxed{7}", "7", "\\boxed{1}\\boxed{7}"]
    kw = {"responses": responses}
    assert math_answer(["x"] * 3, ["p"] * 3, ["7", "7", "7"], **kw)["rewards"] == [1.0, 0.0, 1.0]
    assert exact_match(["x"] * 3, ["p"] * 3, ["7", "7", "7"], **kw) == [0.0, 1.0, 0.0]
    assert boxed_format(["x"] * 3, ["p"] * 3, [None] * 3, **kw) == [1.0, 0.0, 0.0]


def test_without_responses_the_prompt_is_stripped_from_the_query() -> None:
    assert exact_match(["Q: 2+2? 4"], ["Q: 2+2? "], ["4"]) == [1.0]


def test_model_output_is_never_executed(tmp_path) -> None:
    marker = tmp_path / "pwned"
    payload = "".join(f"chr({ord(c)})+" for c in f"open('{marker}','w')")[:-1]
    for answer in (f"exec({payload})", f"eval({payload})", "__import__(chr(111)+chr(115))"):
        assert answers_equal(answer, "42") is False
        assert math_answer(["x"], ["p"], ["42"], responses=[f"\\boxed{{{answer}}}"])["rewards"] == [
            0.0
        ]
    assert not marker.exists()
