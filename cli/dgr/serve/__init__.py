"""The OpenAI-compatible HTTP gateway over an Inference Route (``dgr serve``).

- :mod:`dgr.serve.engine`: one route session per HTTP request (chat template, admission,
  incremental text, stop strings, cancellation);
- :mod:`dgr.serve.app`: the FastAPI application (OpenAI endpoints, errors, SSE, console);
- :mod:`dgr.serve.api_fields`: the request bodies (each field supported, a hint, or refused
  by name) and the logprobs' OpenAI shapes;
- :mod:`dgr.serve.routeview`: the live route view the console polls (workers' GetMetrics);
- :mod:`dgr.serve.server`: starting a local route or joining running shards, then uvicorn.
"""
