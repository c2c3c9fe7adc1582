"""OpenRLHF 0.11.2's command lines, read by ``rlhf``: every flag of its five entry points and
what it means here.

One table per entry point (`TABLES`): ``train_ppo_ray`` → ``rlhf train <rl preset>``,
``train_sft`` → ``rlhf train sft``, ``train_rm`` / ``train_dpo`` → ``rlhf train rm|dpo``,
``serve_rm`` → ``rlhf serve-rm``. Each row is one OpenRLHF flag with how many values it takes
(`Arity`) and one of:

- `Same`: the flag is our field's own spelling;
- `Alias`: it sets one or more of our fields, its values translated where the two spell them
  differently (``--ds.param_dtype bf16`` → ``--actor.deepspeed.bf16 True``);
- `Gathered`: it joins other flags into one setting (``--actor.num_nodes`` ×
  ``--actor.num_gpus_per_node`` ranks), finished after the whole line was read;
- `Notice`: accepted, with nothing to do here; a line on stderr says why;
- `Refused`: an error naming the flag and what to use instead (what cannot mean anything here,
  or a behaviour another issue builds).

`translate` rewrites a command line in our spelling before it is parsed; the README's migration
section is `migration_markdown()` (a test keeps them equal).

Modules: `entries` (the kinds of row), `tables` (the rows), `groups` (gathered flags),
`translate`, `docs` (``--help`` and the README section).
"""

from rlhf.cli.openrlhf.docs import meaning, migration_markdown, openrlhf_aliases, openrlhf_help
from rlhf.cli.openrlhf.entries import Alias, Arity, Gathered, Notice, Refused, Row, Same
from rlhf.cli.openrlhf.groups import FINISHERS
from rlhf.cli.openrlhf.tables import COMMANDS, EARLIER, TABLES
from rlhf.cli.openrlhf.translate import (
    Translated,
    translate,
    unknown_flag_problems,
)

__all__ = [
    "COMMANDS",
    "EARLIER",
    "FINISHERS",
    "TABLES",
    "Alias",
    "Arity",
    "Gathered",
    "Notice",
    "Refused",
    "Row",
    "Same",
    "Translated",
    "meaning",
    "migration_markdown",
    "openrlhf_aliases",
    "openrlhf_help",
    "translate",
    "unknown_flag_problems",
]
