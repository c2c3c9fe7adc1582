"""rlhf.agents: How a sample is produced and scored.

This package is at its foundation stage: it builds, installs and imports, and carries the
namespace, typing marker and dependency pins. Its contents arrive with issue 3.
"""
