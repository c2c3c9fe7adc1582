"""rlhf.molt: The large-scale learner backend.

This package is at its foundation stage: it builds, installs and imports, and carries the
namespace, typing marker and dependency pins. Its contents arrive with a later issue.
"""
