"""OpenRLHF's own example scripts (their arguments kept as test data) plan under ``--dry_run``
through ``rlhf``, with the hub's models replaced by local folders holding their config.json
(the plan reads nothing else) and the reward and agent files by local ones."""

from __future__ import annotations

import json
import pathlib

import pytest

from .conftest import run_here

DATA = pathlib.Path(__file__).parent / "data" / "openrlhf_example_scripts.json"
SCRIPTS = json.loads(DATA.read_text())["scripts"]

# The public shapes of the models the scripts name (their config.json fields).
SHAPES = {
    "OpenRLHF/Llama-3-8b-sft-mixture": ("llama", 4096, 14336, 32, 32, 8, 128256, 8192),
    "meta-llama/Meta-Llama-3-8B": ("llama", 4096, 14336, 32, 32, 8, 128256, 8192),
    "OpenRLHF/Llama-3-8b-rm-700k": ("llama", 4096, 14336, 32, 32, 8, 128256, 8192),
    "Qwen/Qwen3-4B-Thinking-2507": ("qwen3", 2560, 9728, 36, 32, 8, 151936, 262144),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": ("qwen2", 1536, 8960, 28, 12, 2, 151936, 131072),
}

COMMANDS = {
    "train_ppo_ray": ["train", "ppo"],
    "train_sft": ["train", "sft"],
    "train_rm": ["train", "rm"],
    "train_dpo": ["train", "dpo"],
}

REWARD = "def reward_func(queries, prompts, labels, **kwargs):\n    return [0.0] * len(queries)\n"
AGENT = """
from rlhf.agents.openrlhf import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    async def step(self, states, **kwargs):
        return {"rewards": 0.0, "environment_feedback": "", "done": True}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def _local(args: list[str], root: pathlib.Path) -> list[str]:
    """``args`` with each hub model a local folder, each reward or agent file a local one."""
    out = []
    for i, word in enumerate(args):
        flag = args[i - 1] if i else ""
        if word in SHAPES:
            kind, hidden, inter, layers, heads, kv, vocab, positions = SHAPES[word]
            folder = root / word.replace("/", "--")
            folder.mkdir(exist_ok=True)
            (folder / "config.json").write_text(json.dumps({
                "model_type": kind, "architectures": ["ForCausalLM"], "hidden_size": hidden,
                "intermediate_size": inter, "num_hidden_layers": layers,
                "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
                "max_position_embeddings": positions, "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
            }))  # fmt: skip
            word = str(folder)
        elif flag == "--reward.remote_url" and word.endswith(".py"):
            word = str(root / "reward_func.py")
            pathlib.Path(word).write_text(REWARD)
        elif flag == "--train.agent_func_path":
            word = str(root / "agent_func.py")
            pathlib.Path(word).write_text(AGENT)
        out.append(word)
    return out


@pytest.mark.parametrize(
    "name", sorted(n for n in SCRIPTS if SCRIPTS[n]["entry_point"] != "serve_rm")
)
def test_an_openrlhf_example_script_plans_under_dry_run(name, tmp_path) -> None:
    script = SCRIPTS[name]
    args = _local(script["args"], tmp_path)
    out = run_here(*COMMANDS[script["entry_point"]], *args, "--dry_run")
    assert out.returncode in (0, 1), out.stderr[-3000:]  # fits, or does not (a plan either way)
    assert "[capacity]" in out.stdout and ("fits" in out.stdout or "DOES NOT FIT" in out.stdout)
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


def test_the_scripts_cover_what_the_issue_names() -> None:
    assert {
        "train_ppo_ray_hybrid_engine", "train_dapo_ray_hybrid_engine",
        "train_reinforce_baseline_hybrid_engine", "train_reinforce_baseline_ray_agent_async",
        "train_sft", "train_rm", "train_dpo_llama",
    } <= set(SCRIPTS)  # fmt: skip


def test_openrlhfs_serve_rm_script_parses(tmp_path) -> None:
    from rlhf.cli.main import parse_serve_rm

    config = parse_serve_rm(_local(SCRIPTS["serve_remote_rm"]["args"], tmp_path))
    assert (config.port, config.max_len, config.batch_size, config.dtype) == (
        5000,
        8192,
        16,
        "bfloat16",
    )
