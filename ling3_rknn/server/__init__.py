"""OpenAI-compatible HTTP server (aiohttp) in front of the engine.

One module per job: ``validate`` (strict request schema), ``completion`` (one chat
completion from request to events), ``responses`` (OpenAI response and chunk shapes),
``sse`` (event-stream framing), ``chat_handler`` (the chat route, JSON or SSE), ``errors``
(OpenAI error bodies), ``metrics`` (Prometheus text), ``state`` (config, engine slot, app
keys), ``lifecycle`` (loading, cancellation, shutdown) and ``app`` (middleware, routes).
"""

from ling3_rknn.server.app import AppConfig, EngineHolder, create_app, run_server

__all__ = ["AppConfig", "EngineHolder", "create_app", "run_server"]
