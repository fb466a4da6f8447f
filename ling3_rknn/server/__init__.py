"""HTTP server (aiohttp) in front of the engine: OpenAI chat completions, OpenAI Responses
and Anthropic Messages, one generation flow behind all three.

One module per job: ``validate`` (strict chat request schema), ``completion`` (one
generation from the internal chat request to events), ``generation_route`` (the handler
flow every generation route shares), ``chat_handler``, ``responses_api/`` and
``anthropic_api/`` (each API's reader and writer), ``responses`` (OpenAI chat response and
chunk shapes), ``reasoning_seal`` (reasoning values clients send back), ``sse``
(event-stream framing), ``errors`` (error bodies), ``metrics`` (Prometheus text),
``state`` (config, engine slot, app keys), ``lifecycle`` (loading, cancellation,
shutdown) and ``app`` (middleware, routes).
"""

from ling3_rknn.server.app import AppConfig, EngineHolder, create_app, run_server

__all__ = ["AppConfig", "EngineHolder", "create_app", "run_server"]
