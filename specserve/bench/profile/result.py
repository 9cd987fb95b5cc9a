"""What a `specserve profile` run measured: its requests, metrics and where its exports went (run.py makes it,
exports.py writes it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specserve.bench.profile.clients import Style
from specserve.bench.profile.config import ProfileConfig
from specserve.bench.profile.metrics import RequestRecord


@dataclass
class ProfileResult:
    config: ProfileConfig
    records: list[RequestRecord]
    stats: dict
    per_request: list[dict | None]
    input_tokens: list[int]
    output_tokens: list[int | None]
    server_spec: dict | None
    perf: dict | None
    export_file: Path
    genai_perf_json: Path
    genai_perf_csv: Path
    style: Style
    tokenizer_name: str
    window: tuple[int, int]

    @property
    def failed(self) -> list[RequestRecord]:
        return [r for r in self.records if r.error]
