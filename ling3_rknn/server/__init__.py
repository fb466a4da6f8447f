"""OpenAI-compatible HTTP server (aiohttp) in front of the engine.

One module per job: ``validate`` (strict request schema), ``responses`` (OpenAI response and
chunk shapes), ``sse`` (event-stream framing), ``completion`` (one chat completion from
request to events), ``errors`` (OpenAI error bodies), ``metrics`` (Prometheus text) and
``app`` (routes, middlewares, lifecycle).
"""

from ling3_rknn.server.app import AppConfig, EngineHolder, create_app, run_server

__all__ = ["AppConfig", "EngineHolder", "create_app", "run_server"]
