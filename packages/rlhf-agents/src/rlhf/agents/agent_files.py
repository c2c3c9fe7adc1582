"""An agent file: a Python file that defines how a multi-turn sample is produced, in one of
three shapes, checked when it is loaded and turned into the `Executor` of its shape.

- ``Environment`` class: a token-in, token-out environment (``reset(prompt, label)``,
  ``step(action)``), run by `MultiTurnExecutor`; one instance per sample, made with no
  arguments.
- ``agent`` function: an agent that talks to the policy through an OpenAI client on
  127.0.0.1 (`OpenAIAgentExecutor`); its chat messages are rendered by the policy
  tokenizer's chat template, which must exist.
- ``AgentExecutor`` class: OpenRLHF's agent file (an `rlhf.agents.openrlhf.AgentExecutorBase`),
  run by `rlhf.agents.openrlhf.OpenRLHFAgentRunner`.

An ``Environment`` class wins over the other two when a file defines several.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Literal

from rlhf.agents.environments import EnvironmentFactory
from rlhf.agents.loading import load_module

if TYPE_CHECKING:
    from rlhf.agents.rewards import FailurePolicy
    from rlhf.agents.single_turn import Executor
    from rlhf.agents.tokens import CallableTokenizer
    from rlhf.agents.types import Generator, SamplingParams

AgentShape = Literal["environment", "openai_agent", "openrlhf"]


class AgentFileError(ValueError):
    """An agent file that defines none of the accepted shapes, or one that cannot run with
    the policy's tokenizer; the message names the file and what to change."""


@dataclass(frozen=True)
class AgentFile:
    """A loaded, checked agent file.

    Attributes:
        path: The file, as given.
        module: The imported file (`rlhf.agents.load_module`: imported once per process).
        shape: Which of the three shapes it has.
        environments: The ``Environment`` class's factory (shape ``environment``), else None.
    """

    path: str
    module: ModuleType
    shape: AgentShape
    environments: EnvironmentFactory | None = None

    @classmethod
    def load(cls, path: str, *, chat_template: bool, purpose: str = "agent file") -> AgentFile:
        """Import the file at ``path`` and check it against the shape it has.

        Args:
            path: The agent file.
            chat_template: The policy tokenizer has a chat template (an ``agent`` function
                needs one).
            purpose: How error messages name the file (a flag, e.g.
                ``--train.agent_func_path``).

        Raises:
            AgentFileError: no accepted shape, an ``AgentExecutor`` that is no
                ``AgentExecutorBase``, an ``Environment`` class that cannot be made with no
                arguments, or an ``agent`` function without a chat template.
            OSError, ImportError, ValueError: the file is missing, not ``.py``, or fails to
                import (`rlhf.agents.load_module`).
        """
        from rlhf.agents.openrlhf import is_agent_executor

        module = load_module(path, purpose=purpose)
        executor = getattr(module, "AgentExecutor", None)
        if executor is not None and not is_agent_executor(executor):
            raise AgentFileError(
                f"{purpose} {path!r}: its AgentExecutor does not subclass "
                "AgentExecutorBase; an OpenRLHF agent file imports it (and AgentInstanceBase, "
                "MultiTurnAgentExecutor) from rlhf.agents.openrlhf instead of openrlhf.utils.agent"
            )
        if hasattr(module, "Environment"):
            try:
                factory = EnvironmentFactory(
                    module.Environment, source=f"environment Environment in {path}"
                )
            except TypeError as exc:
                raise AgentFileError(f"{purpose} {path}: {exc}") from None
            return cls(path, module, "environment", factory)
        if executor is not None:
            return cls(path, module, "openrlhf")
        if not callable(getattr(module, "agent", None)):
            raise AgentFileError(
                f"{purpose} {path!r} defines none of the accepted shapes: an `Environment` "
                "class (multi-turn environment: reset(prompt, label), step(action)), an `agent` "
                "function (OpenAI-client agent), or OpenRLHF's `AgentExecutor` class (an "
                "AgentExecutorBase, usually MultiTurnAgentExecutor over an AgentInstanceBase; "
                "import them from rlhf.agents.openrlhf)"
            )
        if not chat_template:
            raise AgentFileError(
                f"{purpose} {path} is an OpenAI-client agent, whose chat messages are rendered "
                "through the policy tokenizer's chat template, and the tokenizer of "
                "--actor.model.path has none: add a chat_template to its tokenizer_config.json "
                "(or write the agent as an Environment class, which works in tokens)"
            )
        return cls(path, module, "openai_agent")

    def executor(
        self,
        *,
        tokenizer: CallableTokenizer,
        generator: Generator,
        sampling: SamplingParams,
        max_len: int,
        max_turns: int,
        step_timeout_s: float | None,
        policy: FailurePolicy,
    ) -> Executor:
        """The executor of this file's shape over ``generator``.

        Args:
            tokenizer: The policy's tokenizer (a Hugging Face one: OpenRLHF's executors call it).
            generator: The rollout engines (`rlhf.agents.Generator`).
            sampling: Sampling of every policy turn.
            max_len: Token budget of a whole episode (prompt, actions, observations).
            max_turns: Turns per episode (``Environment`` shape).
            step_timeout_s: Seconds an environment step or OpenRLHF agent step may take.
            policy: What happens to an episode whose environment or agent fails.
        """
        from rlhf.agents.agent_executor import OpenAIAgentExecutor
        from rlhf.agents.multi_turn import MultiTurnExecutor
        from rlhf.agents.openrlhf import OpenRLHFAgentRunner

        if self.environments is not None:
            return MultiTurnExecutor(
                environments=self.environments,
                max_turns=max_turns,
                step_timeout_s=step_timeout_s,
                policy=policy,
                tokenizer=tokenizer,
                generator=generator,
                sampling=sampling,
                max_len=max_len,
            )
        if self.shape == "openrlhf":
            return OpenRLHFAgentRunner(
                executor=self.module.AgentExecutor(),
                source=f"AgentExecutor in {self.path}",
                step_timeout_s=step_timeout_s,
                policy=policy,
                tokenizer=tokenizer,
                generator=generator,
                sampling=sampling,
                max_len=max_len,
            )
        return OpenAIAgentExecutor(
            agent=self.module.agent,
            source=f"agent in {self.path}",
            tokenizer=tokenizer,
            generator=generator,
            sampling=sampling,
            max_len=max_len,
        )


def has_chat_template(model_path: str) -> bool:
    """Whether the tokenizer files of ``model_path`` hold a chat template (read from the
    files, without loading the tokenizer)."""
    root = pathlib.Path(model_path)
    if (root / "chat_template.jinja").is_file() or (root / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((root / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))
