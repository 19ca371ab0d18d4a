"""Acceptance: evidence folders written by `dgr accept`, one story per acceptance id."""
