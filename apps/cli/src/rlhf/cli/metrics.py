"""Run logging: a JSONL metrics file (one object per line, flushed each step), optionally
TensorBoard event files (the ``tensorboard`` extra) and a Weights & Biases run (the ``wandb``
extra), and the reward/accuracy curves as a PNG at the end. Every sink takes the same rows
(`MetricsSink`)."""

from __future__ import annotations

import json
import math
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from rlhf.cli.config import ConfigError
from rlhf.cli.console import bar as progress_bar
from rlhf.cli.console import live_console
from rlhf.cli.sections import LoggingConfig


class MetricsSink(Protocol):
    """Where a run's metric rows go (one call per step or evaluation; ``row["step"]`` is the
    x-axis)."""

    def write(self, metrics: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class MetricsLog:
    """Appends one JSON object per call to ``path``."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, metrics: Mapping[str, Any]) -> None:
        clean = {
            k: (v if not isinstance(v, float) or math.isfinite(v) else None)
            for k, v in metrics.items()
        }
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")

    def close(self) -> None:
        pass


class TensorBoardLog:
    """Scalars of every row as TensorBoard events in ``directory`` (``step`` is the x-axis;
    identifiers such as ``data/prompts_crc32`` are left out).

    Raises:
        ImportError: naming the extra to install when ``tensorboard`` is missing.
    """

    def __init__(self, directory: pathlib.Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "--train.use_tensorboard needs the tensorboard package: "
                "pip install 'rlhf-cli[tensorboard]'"
            ) from exc
        self.writer = SummaryWriter(log_dir=str(directory))

    def write(self, metrics: Mapping[str, Any]) -> None:
        step = int(metrics["step"])
        for key, value in _scalars(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a row, without ``step``, booleans and ``data/`` identifiers."""
    return {
        key: float(value)
        for key, value in metrics.items()
        if key != "step"
        and not key.startswith("data/")
        and not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
    }


class WandbLog:
    """Every row as one W&B history entry, plotted against our ``step`` (a custom step
    metric, so a resumed run may log steps again after those it logged before being killed).

    The run's id is kept in ``run_dir/wandb_run_id``: a run resumed from a checkpoint
    (``resume``) continues the same W&B run. Credentials and mode come from W&B itself
    (``wandb login`` or ``WANDB_API_KEY``; ``WANDB_MODE=offline`` writes the run under
    ``run_dir/wandb`` for a later ``wandb sync``).

    Raises:
        ImportError: naming the extra to install when ``wandb`` is missing.
        RuntimeError: when W&B cannot start the run (no credentials, say), with what to do.
    """

    def __init__(
        self,
        run_dir: pathlib.Path,
        *,
        config: Mapping[str, Any],
        project: str,
        group: str = "",
        name: str = "",
        entity: str = "",
        resume: bool = False,
    ) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(
                "--train.use_wandb needs the wandb package: pip install 'rlhf-cli[wandb]'"
            ) from exc
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        try:
            self.run = wandb.init(
                project=project,
                entity=entity or None,
                group=group or None,
                name=name or run_dir.name,
                id=run_id,
                resume="allow" if run_id else None,
                config=dict(config),
                dir=str(run_dir),
            )
        except wandb.Error as exc:
            raise RuntimeError(
                f"--train.use_wandb: W&B could not start the run ({exc}); run `wandb login` or "
                "set WANDB_API_KEY, or set WANDB_MODE=offline and `wandb sync` later"
            ) from exc
        id_file.write_text(self.run.id)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, metrics: Mapping[str, Any]) -> None:
        self.run.log({"step": int(metrics["step"]), **_scalars(metrics)})

    def close(self) -> None:
        self.run.finish()


