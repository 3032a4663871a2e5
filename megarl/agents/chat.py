"""Chat templates kept honest: an episode built turn by turn (the policy's tokens as sampled, each
observation rendered by the template) against the template's rendering of the whole conversation.

    chat = ChatTurns(tokenizer)
    ids = chat.observation_ids(messages, policy_turn_ids, "tool output")   # mask-0 tokens to append
    check = chat.check(messages, built_ids, segments)     # TemplateCheck: mismatched tokens, boundary
    check.warning()                                       # one line naming where they part

An observation's tokens are the template's text from the end of what the policy emitted (its stop
token, e.g. `<|im_end|>`) to the start of the next assistant turn, encoded once. So the template's
separator after the stop token (ChatML's `\\n`, which a policy stopping at `<|im_end|>` never
samples, verl #6921) is in the observation, with mask 0, and the sequence stays the template's.
Where a template rewrites earlier turns (Qwen3 drops the `<think>` of past assistant turns,
NeMo-RL #2821) or the sampled tokens are not the canonical encoding of their text, no append-only
sequence can equal the full rendering: the check counts the tokens that differ and names the
first boundary where they part, and training goes on with the tokens actually sampled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class TemplateCheck:
    """mismatched: positions where built and template tokens differ (over the built length, plus
    built tokens past the template's end); 0 = the built sequence is the template's (a template's
    own trailing separator after the last turn is not counted)."""

    mismatched: int
    position: int | None = None  # first differing token
    boundary: str | None = None  # the segment it falls in, "assistant turn 1" / "tool turn 0 (after assistant turn 0)"
    built_token: int | None = None
    template_token: int | None = None

    @property
    def ok(self) -> bool:
        return self.mismatched == 0

    def warning(self) -> str:
        if self.ok:
            return "the episode's tokens are the chat template's rendering"
        return (f"chat template: {self.mismatched} token(s) of the episode differ from the template's rendering, first at "
                f"token {self.position} in {self.boundary} (built {self.built_token}, template {self.template_token})")


def _ids(encoded) -> list[int]:
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):  # BatchEncoding in newer transformers
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


class ChatTurns:
    """Observation tokens from a tokenizer's chat template, and the check of a built episode."""

    def __init__(self, tokenizer: Any, role: str = "tool"):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("rollout.multi_turn.chat_template needs a tokenizer with a chat template (tokenizer_config.json "
                             "chat_template); this one has none: set rollout.multi_turn.chat_template=false")
        self.tokenizer, self.role = tokenizer, role

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        return _ids(self.tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True))

    def observation_ids(self, messages: Sequence[dict], turn_ids: Sequence[int], observation: str) -> list[int]:
        """`messages` ends with the assistant turn whose tokens were `turn_ids`: the tokens from
        the end of that turn to the next assistant turn's start, with `observation` as a tool message."""
        after = self.render([*messages, {"role": self.role, "content": observation}], add_generation_prompt=True)
        sampled = self.tokenizer.decode(list(turn_ids), skip_special_tokens=False)
        at = after.rfind(sampled, 0, len(self.render(messages, add_generation_prompt=False)))
        if not sampled or at < 0:  # the template rewrote the turn: continue after its rendering of it
            end = len(self.render(messages, add_generation_prompt=False))
        else:
            end = at + len(sampled)
        return _ids(self.tokenizer.encode(after[end:], add_special_tokens=False))

    def check(self, messages: Sequence[dict], built: Sequence[int], segments: Sequence[tuple[str, int]]) -> TemplateCheck:
        """`built`: the episode's prompt and response tokens; `segments`: (name, token count) of
        each part of it in order ("prompt", "assistant turn 0", "tool turn 0", ...)."""
        reference = _ids(self.tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=False))
        built = [int(t) for t in built]
        differing = [i for i, (a, b) in enumerate(zip(built, reference)) if a != b]
        over = max(len(built) - len(reference), 0)
        if not differing and not over:
            return TemplateCheck(0)
        first = differing[0] if differing else len(reference)
        name, start = segments[-1][0] if segments else "?", 0
        for seg, count in segments:
            if first < start + count:
                name = seg
                break
            start += count
        return TemplateCheck(len(differing) + over, first, name, built[first],
                             reference[first] if first < len(reference) else None)
