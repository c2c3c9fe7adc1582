"""rlhf.cli: the ``rlhf`` command composing rollout, agents, learner and algorithms on Ray.

`main` is the entry point; `RLConfig` and the presets (`PRESETS`) describe ``rlhf train``;
`run_rl`, `run_sft` and `run_demo` run them from Python.
"""

from rlhf.cli.config import ConfigError, RLConfig
from rlhf.cli.main import main
from rlhf.cli.presets import PRESETS, resolve

__all__ = ["PRESETS", "ConfigError", "RLConfig", "main", "resolve"]
