"""The OpenAI-compatible API: protocol.py (request fields, response bodies, errors) and serving.py (endpoints)."""

from __future__ import annotations

from starlette.routing import Route

from specserve.server.openai.serving import chat_completions, completions, get_model, health, list_models


def routes() -> list[Route]:
    return [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/health/ready", health, methods=["GET"]),
    ]
