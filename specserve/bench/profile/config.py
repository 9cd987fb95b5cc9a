"""`specserve profile`'s configuration: the genai-perf flags, what genai-perf infers from them, and their checks."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

SERVICE_KINDS = ("triton", "openai")
BACKENDS = ("tensorrtllm", "vllm")
ENDPOINT_TYPES = ("kserve", "generate", "completions", "chat")
DISTRIBUTIONS = ("constant", "poisson")


class ProfileError(Exception):
    """A problem the user can fix (bad flag, input file, server, model): printed without a traceback."""


@dataclass
class ProfileConfig:
    model: str
    input_file: Path
    service_kind: str = "triton"
    backend: str = "tensorrtllm"
    endpoint_type: str | None = None
    endpoint: str | None = None
    streaming: bool = False
    tokenizer: str | None = None
    url: str = "localhost:8000"
    concurrency: int | None = None
    request_rate: float | None = None
    request_distribution: str = "constant"
    request_count: int = 10
    warmup_request_count: int = 2
    output_tokens_mean: int | None = None
    output_tokens_stddev: float = 0.0
    output_tokens_mean_deterministic: bool = False
    extra_inputs: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    profile_export_file: Path = Path("profile_export.json")
    artifact_dir: Path | None = None
    server_metrics_url: str | None = None
    random_seed: int = 0
    request_timeout: float = 600.0
    progress: bool = False

    def normalize(self) -> "ProfileConfig":
        """Fill in what genai-perf infers and check the combination; raises ProfileError."""
        if not self.model:
            raise ProfileError("give the model to profile with -m/--model")
        if self.service_kind not in SERVICE_KINDS:
            raise ProfileError(f"--service-kind must be one of {', '.join(SERVICE_KINDS)}, got {self.service_kind!r}")
        if self.backend not in BACKENDS:
            raise ProfileError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.endpoint_type is not None and self.endpoint_type not in ENDPOINT_TYPES:
            raise ProfileError(f"--endpoint-type must be one of {', '.join(ENDPOINT_TYPES)}, "
                               f"got {self.endpoint_type!r}")
        # newer genai-perf infers the service kind from the endpoint type
        if self.endpoint_type in ("completions", "chat"):
            self.service_kind = "openai"
        elif self.endpoint_type in ("kserve", "generate"):
            self.service_kind = "triton"
        if self.service_kind == "openai" and self.endpoint_type is None:
            raise ProfileError("--service-kind openai needs --endpoint-type completions or chat")
        if self.service_kind == "triton":
            self.endpoint_type = self.endpoint_type or "kserve"
        if self.concurrency is not None and self.request_rate is not None:
            raise ProfileError("--concurrency and --request-rate are mutually exclusive: give one")
        if self.request_rate is None and self.concurrency is None:
            self.concurrency = 1
        if self.concurrency is not None and self.concurrency < 1:
            raise ProfileError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and not (self.request_rate > 0 and math.isfinite(self.request_rate)):
            raise ProfileError(f"--request-rate must be > 0, got {self.request_rate}")
        if self.request_distribution not in DISTRIBUTIONS:
            raise ProfileError(f"--request-distribution must be constant or poisson, "
                               f"got {self.request_distribution!r}")
        if self.request_count < 1:
            raise ProfileError(f"--request-count must be >= 1, got {self.request_count}")
        if self.warmup_request_count < 0:
            raise ProfileError(f"--warmup-request-count must be >= 0, got {self.warmup_request_count}")
        if self.output_tokens_mean is not None and self.output_tokens_mean < 1:
            raise ProfileError(f"--output-tokens-mean must be >= 1, got {self.output_tokens_mean}")
        if self.output_tokens_stddev < 0:
            raise ProfileError(f"--output-tokens-stddev must be >= 0, got {self.output_tokens_stddev}")
        if self.output_tokens_mean_deterministic and self.output_tokens_mean is None:
            raise ProfileError("--output-tokens-mean-deterministic needs --output-tokens-mean")
        if self.request_timeout <= 0:
            raise ProfileError("--request-timeout must be > 0")
        self.base_url()  # validates --url
        self.profile_export_file = Path(self.profile_export_file)
        if self.profile_export_file.suffix != ".json":
            raise ProfileError(f"--profile-export-file must end in .json, got {self.profile_export_file}")
        return self

    def base_url(self) -> str:
        url = self.url.strip().rstrip("/")
        if "://" not in url:
            url = "http://" + url
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ProfileError(f"--url must be HOST:PORT (or http://HOST:PORT), got {self.url!r}")
        try:
            parts.port
        except ValueError:
            raise ProfileError(f"--url has a bad port: {self.url!r}") from None
        return url

    @property
    def load_mode(self) -> tuple[str, float]:
        return ("concurrency", self.concurrency) if self.request_rate is None else ("request_rate", self.request_rate)

    def artifact_paths(self) -> tuple[Path, Path]:
        """(artifact directory, profile export file). genai-perf: artifacts/<model>-<kind>-<backend or endpoint
        type>-concurrency<N>/<profile export file>; a --profile-export-file with a directory is used as is."""
        export = self.profile_export_file
        if self.artifact_dir is not None:
            if export.parent != Path("."):
                raise ProfileError("give --profile-export-file as a plain file name when --artifact-dir is given")
            directory = Path(self.artifact_dir)
        elif export.parent != Path("."):
            directory = export.parent
        else:
            flavour = self.backend if self.service_kind == "triton" else self.endpoint_type
            mode, value = self.load_mode
            level = f"concurrency{int(value)}" if mode == "concurrency" else f"request_rate{value:g}"
            directory = Path("artifacts") / f"{self.model.replace('/', '_')}-{self.service_kind}-{flavour}-{level}"
        return directory, directory / export.name

    def to_json(self) -> dict:
        out = asdict(self)
        for key in ("input_file", "profile_export_file", "artifact_dir"):
            out[key] = None if out[key] is None else str(out[key])
        out.pop("progress", None)
        return out
