"""Reward functions from a user's file: formats, batching, failure policies, bad input."""

import asyncio
import math
import subprocess
import sys
import textwrap

import pytest

from rlhf.agents import FailurePolicy, FunctionReward, RewardError


def write(tmp_path, body: str, name: str = "reward.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def score(scorer, n: int = 3, **kwargs):
    queries = [f"q{i}" for i in range(n)]
    return asyncio.run(
        scorer.score(
            queries=queries, prompts=[f"p{i}" for i in range(n)], labels=list(range(n)), **kwargs
        )
    )


def test_sync_function_is_called_once_per_batch(tmp_path) -> None:
    path = write(
        tmp_path,
        """
        CALLS = []
        def reward_func(queries, prompts, labels, **kwargs):
            CALLS.append(len(queries))
            return [float(l) * 2 for l in labels]
        """,
    )
    scorer = FunctionReward.from_file(path)
    out = score(scorer, 4)
    assert out.rewards == [0.0, 2.0, 4.0, 6.0]
    assert out.scores == out.rewards
    assert all(out.valid)
    assert scorer.func.__globals__["CALLS"] == [4]


def test_async_function_dict_output_with_scores_and_extra_logs(tmp_path) -> None:
    path = write(
        tmp_path,
        """
        import asyncio
        async def reward_func(queries, prompts, labels, **kwargs):
            await asyncio.sleep(0)
            return {"rewards": [1.0] * len(queries), "scores": [0.5] * len(queries),
                    "extra_logs": {"len": [len(q) for q in queries], "const": 3}}
        """,
    )
    out = score(FunctionReward.from_file(path), 2)
    assert out.rewards == [1.0, 1.0]
    assert out.scores == [0.5, 0.5]
    assert out.extra_logs == {"len": [2.0, 2.0], "const": [3.0, 3.0]}


def test_batch_size_splits_calls(tmp_path) -> None:
    path = write(
        tmp_path,
        "CALLS=[]\ndef reward_func(q, p, l, **kw):\n    CALLS.append(len(q))\n    return [0.0]*len(q)\n",
    )
    scorer = FunctionReward.from_file(path, batch_size=2)
    score(scorer, 5)
    assert scorer.func.__globals__["CALLS"] == [2, 2, 1]


def test_kwargs_are_sliced_per_sample(tmp_path) -> None:
    path = write(
        tmp_path,
        "def reward_func(q, p, l, responses, **kw):\n    return [float(len(r)) for r in responses]\n",
    )
    out = score(FunctionReward.from_file(path, batch_size=1), 2, responses=["a", "bbb"])
    assert out.rewards == [1.0, 3.0]


RAISES = """
def reward_func(queries, prompts, labels, **kwargs):
    if any(l == 1 for l in labels):
        raise KeyError("answer")
    return [1.0] * len(queries)
"""


def test_raising_function_under_raise_names_file_and_samples(tmp_path) -> None:
    path = write(tmp_path, RAISES)
    with pytest.raises(
        RewardError,
        match=r"reward function reward_func in .*reward\.py raised on samples 0\.\.2: KeyError\('answer'\)",
    ):
        score(FunctionReward.from_file(path))


def test_raising_function_under_skip_isolates_the_culprit(tmp_path) -> None:
    out = score(
        FunctionReward.from_file(write(tmp_path, RAISES), policy=FailurePolicy(on_failure="skip"))
    )
    assert out.valid == [True, False, True]
    assert out.rewards[0] == 1.0
    assert out.rewards[2] == 1.0
    assert out.metrics["reward/failed"] == 1


def test_raising_function_under_fallback(tmp_path) -> None:
    policy = FailurePolicy(on_failure="fallback", fallback_reward=-1.0)
    out = score(FunctionReward.from_file(write(tmp_path, RAISES), policy=policy))
    assert out.valid == [True, True, True]
    assert out.rewards == [1.0, -1.0, 1.0]
    assert out.metrics["reward/fallback"] == 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "return [1.0, float('nan'), 0.0]",
            r"sample 1: reward nan \(float\) is not a finite number",
        ),
        (
            "return [1.0, float('inf'), 0.0]",
            r"sample 1: reward inf \(float\) is not a finite number",
        ),
        ("return [1.0, 'yes', 0.0]", r"sample 1: reward 'yes' \(str\) is not a finite number"),
        ("return [1.0, None, 0.0]", r"sample 1: reward None \(NoneType\) is not a finite number"),
        ("return [1.0]", r"the returned rewards has 1 entries for a batch of 3 samples"),
        ("return 'good'", r"the returned rewards must be a sequence of 3 numbers, got str"),
        (
            "return {'reward': [1, 1, 1]}",
            r"the returned dict has no 'rewards' key \(keys: \['reward'\]\)",
        ),
        (
            "return {'rewards': [1, 1, 1], 'scores': [1]}",
            r"'scores' has 1 entries for a batch of 3",
        ),
    ],
)
def test_bad_outputs_raise_with_the_sample_and_what_was_expected(tmp_path, body, message) -> None:
    path = write(tmp_path, f"def reward_func(q, p, l, **kw):\n    {body}\n")
    with pytest.raises(RewardError, match=message):
        score(FunctionReward.from_file(path))


