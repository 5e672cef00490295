"""The OpenAI-compatible HTTP server behind ``pagedllm serve``.

- ``app.py``: the FastAPI app, its routes and the engine's lifecycle.
- ``async_engine.py``: the engine loop thread, fed by a command queue.
- ``protocol.py``: request bodies; ``chat.py`` and ``completions.py``: the endpoints;
  ``serving.py`` and ``streaming.py``: what the endpoints share; ``responses.py``: JSON.
- ``errors.py``: OpenAI-style error JSON; ``middleware.py``: API key, shutdown gate,
  body size limit; ``metrics.py``: Prometheus collectors.
- ``cli.py``: the ``serve`` command; ``launcher.py``: a server child process (tests,
  benchmarks).
"""
