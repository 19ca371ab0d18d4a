"""Registered acceptance scenarios; each module registers with :func:`dgr.evidence.story`."""
