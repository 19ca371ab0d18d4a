"""Fork maintenance: the llama.cpp pin, the patch stack, building the patched tree and the worker,
and the collaboration package for llama.cpp's maintainers (``outreach``: ``dgr upstream render``
/ ``check``)."""
