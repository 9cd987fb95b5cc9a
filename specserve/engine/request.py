"""What a request produces: text, token ids, finish reason and its per-request metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestMetrics:
    prompt_tokens: int = 0
    output_tokens: int = 0
    total_draft_tokens: int = 0
    total_accepted_draft_tokens: int = 0
    target_forwards: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # accepted count at draft position i
    drafts_per_position: list[int] = field(default_factory=list)  # drafted count at draft position i
    time_to_first_token_s: float = 0.0
    total_time_s: float = 0.0
    draft_time_s: float = 0.0  # of total_time_s, the time the method spent drafting

    @property
    def acceptance_rate(self) -> float:
        return self.total_accepted_draft_tokens / self.total_draft_tokens if self.total_draft_tokens else 0.0

    @property
    def acceptance_length(self) -> float:
        """tau: tokens emitted per target forward (plain decoding: 1.0)."""
        return self.output_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def drafted_steps(self) -> int:
        """Steps that verified a draft."""
        return self.drafts_per_position[0] if self.drafts_per_position else 0

    @property
    def undrafted_steps(self) -> int:
        """Decoding steps that verified no draft, as the speculation policy chose (nothing to look up, a draft gate
        closed, a draft length of 0 under load); the step that follows the prefill is not one of them."""
        return max(self.target_forwards - 1 - self.drafted_steps, 0)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def record_step(self, drafted: int, accepted: int, positions: int | None = None) -> None:
        """`positions`: draft positions the step covered (a chain: its length; a tree: its depth)."""
        self.target_forwards += 1
        self.total_draft_tokens += drafted
        self.total_accepted_draft_tokens += accepted
        for i in range(drafted if positions is None else positions):
            if i == len(self.drafts_per_position):
                self.drafts_per_position.append(0)
                self.accepted_per_position.append(0)
            self.drafts_per_position[i] += 1
            self.accepted_per_position[i] += int(i < accepted)

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(
            acceptance_rate=self.acceptance_rate,
            acceptance_length=self.acceptance_length,
            drafted_steps=self.drafted_steps,
            undrafted_steps=self.undrafted_steps,
            tokens_per_s=self.tokens_per_s,
        )
        return data


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    metrics: RequestMetrics
    logprobs: list | None = None  # [TokenLogprobs] per output token, when asked for
    prompt_logprobs: list | None = None  # [None, TokenLogprobs...] per prompt token, when asked for
