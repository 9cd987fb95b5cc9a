"""The model repository: Triton's layout, model.yaml (TRT-LLM LLM API) and model.json (vLLM backend) configs,
loading / unloading, and the names models are served under.

    <repo>/<name>/config.pbtxt          optional: backend / platform / max_batch_size / decoupled / max_queue_size
    <repo>/<name>/<version>/model.yaml  TRT-LLM LLM-API form (specserve.config.load_model_yaml)
    <repo>/<name>/<version>/model.json  vLLM backend form (specserve.config_vllm.load_model_json)

Each served name has a *kind* that decides its request/response conventions: `llmapi` (TRT-LLM LLM-API model
`tensorrt_llm`), `vllm` (vLLM backend) or `ensemble` (the legacy inflight_batcher_llm ensemble).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from specserve.config import ConfigError, DeploymentConfig, build_engine, load_model_yaml, with_method_settings
from specserve.config_vllm import load_model_json
from specserve.models.loader import DEFAULT_MODEL, ModelLoadError
from specserve.server.compute import COMPUTE
from specserve.server.runner import DEFAULT_MAX_ACTIVE, Runner

log = logging.getLogger("specserve.server")

LLMAPI, VLLM, ENSEMBLE = "llmapi", "vllm", "ensemble"
# The names the seeds' curl lines use, served by `specserve serve` without a repository (one engine behind all)
DEFAULT_ALIASES = {"tensorrt_llm": LLMAPI, "ensemble": ENSEMBLE, "vllm_model": VLLM, "eagle_model": VLLM}
DEFAULT_MAX_QUEUE_SIZE = 64


class RepositoryError(Exception):
    """A failed load or unload (HTTP statuses: server/errors.py)."""


class ModelNotFoundError(RepositoryError):
    pass


class ModelNotReadyError(RepositoryError):
    pass


# ------------------------------------------------------------------------------------------------------------------
# config files


def parse_pbtxt(text: str, where: str = "config.pbtxt") -> dict:
    """The config.pbtxt fields specserve uses (backend, platform, name, max_batch_size, decoupled, max_queue_size),
    read as Triton reads the file: protobuf's text format into its ModelConfig (tritonclient's model_config_pb2).
    A typo, a field Triton does not have or a template placeholder left unfilled is a ConfigError naming the line."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    out: dict = {key: getattr(config, key) for key in ("backend", "platform", "name") if getattr(config, key)}
    if config.max_batch_size < 0:
        raise ConfigError(f"{where}: max_batch_size must be >= 0, got {config.max_batch_size}")
    if config.max_batch_size:  # 0, as absent: the model.yaml's triton_config decides
        out["max_batch_size"] = config.max_batch_size
    if config.HasField("model_transaction_policy"):
        out["decoupled"] = config.model_transaction_policy.decoupled
    if config.dynamic_batching.default_queue_policy.max_queue_size:
        out["max_queue_size"] = config.dynamic_batching.default_queue_policy.max_queue_size
    return out


# ------------------------------------------------------------------------------------------------------------------
# what is served


@dataclass
class ModelSource:
    """How to build one served name (rebuilt from the repository on every explicit load)."""

    name: str
    kind: str = LLMAPI
    config: DeploymentConfig | None = None  # None: not servable, see error
    version: str = "1"
    versions: tuple[str, ...] = ("1",)
    path: Path | None = None
    decoupled: bool = False
    max_batch_size: int = 0
    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE
    error: str | None = None
    broken: bool = False  # True: it has a model file, but the file is wrong (a load error, not a skip)
    group: str = ""  # names with the same group share one engine when loaded together

    @property
    def platform(self) -> str:
        return {LLMAPI: "python", VLLM: "vllm", ENSEMBLE: "ensemble"}[self.kind]

    @property
    def backend(self) -> str:
        return {LLMAPI: "python", VLLM: "vllm", ENSEMBLE: ""}[self.kind]


