"""What a person reads of the tables: ``--help``'s list (`openrlhf_help`) and the README's
migration section (`migration_markdown`)."""

from __future__ import annotations

from rlhf.cli.openrlhf.entries import Alias, Gathered, Notice, OnlyValue, Row, Same
from rlhf.cli.openrlhf.groups import GROUP_DOCS
from rlhf.cli.openrlhf.tables import COMMANDS, EARLIER, TABLES


def openrlhf_help(entry_point: str) -> str:
    """What ``--help`` lists after our flags: each OpenRLHF flag of ``entry_point`` and what
    it is here, one line each."""
    table = TABLES[entry_point]
    other = sorted(name for name, row in table.items() if not isinstance(row.entry, Same))
    lines = [
        f"OpenRLHF 0.11 {entry_point} flags read by this command ({len(table)}; the "
        f"{len(table) - len(other)} not listed are spelled as ours):"
    ]
    for name in other:
        lines.append(f"  --{name}  {meaning(table[name])[0].replace('`', '')}")
    return "\n".join(lines)


def openrlhf_aliases(entry_point: str) -> dict[str, list[str]]:
    """Our dotted field → the OpenRLHF flags of ``entry_point`` that set it (with ``--``)."""
    out: dict[str, list[str]] = {}
    for name, row in TABLES[entry_point].items():
        if isinstance(row.entry, Alias) and not isinstance(row.entry.values, OnlyValue):
            for field in row.entry.fields:
                if field != name:
                    out.setdefault(field, []).append(f"--{name}")
    return out


def migration_markdown() -> str:
    """The README's migration section: every OpenRLHF flag and what it is here."""
    lines = []
    for entry_point, table in TABLES.items():
        lines += [
            f"#### `{entry_point}` → `{COMMANDS[entry_point]}` ({len(table)} flags)",
            "",
            "| OpenRLHF flag | here | default differs |",
            "|---|---|---|",
        ]
        for name in sorted(table):
            lines.append(_markdown_row(table[name]))
        lines.append("")
        earlier = EARLIER.get(entry_point, {})
        if earlier:
            names = ", ".join(f"`--{n}`" for n in sorted(earlier))
            lines += [f"Also read, as OpenRLHF 0.11.0 spelled them: {names}.", ""]
    return "\n".join(lines)


def _markdown_row(row: Row) -> str:
    here, default = meaning(row)
    return f"| `--{row.name}` | {here.replace('|', '/')} | {default} |"


def meaning(row: Row) -> tuple[str, str]:
    """What ``row``'s flag is here, and how its default differs ("" when it does not)."""
    entry = row.entry
    if isinstance(entry, Same):
        return "same", entry.default
    if isinstance(entry, Alias) and entry.fields:
        return ", ".join(f"`--{f}`" for f in entry.fields), entry.default
    if isinstance(entry, Alias):
        assert isinstance(entry.values, OnlyValue)
        return f"only `{entry.values.value}`: {entry.values.why}", ""
    if isinstance(entry, Gathered):
        return f"with the other `{entry.group}` flags ({GROUP_DOCS[entry.group]})", entry.default
    if isinstance(entry, Notice):
        return f"accepted, no effect: {entry.message}", ""
    return f"refused: {entry.message}", ""
