"""The HTTP app (Triton v2 + OpenAI on one port), the metrics app, and running both with uvicorn, with the KServe
gRPC server (`server/grpc/`) in the same event loop.

    repo = build_repository(model_repository=None, model=None)    # the default model under the seeds' names
    repo.load_all()
    server = SpecServer(repo, host="127.0.0.1", http_port=8000, metrics_port=8002, grpc_port=8001)
    server.run()                                                   # or .start() / .stop() in a background thread
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import threading
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from specserve.config import (ConfigError, DeploymentConfig, ServingConfig, SpeculativeConfig, load_model_yaml,
                              resolve_tensor_parallel_size)
from specserve.server import openai, triton
from specserve.server.grpc import start_grpc_server
from specserve.server.metrics import CONTENT_TYPE, ServerMetrics
from specserve.server.openai import protocol as openai_protocol
from specserve.server.repository import (DEFAULT_MAX_QUEUE_SIZE, LLMAPI, VLLM, ModelRepository, default_name,
                                         load_model_json, single_model_sources)
from specserve.server.request import RequestLimits, ServerContext
from specserve.speculative.registry import DEFAULT_METHOD
from specserve.server.triton import protocol as triton_protocol

log = logging.getLogger("specserve.server")


def default_config() -> DeploymentConfig:
    """`specserve serve` with no model: the embedded default with the default method, streaming allowed."""
    return DeploymentConfig(serving=ServingConfig(max_batch_size=0, decoupled=True),
                            speculative=SpeculativeConfig(DEFAULT_METHOD))


def build_repository(model_repository: str | Path | None = None, model: str | None = None,
                     max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE, engine_factory=None,
                     method_settings: dict | None = None, tensor_parallel_size: int | None = None) -> ModelRepository:
    """The models `specserve serve` serves: a Triton model repository, one model (a checkpoint, a .gguf, a
    model.yaml or a vLLM model.json), or the embedded default. `method_settings`: speculative_config keys from the
    command line, for the models whose method reads them. `tensor_parallel_size`: the one model's, over its config
    (under torchrun: WORLD_SIZE when neither sets it). Raises ConfigError."""
    if model_repository and model:
        raise ConfigError("give either --model-repository or --model, not both")
    if model_repository and tensor_parallel_size is not None:
        raise ConfigError("--tensor-parallel-size applies to --model; a repository's models set tensor_parallel_size "
                          "in their model.yaml / model.json")
    if model_repository:
        return ModelRepository.from_directory(Path(model_repository), max_queue_size=max_queue_size,
                                              engine_factory=engine_factory, method_settings=method_settings)
    kind, name = LLMAPI, None
    if model is None:
        config = default_config()
    elif model.endswith((".yaml", ".yml")):
        config = load_model_yaml(Path(model))
        name = _triton_layout_name(Path(model))
    elif model.endswith(".json"):
        config, kind = load_model_json(Path(model)), VLLM
        name = _triton_layout_name(Path(model))
    else:
        config = default_config()
        config.model.source = model
    config.model.tensor_parallel_size = resolve_tensor_parallel_size(tensor_parallel_size,
                                                                     config.model.tensor_parallel_size)
    sources = single_model_sources(config, kind=kind, name=name or default_name(config.model.source),
                                   max_queue_size=max_queue_size)
    return ModelRepository(sources, engine_factory=engine_factory, max_queue_size=max_queue_size,
                           method_settings=method_settings)


def _triton_layout_name(path: Path) -> str | None:
    """<repo>/<name>/<version>/model.yaml -> <name>."""
    path = path.resolve()
    return path.parent.parent.name if path.parent.name.isdigit() else None


# ------------------------------------------------------------------------------------------------------------------


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (404 no route, 405 wrong method) in the format of the API the path belongs to."""
    if request.url.path.startswith("/v1"):
        return openai_protocol.error_json(exc.detail, exc.status_code)
    return triton_protocol.error_json(exc.detail, exc.status_code, headers=getattr(exc, "headers", None))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    if request.url.path.startswith("/v1"):
        return openai_protocol.error_json(f"internal error: {exc}", 500)
    return triton_protocol.error_json(f"internal error: {exc}", 500)


OPEN_PATHS = ("/v2/health/live", "/v2/health/ready", "/health", "/health/ready", "/metrics")  # no API key needed


