"""dgr: the distributed GGUF runtime toolkit."""

__version__ = "0.1.0"
