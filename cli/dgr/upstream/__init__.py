"""Everything about the upstream llama.cpp: the pin, the patch stack, building it, and the
collaboration package for its maintainers (``outreach``: ``dgr upstream render`` / ``check``)."""
