"""Speculative decoding counters, merged into LLMEngine.get_metrics()."""

from __future__ import annotations


class SpecStats:
    """Per verify step (a decode step that carried >= 1 draft): drafts, accepted drafts, and
    which draft positions were accepted. Acceptance length = accepted drafts + 1 (the bonus or
    corrected token), so a step that rejects everything still emits one token."""

    def __init__(self, k: int, method: str, produces_model_output: bool) -> None:
        self.k, self.method = k, method
        self.produces_model_output = produces_model_output
        self.num_verify_steps = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.drafted_at = [0] * k  # steps that proposed a draft at position j
        self.accepted_at = [0] * k  # ... and accepted it

    def record(self, num_drafts: int, num_accepted_drafts: int) -> None:
        assert 0 <= num_accepted_drafts <= num_drafts <= self.k
        self.num_verify_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted_drafts
        for j in range(num_drafts):
            self.drafted_at[j] += 1
            self.accepted_at[j] += j < num_accepted_drafts

    def as_dict(self) -> dict[str, object]:
        steps = self.num_verify_steps
        return {
            "spec_method": self.method,
            "spec_num_speculative_tokens": self.k,
            "spec_verify_steps": steps,
            "spec_mean_acceptance_length": (self.num_accepted_tokens + steps) / steps if steps else 0.0,
            "spec_acceptance_rate_per_position": [
                a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)
            ],
            # False only for the synthetic drafter: its accepted tokens are forced, not verified.
            "spec_output_is_model_output": self.produces_model_output,
        }