def read_model_dir(model_dir: Path, max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE) -> ModelSource:
    """One repository entry -> ModelSource (config errors raise ConfigError; a directory without a model.yaml or
    model.json, such as the legacy preprocessing/postprocessing models, gives a source with .error set)."""
    name = model_dir.name
    pbtxt = {}
    if (model_dir / "config.pbtxt").is_file():
        pbtxt = parse_pbtxt((model_dir / "config.pbtxt").read_text(errors="replace"), str(model_dir / "config.pbtxt"))
    versions = sorted((p.name for p in model_dir.iterdir()
                       if p.is_dir() and p.name.isdigit()
                       and ((p / "model.yaml").is_file() or (p / "model.json").is_file())), key=int)
    source = ModelSource(name=name, path=model_dir, group=name,
                         max_queue_size=pbtxt.get("max_queue_size", max_queue_size))
    if not versions:
        source.error = f"no <version>/model.yaml or <version>/model.json in {model_dir}"
        return source
    source.versions = tuple(versions)
    source.version = versions[-1]
    version_dir = model_dir / source.version
    if (version_dir / "model.json").is_file():
        source.kind = VLLM
        source.config = load_model_json(version_dir / "model.json")
        source.decoupled, source.max_batch_size = True, 0  # the vLLM backend's auto-complete forces these
        return source
    source.config = load_model_yaml(version_dir / "model.yaml")
    if pbtxt.get("backend") == "vllm":
        source.kind = VLLM
    elif pbtxt.get("platform") == "ensemble" or (name == "ensemble" and "backend" not in pbtxt):
        source.kind = ENSEMBLE
    source.decoupled = pbtxt.get("decoupled", source.config.serving.decoupled)
    source.max_batch_size = pbtxt.get("max_batch_size", source.config.serving.max_batch_size)
    return source


def default_name(model: str) -> str:
    """The name a model is known by (OpenAI's `model`): the checkpoint directory / file stem."""
    if model in ("", DEFAULT_MODEL):
        return DEFAULT_MODEL
    path = Path(model)
    return path.stem if path.suffix in (".gguf", ".bin", ".yaml", ".yml", ".json") else path.name or model


def single_model_sources(config: DeploymentConfig, kind: str = LLMAPI, name: str | None = None,
                         max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE,
                         aliases: dict[str, str] | None = None) -> list[ModelSource]:
    """One engine served under its own name (of `kind`) plus the seeds' names (tensorrt_llm, ensemble, ...)."""
    name = name or default_name(config.model.source)
    names = {name: kind}
    for alias, alias_kind in (DEFAULT_ALIASES if aliases is None else aliases).items():
        names.setdefault(alias, alias_kind)
    return [ModelSource(name=n, kind=k, config=config, decoupled=config.serving.decoupled,
                        max_batch_size=0 if k == VLLM else config.serving.max_batch_size, max_queue_size=max_queue_size,
                        group="default") for n, k in names.items()]


class Deployment:
    """One engine and its runner; shared by the names of one group."""

    def __init__(self, config: DeploymentConfig, engine, runner: Runner, load_seconds: float):
        self.config = config
        self.engine = engine
        self.runner = runner
        self.load_seconds = load_seconds

    @property
    def failure(self) -> str | None:
        """Why the model can no longer serve (a tensor-parallel rank failed), or None."""
        failure = getattr(getattr(self.engine, "model", None), "failure", None)
        return failure if isinstance(failure, str) else None


@dataclass
class ServedModel:
    source: ModelSource
    state: str = "UNAVAILABLE"  # READY | UNAVAILABLE | LOADING | UNLOADING
    reason: str = ""
    deployment: Deployment | None = None
    ever_loaded: bool = False
    aliases: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def version(self) -> str:
        return self.source.version

    @property
    def kind(self) -> str:
        return self.source.kind

    @property
    def failure(self) -> str | None:
        return None if self.deployment is None else self.deployment.failure

    @property
    def ready(self) -> bool:
        return self.state == "READY" and self.deployment is not None and self.failure is None

    @property
    def runner(self) -> Runner:
        return self.deployment.runner

    @property
    def engine(self):
        return self.deployment.engine


def _default_engine_factory(config: DeploymentConfig, target):
    return build_engine(config, target)