class RequireApiKey:
    """ASGI middleware: with an API key set, every route but health and metrics wants `Authorization: Bearer
    <key>` (as vLLM's --api-key); others get 401 in their API's error format."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "Unauthorized: a valid API key is required (Authorization: Bearer <key>)"
                api = openai_protocol if scope["path"].startswith("/v1") else triton_protocol
                await api.error_json(message, 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(ctx: ServerContext, api_key: str | None = None) -> Starlette:
    ctx.metrics.runner_source = lambda: [(m.name, m.deployment.runner) for m in ctx.repository.ready_models()
                                         if m.deployment is not None]

    async def metrics(request: Request) -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    routes = triton.routes() + openai.routes() + [Route("/metrics", metrics, methods=["GET"])]
    middleware = [Middleware(RequireApiKey, api_key=api_key)] if api_key else []
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    app.state.ctx = ctx
    return app


def create_metrics_app(metrics: ServerMetrics) -> Starlette:
    async def endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return Starlette(routes=[Route("/metrics", endpoint, methods=["GET"])],
                     exception_handlers={HTTPException: _http_error})


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only then; without it every response on a
    # kept-alive connection waited for the client's delayed ACK (Nagle)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


class SpecServer:
    """The listeners (HTTP, metrics and, with a `grpc_port`, gRPC) in one event loop; `run()` blocks, `start()`
    runs it in a thread. `grpc_port=None`: no gRPC (`specserve serve` opens 8001 unless --allow-grpc false)."""

    def __init__(self, repository: ModelRepository, host: str = "127.0.0.1", http_port: int = 8000,
                 metrics_port: int | None = 8002, metrics: ServerMetrics | None = None, log_level: str = "warning",
                 model_control_mode: str = "none", api_key: str | None = None,
                 limits: RequestLimits | None = None, chat_template: str | None = None,
                 tool_call_parser: str | None = None,
                 grpc_port: int | None = None):
        self.metrics = metrics or ServerMetrics()
        self.repository = repository
        # not ready until warm (see `serve`)
        self.ctx = ServerContext(repository, self.metrics, ready=False, limits=limits or RequestLimits(),
                                 model_control_mode=model_control_mode, chat_template=chat_template,
                                 tool_call_parser=tool_call_parser)
        for model in repository.ready_models():
            self.metrics.register_model(model.name, model.version, model.deployment.load_seconds)
        repository.on_load = lambda m: self.metrics.register_model(m.name, m.version, m.deployment.load_seconds)
        self.host = host
        self.app = create_app(self.ctx, api_key)
        self.metrics_app = create_metrics_app(self.metrics)
        self._socks = [bind(host, http_port)]
        if metrics_port is not None:
            self._socks.append(bind(host, metrics_port))
        self.http_port = self._socks[0].getsockname()[1]
        if grpc_port:  # gRPC binds in the event loop: a port taken now fails here, with the others' errors
            bind(host, grpc_port).close()
        self._grpc_wanted, self.grpc_port, self._api_key = grpc_port is not None, grpc_port, api_key
        self._grpc = None  # the grpc.aio server while serving
        self.metrics_port = self._socks[1].getsockname()[1] if metrics_port is not None else None
        self._servers = [uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False,
                                                       timeout_graceful_shutdown=3, lifespan="off"))
                         for app in [self.app, self.metrics_app][:len(self._socks)]]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.http_port}"

    @property
    def metrics_url(self) -> str | None:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.metrics_port}/metrics" if self.metrics_port else None

    @property
    def grpc_address(self) -> str | None:
        """host:port of the gRPC server once it listens (what tritonclient.grpc takes as its url)."""
        if self._grpc is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.grpc_port}"

    async def serve(self) -> None:
        warm_up = None
        try:
            if self._grpc_wanted:
                self._grpc, self.grpc_port = await start_grpc_server(self.ctx, self.host, self.grpc_port,
                                                                     self._api_key)
            tasks = [asyncio.ensure_future(s.serve(sockets=[sock])) for s, sock in zip(self._servers, self._socks)]
            warm_up = asyncio.ensure_future(self._warm_up())
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)  # one stops (signal, error): all stop
            for server in self._servers:
                server.should_exit = True
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(result, BaseException):
                    raise result
        finally:
            if warm_up is not None:
                warm_up.cancel()
            self.ctx.ready = False
            if self._grpc is not None:
                await self._grpc.stop(grace=3)  # streams still open are cancelled, with their requests
            self.repository.close()

    async def _warm_up(self) -> None:
        """Ready means warm: each loaded model runs one short request before the health routes say ready (once per
        runner: the names of one group, e.g. the default's tutorial aliases, share theirs)."""
        runners = {id(model.runner): model for model in self.repository.ready_models()}
        for model in runners.values():
            await self.ctx.warm_up(model)
        self.ctx.ready = True
        log.info("warm: ready")

    def run(self) -> None:
        asyncio.run(self.serve())

    def start(self, timeout: float = 30.0) -> SpecServer:
        self._thread = threading.Thread(target=self.run, name="specserve-http", daemon=True)
        self._thread.start()
        ready = threading.Event()

        def started() -> bool:
            grpc_up = self._grpc is not None or not self._grpc_wanted
            return all(s.started for s in self._servers) and grpc_up and self.ctx.ready

        for _ in range(int(timeout / 0.02)):
            if started() or not self._thread.is_alive():
                break
            ready.wait(0.02)
        if not started():
            raise RuntimeError("the server did not start")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        for server in self._servers:
            server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
