"""Triton / KServe v2 over HTTP, one module per job:

- schema.py    the inputs and outputs each backend style declares; model metadata and config documents
- protocol.py  request inputs of the three styles -> GenerateRequest; response outputs; `{"error": ...}` errors
- generate.py  `generate`, `generate_stream`, cancel by id
- infer.py     KServe `infer` (JSON and binary tensors)
- binary.py    the binary tensor data codec
- admin.py     health, metadata, config, statistics, the repository extension
"""

from __future__ import annotations

from starlette.convertors import Convertor, register_url_convertor
from starlette.routing import Route

from specserve.server.triton import admin
from specserve.server.triton.generate import generate, generate_stream
from specserve.server.triton.infer import infer


class _VersionConvertor(Convertor):
    """Triton's model version path segment: digits, kept as a string."""

    regex = "[0-9]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value) -> str:
        return str(value)


register_url_convertor("int_str", _VersionConvertor())

_MODEL = "/v2/models/{model:str}"
_VERSION = "/v2/models/{model:str}/versions/{version:int_str}"


def routes() -> list[Route]:
    out = [
        Route("/v2", admin.server_metadata, methods=["GET"]),
        Route("/v2/health/live", admin.live, methods=["GET"]),
        Route("/v2/health/ready", admin.ready, methods=["GET"]),
        Route("/v2/models/stats", admin.stats, methods=["GET"]),
        Route("/v2/repository/index", admin.repository_index, methods=["POST"]),
        Route("/v2/repository/models/{model:str}/load", admin.repository_load, methods=["POST"]),
        Route("/v2/repository/models/{model:str}/unload", admin.repository_unload, methods=["POST"]),
        Route("/v2/repository/{repository:str}/index", admin.repository_index, methods=["POST"]),
        Route("/v2/repository/{repository:str}/models/{model:str}/load", admin.repository_load, methods=["POST"]),
        Route("/v2/repository/{repository:str}/models/{model:str}/unload", admin.repository_unload,
              methods=["POST"]),
    ]
    for base in (_MODEL, _VERSION):
        out += [
            Route(base, admin.metadata, methods=["GET"]),
            Route(base + "/ready", admin.model_ready, methods=["GET"]),
            Route(base + "/config", admin.config, methods=["GET"]),
            Route(base + "/stats", admin.stats, methods=["GET"]),
            Route(base + "/infer", infer, methods=["POST"]),
            Route(base + "/generate", generate, methods=["POST"]),
            Route(base + "/generate_stream", generate_stream, methods=["POST"]),
        ]
    return out
