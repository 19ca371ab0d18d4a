"""The pinned upstream llama.cpp: pin, patch stack, build, toolchains per backend."""