def test_nan_under_skip_drops_only_that_sample(tmp_path) -> None:
    path = write(tmp_path, "def reward_func(q, p, l, **kw):\n    return [1.0, float('nan'), 0.5]\n")
    out = score(FunctionReward.from_file(path, policy=FailurePolicy(on_failure="skip")))
    assert out.valid == [True, False, True]
    assert all(math.isfinite(r) for r in out.rewards)


def test_torch_tensor_output_is_accepted(tmp_path) -> None:
    path = write(
        tmp_path,
        "import torch\ndef reward_func(q, p, l, **kw):\n    return torch.tensor([0.25] * len(q))\n",
    )
    assert score(FunctionReward.from_file(path), 2).rewards == [0.25, 0.25]


def test_missing_file_and_missing_symbol(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"reward function file 'nope\.py' does not exist"):
        FunctionReward.from_file("nope.py")
    path = write(tmp_path, "def reward(q, p, l):\n    return [0.0]\n")
    with pytest.raises(AttributeError, match=r"defines no 'reward_func'; it defines: \['reward'\]"):
        FunctionReward.from_file(path)
    broken = write(tmp_path, "def reward_func(:\n", name="broken.py")
    with pytest.raises(
        ImportError, match=r"importing reward function file .*broken\.py' failed: SyntaxError"
    ):
        FunctionReward.from_file(broken)


def test_bad_policy_and_mismatched_batch() -> None:
    with pytest.raises(ValueError, match="reward failure policy must be raise, skip or fallback"):
        FailurePolicy(on_failure="ignore")  # type: ignore[arg-type]
    scorer = FunctionReward(lambda q, p, labels, **kw: [0.0] * len(q))
    with pytest.raises(ValueError, match="one entry per sample, got 2, 1 and 2"):
        asyncio.run(scorer.score(queries=["a", "b"], prompts=["a"], labels=[1, 2]))


def test_example_math_reward_file(examples) -> None:
    scorer = FunctionReward.from_file(str(examples / "reward_math.py"))
    responses = ["so \\boxed{\\frac{1}{2}}", "it is \\boxed{3}", "no answer"]
    out = asyncio.run(
        scorer.score(
            queries=responses, prompts=["", "", ""], labels=["0.5", "4", "1"], responses=responses
        )
    )
    assert out.rewards == [1.1, 0.1, 0.0]
    assert out.scores == [1.0, 0.0, 0.0]
    assert out.extra_logs["math/boxed_found"] == [1.0, 1.0, 0.0]


def test_numpy_and_torch_scalars_are_rewards(tmp_path) -> None:
    path = write(
        tmp_path,
        "import numpy as np, torch\ndef reward_func(q, p, l, **kw):\n    return [np.float32(1.0), np.int64(2), torch.tensor(0.5)]\n",
    )
    out = score(
        FunctionReward.from_file(
            path, policy=FailurePolicy(on_failure="fallback", fallback_reward=-9.0)
        )
    )
    assert out.rewards == [1.0, 2.0, 0.5]
    assert "reward/fallback" not in out.metrics


