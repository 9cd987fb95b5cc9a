"""One method's tallies over a bench run (tokens, time, forwards, drafts) and its summary row, for specserve's
own methods and its peers alike (offline.py, native_llamacpp.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MethodRun:
    outputs: list[list[int]] = field(default_factory=list)
    output_tokens: int = 0
    seconds: float = 0.0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    warmup_s: float = 0.0
    method_state: dict = field(default_factory=dict)  # what the method held across requests at the end (its cache)

    def summary(self, ar: "MethodRun | None") -> dict:
        tps = self.output_tokens / self.seconds if self.seconds else 0.0
        equal = [a == b for a, b in zip(self.outputs, ar.outputs)] if ar else []
        return {
            "tokens_per_s": round(tps, 3),
            "acceptance_length": round(self.output_tokens / self.target_forwards, 4) if self.target_forwards else None,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
            "speedup_vs_ar": round(tps / (ar.output_tokens / ar.seconds), 4) if ar and ar.seconds else None,
            "outputs_equal_ar": all(equal) if equal else None,
            "outputs_equal_ar_fraction": round(sum(equal) / len(equal), 4) if equal else None,
            "step_ms": round(1e3 * self.seconds / self.target_forwards, 3) if self.target_forwards else None,
            "draft_ms_per_step": round(1e3 * self.draft_seconds / self.target_forwards, 3)
            if self.target_forwards else None,
            "total_output_tokens": self.output_tokens,
            "total_time_s": round(self.seconds, 3),
            "mean_ttft_s": round(sum(self.ttft) / len(self.ttft), 4) if self.ttft else None,
            "warmup_s": round(self.warmup_s, 3),
        } | self.method_state
