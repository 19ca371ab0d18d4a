"""Fork maintenance: the llama.cpp pin, the patch stack, and building the patched tree and the worker."""