def test_extra_logs_of_the_wrong_type(tmp_path) -> None:
    path = write(
        tmp_path,
        "def reward_func(q, p, l, **kw):\n    return {'rewards': [1.0] * len(q), 'extra_logs': [1]}\n",
    )
    with pytest.raises(
        RewardError, match="'extra_logs' must be a dict of name -> values, got list"
    ):
        score(FunctionReward.from_file(path))


def test_a_hung_reward_function_times_out_under_the_policy(tmp_path) -> None:
    path = write(
        tmp_path,
        """
        import time
        def reward_func(q, p, l, **kw):
            if 1 in l:
                time.sleep(2)
            return [1.0] * len(q)
        """,
    )
    with pytest.raises(
        RewardError, match=r"did not return within 0.3 s \(reward.timeout_s\) on samples 0\.\.2"
    ):
        score(FunctionReward.from_file(path, timeout_s=0.3))
    out = score(
        FunctionReward.from_file(path, timeout_s=0.3, policy=FailurePolicy(on_failure="skip"))
    )
    assert out.valid == [True, False, True]


def test_a_reward_function_that_never_returns_does_not_keep_the_process_alive(tmp_path) -> None:
    """The abandoned call's thread is a daemon: the interpreter exits after the timeout
    (a pool thread, as asyncio.to_thread uses, is joined at exit: forever here)."""
    path = write(
        tmp_path,
        """
        import threading
        def reward_func(q, p, l, **kw):
            threading.Event().wait()  # never returns
        """,
    )
    script = f"""
import asyncio
from rlhf.agents import FunctionReward, RewardError
scorer = FunctionReward.from_file({str(path)!r}, timeout_s=0.3)
try:
    asyncio.run(scorer.score(queries=["a"], prompts=["a"], labels=["a"]))
except RewardError as e:
    print("refused:", e)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused:" in out.stdout and "did not return within 0.3 s" in out.stdout


def test_sys_exit_in_a_reward_function_is_a_failure_not_an_exit(tmp_path) -> None:
    path = write(
        tmp_path,
        """
        import sys
        def reward_func(q, p, l, **kw):
            sys.exit(3)
        """,
    )
    with pytest.raises(
        RewardError, match=r"raised on samples 0\.\.2: RuntimeError\(.*SystemExit\(3\)"
    ):
        score(FunctionReward.from_file(path))
    out = score(FunctionReward.from_file(path, policy=FailurePolicy(on_failure="fallback")))
    assert out.rewards == [0.0, 0.0, 0.0] and out.metrics["reward/fallback"] == 3


def test_a_scorer_is_reusable_across_event_loops(tmp_path) -> None:
    path = write(tmp_path, "def reward_func(q, p, l, **kw):\n    return [1.0] * len(q)\n")
    scorer = FunctionReward.from_file(path)
    assert score(scorer).rewards == score(scorer).rewards == [1.0, 1.0, 1.0]


def test_a_raising_reward_file_is_named_with_its_own_traceback_lines(tmp_path) -> None:
    # The lines of the user's file, innermost last, and none of the framework's.
    import asyncio

    path = tmp_path / "reward.py"
    path.write_text(
        "def reward_func(queries, prompts, labels, **kwargs):\n"
        "    return helper(queries)\n"
        "\n"
        "def helper(queries):\n"
        "    raise KeyError('answer')\n"
    )
    scorer = FunctionReward.from_file(str(path))
    with pytest.raises(RewardError) as caught:
        asyncio.run(scorer.score(queries=["a"], prompts=["p"], labels=["l"]))
    lines = [x for x in str(caught.value).splitlines() if x.strip(" ^~")]  # carets aside
    assert lines[0].endswith("raised on samples 0..0: KeyError('answer')")
    assert lines[1:] == [
        f'  File "{path}", line 2, in reward_func',
        "    return helper(queries)",
        f'  File "{path}", line 5, in helper',
        "    raise KeyError('answer')",
    ]
