"""KServe v2 gRPC (Triton's `inference.GRPCInferenceService`, port 8001 as Triton's) beside the HTTP server, in the
same process and event loop, over the same models, request path, metrics and API key.

- service.py  the RPCs: health, metadata, config, statistics, the repository extension, ModelInfer and the
              decoupled ModelStreamInfer, each a thin layer over `server/triton/`
- tensors.py  ModelInferRequest inputs (raw or typed contents) -> the values HTTP `infer` reads; outputs back
- status.py   the server's errors -> gRPC status codes; the `authorization: Bearer <key>` check

The messages are the ones `tritonclient` ships generated (`tritonclient.grpc.service_pb2`): the protocol of every
Triton gRPC client (tritonclient.grpc, perf_analyzer, genai-perf's default Triton mode).

    server, port = await start_grpc_server(ctx, "127.0.0.1", 8001, api_key=None)   # inside the running loop
    ...
    await server.stop(grace=3)
"""

from __future__ import annotations

import grpc
from tritonclient.grpc import service_pb2_grpc

from specserve.server.grpc.service import InferenceService
from specserve.server.grpc.status import RequireApiKey
from specserve.server.request import ServerContext


async def start_grpc_server(ctx: ServerContext, host: str, port: int,
                            api_key: str | None = None) -> tuple[grpc.aio.Server, int]:
    """Start serving on host:port (0: any free port) in the running event loop: (the server, the bound port).
    RuntimeError when the address cannot be bound."""
    options = [
        ("grpc.so_reuseport", 0),  # gRPC's default would let a second server share the port silently
        ("grpc.max_receive_message_length", ctx.limits.max_body_bytes),  # HTTP's body limit: RESOURCE_EXHAUSTED
        ("grpc.max_send_message_length", -1),
    ]
    server = grpc.aio.server(interceptors=[RequireApiKey(api_key)] if api_key else None, options=options)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(ctx), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_insecure_port(address)
    await server.start()
    return server, bound