class ModelRepository:
    """The served names, their states, and load / unload. Loading is synchronous (call it from a thread)."""

    def __init__(self, sources: list[ModelSource], root: Path | None = None,
                 engine_factory: Callable | None = None, max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE,
                 on_load: Callable[[ServedModel], None] | None = None, method_settings: dict | None = None):
        self.root = Path(root) if root else None
        self.models: dict[str, ServedModel] = {s.name: ServedModel(s) for s in sources}
        self.engine_factory = engine_factory or _default_engine_factory
        self.max_queue_size = max_queue_size
        self.on_load = on_load
        self.method_settings = method_settings or {}  # operator flags for the methods that read them
        self._lock = threading.RLock()
        self._targets: dict[tuple, object] = {}

    # ---- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_directory(cls, root: Path, max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE, **kwargs) -> ModelRepository:
        root = Path(root)
        if not root.is_dir():
            raise ConfigError(f"model repository {root} is not a directory")
        repo = cls([], root=root, max_queue_size=max_queue_size, **kwargs)
        for model_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            repo.models[model_dir.name] = ServedModel(repo._read(model_dir.name))
        return repo

    def _read(self, name: str) -> ModelSource:
        """Read (or re-read) a repository entry; a config error becomes the source's error."""
        model_dir = self.root / name
        try:
            return read_model_dir(model_dir, self.max_queue_size)
        except (ConfigError, OSError) as exc:
            return ModelSource(name=name, path=model_dir, group=name, error=str(exc), config=None, broken=True)

    # ---- lookups ------------------------------------------------------------------------------------------------
    def get(self, name: str, version: str | None = None) -> ServedModel:
        """The ready model for a request, or ModelNotFoundError (404) / ModelNotReadyError (503)."""
        with self._lock:
            model = self.models.get(name)
        if model is not None and model.state == "READY" and model.failure is not None:
            raise ModelNotReadyError(f"model '{name}' is not ready: {model.failure}")
        if version in (None, ""):
            if model is None or not model.ready:
                raise ModelNotFoundError(f"Request for unknown model: '{name}' is not found")
            return model
        if model is not None and version == model.version and model.ready:
            return model
        if model is not None and version in model.source.versions:
            raise ModelNotReadyError(f"Request for unknown model: '{name}' version {version} is not at ready state")
        raise ModelNotFoundError(f"Request for unknown model: '{name}' version {version} is not found")

    def failures(self) -> dict[str, str]:
        """{name: why} of the loaded models that can no longer serve (a tensor-parallel rank failed)."""
        with self._lock:
            return {m.name: m.failure for m in self.models.values() if m.state == "READY" and m.failure}

    def ready_models(self) -> list[ServedModel]:
        with self._lock:
            return [m for m in self.models.values() if m.ready]

    def index(self, ready_only: bool = False) -> list[dict]:
        out = []
        with self._lock:
            for model in self.models.values():
                if ready_only and not model.ready:
                    continue
                entry = {"name": model.name}
                if model.ever_loaded or model.state != "UNAVAILABLE":
                    entry.update(version=model.version, state=model.state)
                    if model.reason:
                        entry["reason"] = model.reason
                    if model.state == "READY" and model.failure:
                        entry.update(state="UNAVAILABLE", reason=model.failure)
                out.append(entry)
        return out

    # ---- load / unload ------------------------------------------------------------------------------------------
    def load_all(self, names: list[str] | None = None) -> dict[str, str]:
        """Load every servable model (or the given names); returns {name: error} for the failures."""
        errors = {}
        for name in list(self.models) if names is None else names:
            source = self.models[name].source
            if names is None and source.config is None and not source.broken:
                log.warning("skipping %s: %s", name, source.error)
                continue
            try:
                self.load(name)
            except RepositoryError as exc:
                errors[name] = str(exc)
        return errors

    def load(self, name: str, overrides: dict | None = None) -> ServedModel:
        with self._lock:
            model = self.models.get(name)
            if self.root is not None and (self.root / name).is_dir():
                source = self._read(name)
            elif model is not None:
                source = model.source
            else:
                raise RepositoryError(f"failed to load '{name}', failed to poll from model repository")
            if source.config is None:
                if model is not None:
                    model.source, model.state, model.reason = source, "UNAVAILABLE", source.error or ""
                raise RepositoryError(f"failed to load '{name}': {source.error}")
            if overrides:
                source = replace(source, decoupled=overrides.get("decoupled", source.decoupled),
                                 max_batch_size=overrides.get("max_batch_size", source.max_batch_size))
            if model is None:
                model = self.models[name] = ServedModel(source)
            if model.ready and model.source == source:
                return model  # already loaded with this config
            old = model.deployment if model.ready else None
            model.source, model.state, model.reason = source, "LOADING", ""
            shared = next((m.deployment for m in self.models.values()
                           if m is not model and m.ready and m.source.group == source.group
                           and m.deployment.config == source.config), None)
        try:
            deployment = shared or self._build(source)
        except (ConfigError, ModelLoadError, OSError, ValueError, RuntimeError) as exc:
            with self._lock:
                model.state, model.reason = "UNAVAILABLE", str(exc)
            raise RepositoryError(f"failed to load '{name}': {exc}") from exc
        with self._lock:
            model.deployment, model.state, model.ever_loaded = deployment, "READY", True
        if old is not None and old is not deployment:
            self._release(old)
        log.info("loaded %s (%s, method %s)", name, source.kind, deployment.engine.method_name)
        if not getattr(deployment.engine, "lossless", True):
            log.warning("%s: Medusa typical acceptance is on: sampled outputs are NOT distributed as the target's "
                        "(greedy stays exact)", name)
        if self.on_load:
            self.on_load(model)
        return model

    def _build(self, source: ModelSource) -> Deployment:
        start = time.perf_counter()
        config = source.config
        key = target_key(config)
        with self._lock:
            target = self._targets.get(key)
        if target is None:
            target = COMPUTE.run(config.model.load)
            with self._lock:
                self._targets[key] = target
        engine = COMPUTE.run(self.engine_factory, with_method_settings(config, self.method_settings),
                             target)  # cost tables: tensor work too
        runner = Runner(engine, source.max_queue_size, name=source.name,
                        max_active=source.max_batch_size or DEFAULT_MAX_ACTIVE,
                        adaptive_draft=config.speculative.adaptive_draft_len)
        return Deployment(config, engine, runner, time.perf_counter() - start)

    def unload(self, name: str) -> None:
        with self._lock:
            model = self.models.get(name)
            if model is None:
                raise RepositoryError(f"failed to unload '{name}', no version is available")
            deployment, model.deployment = model.deployment, None
            model.state, model.reason = "UNAVAILABLE", "unloaded"
        if deployment is not None:
            self._release(deployment)

    def _release(self, deployment: Deployment) -> None:
        """Close a deployment's runner once no ready name uses it (in-flight requests finish first)."""
        with self._lock:
            if any(m.deployment is deployment for m in self.models.values()):
                return
            live = {target_key(m.deployment.config) for m in self.models.values() if m.deployment is not None}
            released = [self._targets.pop(key) for key in list(self._targets) if key not in live]
        threading.Thread(target=_close, args=(deployment, released), name="unload", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            deployments = {id(m.deployment): m.deployment for m in self.models.values() if m.deployment}
            for model in self.models.values():
                model.deployment, model.state = None, "UNAVAILABLE"
        for deployment in deployments.values():
            deployment.runner.close(cancel_running=True, timeout=5.0)
        with self._lock:
            targets, self._targets = list(self._targets.values()), {}
        for target in targets:
            close_target(target)


def target_key(config: DeploymentConfig) -> tuple:
    """Deployments whose configs have the same key share one loaded target."""
    model = config.model
    return (model.source, model.dtype, model.quantization, model.tensor_parallel_size)


def close_target(target) -> None:
    """Stop what a target runs besides this process (a tensor-parallel model's other ranks)."""
    close = getattr(getattr(target, "model", None), "close", None)
    if callable(close):
        close()


def _close(deployment: Deployment, targets: list) -> None:
    deployment.runner.close()
    for target in targets:
        close_target(target)
