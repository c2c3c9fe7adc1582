"""rlhf.cli: The `rlhf` command.

This package is at its foundation stage: it builds, installs and imports, and carries the
namespace, typing marker and dependency pins. Its contents arrive with issue 6.
"""
