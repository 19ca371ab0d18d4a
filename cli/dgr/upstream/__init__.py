"""Fork maintenance: the llama.cpp pin, the patch stack, building the patched tree and the worker,
the toolchains per backend (``vulkan_sdk``, ``cuda_sdk``, ``doctor``: ``dgr doctor``), and the
collaboration package for llama.cpp's maintainers (``outreach``: ``dgr upstream render`` / ``check``)."""
