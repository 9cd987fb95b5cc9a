"""The environment settings specserve reads (`SPECSERVE_*`), as one strict model checked when a command starts: a
bad value or an unknown name stops it with an error naming the variable, instead of failing at the first forward
(or never). The code that uses a setting reads the variable where it needs it; this only vouches for its value."""

from __future__ import annotations

import os
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specserve.checks import ConfigError
from specserve.models import cpu_kernels

PREFIX = "SPECSERVE_"


class EnvironmentSettings(BaseModel):
    """Each field is the variable of its name; an empty value counts as unset."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    SPECSERVE_KERNELS: Literal[cpu_kernels.MODES] = "auto"  # the compiled variant, quantized path included
    SPECSERVE_GREEDY_SCREEN: Literal["0", "1"] = "1"  # 0: greedy forwards compute the full logits
    SPECSERVE_CACHE: Optional[str] = None  # the cache directory (default ~/.cache/specserve)
    SPECSERVE_TP_CONNECT_TIMEOUT: Optional[float] = Field(None, gt=0)  # seconds for the ranks to join and load
    SPECSERVE_TP_STEP_TIMEOUT: Optional[float] = Field(None, gt=0)  # seconds a rank waits in one collective
    SPECSERVE_TP_LOAD_TIMEOUT: Optional[float] = Field(None, gt=0)  # seconds a rank waits for the others to load
    SPECSERVE_API_KEY: Optional[str] = None  # `serve --api-key`
    SPECSERVE_LLAMA_SERVER: Optional[str] = None  # the bench's natively built llama-server


def check_environment(environ: dict[str, str] | None = None) -> EnvironmentSettings:
    """The SPECSERVE_* variables of `environ` (os.environ by default) as EnvironmentSettings; ConfigError naming the
    first bad one."""
    environ = os.environ if environ is None else environ
    given = {name: value for name, value in environ.items() if name.startswith(PREFIX) and value != ""}
    try:
        settings = EnvironmentSettings(**given)
    except ValidationError as exc:
        error = exc.errors()[0]
        name = str(error["loc"][0]) if error["loc"] else "a SPECSERVE_ variable"
        if error["type"] == "extra_forbidden":
            known = ", ".join(EnvironmentSettings.model_fields)
            raise ConfigError(f"unknown environment setting {name}; known: {known}") from None
        raise ConfigError(f"environment setting {name}={given.get(name)!r}: {error['msg']}") from None
    return settings
