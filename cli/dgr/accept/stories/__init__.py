"""Registered acceptance scenarios; each module registers with :func:`dgr.accept.evidence.story`."""
