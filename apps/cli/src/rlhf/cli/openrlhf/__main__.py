"""``python -m rlhf.cli.openrlhf``: the README's migration section."""

from rlhf.cli.openrlhf.docs import migration_markdown

print(migration_markdown(), end="")