class Sinks:
    """Several sinks behind one `MetricsSink`."""

    def __init__(self, sinks: Sequence[MetricsSink]) -> None:
        self.sinks = list(sinks)

    def write(self, metrics: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_sinks(
    train: LoggingConfig, *, run_dir: pathlib.Path, run_config: Mapping[str, Any], resume: bool
) -> Sinks:
    """``run_dir/metrics.jsonl`` and the sinks ``--train.use_tensorboard`` /
    ``--train.use_wandb`` ask for (``run_config`` becomes the W&B run's config; ``resume``
    continues the run's W&B run). A missing extra or credentials are a `ConfigError`."""
    sinks: list[MetricsSink] = [MetricsLog(run_dir / "metrics.jsonl")]
    try:
        if train.use_tensorboard:
            sinks.append(TensorBoardLog(pathlib.Path(train.use_tensorboard)))
        if train.use_wandb:
            sinks.append(
                WandbLog(
                    run_dir,
                    config=dict(run_config),
                    project=train.wandb_project,
                    group=train.wandb_group,
                    name=train.wandb_run_name,
                    entity=train.wandb_org,
                    resume=resume,
                )
            )
    except (ImportError, RuntimeError) as exc:
        for sink in sinks:
            sink.close()
        raise ConfigError(str(exc)) from exc
    return Sinks(sinks)


def summary_line(metrics: Mapping[str, Any]) -> str:
    """A step's headline metrics as ``key=value`` pairs for the console."""
    keys = [
        k
        for k in metrics
        if k == "step"
        or k.startswith(("reward/", "eval/", "time/"))
        or k in ("rollout/response_length_mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy")
    ]
    return "  ".join(
        f"{k}={metrics[k]:.4g}" if isinstance(metrics[k], float) else f"{k}={metrics[k]}"
        for k in keys
    )


class Progress:
    """The console's view of a run: the step out of the total, reward, response length,
    generated tokens per second and the time left at the pace so far. On a terminal
    (`rlhf.cli.console.Console`) a bar redrawn in place at every step; elsewhere a plain line
    every ``every_s`` seconds (0: every step), and the first and the last.

    Args:
        total: Steps of the run.
        start: The step it starts from (a resumed run counts its pace from there).
        echo: Where the lines go.
    """

    def __init__(
        self,
        *,
        total: int,
        start: int = 0,
        every_s: float = 5.0,
        echo: Callable[[str], None] = print,
    ) -> None:
        self.total = total
        self.start = start
        self.every_s = every_s
        self.echo = echo
        self._t0 = time.monotonic()
        self._shown = -float("inf")

    def due(self, step: int, *, every_s: float | None = None) -> bool:
        """Whether to show ``step`` (steps done): the first and the last, and one whenever
        ``every_s`` (default the progress's) passed since the last shown (a long run says
        where it is without a line per step)."""
        now = time.monotonic()
        every = self.every_s if every_s is None else every_s
        if step in (self.start + 1, self.total) or now - self._shown >= every:
            self._shown = now
            return True
        return False

    def show(
        self, step: int, metrics: Mapping[str, Any], *, prefix: str = "", suffix: str = ""
    ) -> None:
        """Show ``step`` (steps done) with its ``metrics``, between ``prefix`` and ``suffix``:
        on a live console as the status line (redrawn at most 10 times a second, and ended
        at the last step), else as a line when `due`."""
        console = live_console(self.echo)
        if console is None:
            if self.due(step):
                self.echo(f"{prefix}{self.line(step, metrics)}{suffix}")
            return
        if self.due(step, every_s=0.1):
            console.status(f"{prefix}{self.line(step, metrics, bar=True)}{suffix}")
        if step == self.total:
            console.close()

    def line(self, step: int, metrics: Mapping[str, Any], *, bar: bool = False) -> str:
        """``step`` is the number of steps done; ``metrics`` the step's metrics; ``bar``: a
        progress bar beside the step count."""
        elapsed = time.monotonic() - self._t0
        done = max(step - self.start, 1)
        eta = elapsed / done * (self.total - step)
        drawn = f" {progress_bar(step, self.total)}" if bar else ""
        parts = [f"[{step}/{self.total}{drawn}]"]
        if "reward/mean" in metrics:
            parts.append(f"reward {metrics['reward/mean']:.3f}")
        length = metrics.get("rollout/response_length_mean")
        if length is not None:
            parts.append(f"len {length:.1f}")
            gen = metrics.get("time/generation_s")
            if gen:
                samples = metrics.get("rollout/samples", 0.0)
                parts.append(f"{length * samples / gen:.0f} tok/s")
        pace = elapsed / done
        parts.append(f"{pace:.1f} s/step" if pace >= 0.1 else f"{pace * 1000:.0f} ms/step")
        parts.append(f"ETA {_duration(eta)}")
        return " | ".join(parts)


def _duration(seconds: float) -> str:
    seconds = max(round(seconds), 0)
    minutes, sec = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{sec:02d}s"


def read(path: pathlib.Path) -> list[dict[str, Any]]:
    """The rows of a metrics file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(metrics_path: pathlib.Path, png: pathlib.Path) -> pathlib.Path | None:
    """Training reward and every evaluation metric against the step, one panel each."""
    if not metrics_path.is_file():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read(metrics_path)
    train = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    eval_keys = sorted({k for r in evals for k in r if k.startswith("eval/")})
    panels = [("reward/mean", train)] + [(k, evals) for k in eval_keys]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.2), squeeze=False)
    for ax, (key, data) in zip(axes[0], panels, strict=True):
        points = [(r["step"], r[key]) for r in data if r.get(key) is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o" if key.startswith("eval/") else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
