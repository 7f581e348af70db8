"""Token-exact multi-turn trajectories: the ids trained on are the engine's sampled ids plus the tokens of the
messages inserted between turns, never a re-tokenisation of sampled text.

At each turn the conversation is rendered with the chat template as text. The rendering after the new messages must
start with the rendering the engine saw plus the sampled text (the prefix property); only the text after that is
tokenised and appended (loss mask 0). A template that renders earlier turns differently once a new message arrives
(Qwen3 drops earlier reasoning, a template that trims replies) breaks the property: `TemplateBreak` names the turn,
and the caller stops or starts a new segment (a new row whose prompt is the re-rendered conversation).

Message contents are data, never markup: text an environment, a tool or a user wrote that spells a special token
(`<|im_start|>user ...`) is tokenised as plain text, so it cannot forge a turn. Only the template's own text becomes
special tokens (the contents are located by rendering the messages with placeholders in their place).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SHOWN_CHARS = 60  # how much of a differing rendering an error shows


class TemplateBreak(ValueError):
    """The chat template renders the conversation so far differently once new messages follow (names the turn)."""


@dataclass
class Segment:
    """One trained row: `prompt_ids` then `response_ids`; `loss_mask` 1 on sampled tokens, `log_probs` the
    engine's log-probs there (0 elsewhere), `versions` the weight version that sampled each token (-1 elsewhere or
    where the engine did not say)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def context(self) -> list[int]:
        """What the engine continues from: the prompt and everything after it."""
        return self.prompt_ids + self.response_ids

    def truncate(self, length: int) -> None:
        """Drop response tokens past `length` (inserted messages that did not fit the budget)."""
        del self.response_ids[length:], self.loss_mask[length:], self.log_probs[length:], self.versions[length:]

    def append(
        self,
        ids: Sequence[int],
        sampled: bool,
        log_probs: Sequence[float] | None = None,
        versions: Sequence[int] | None = None,
    ) -> None:
        self.response_ids.extend(ids)
        self.loss_mask.extend([1 if sampled else 0] * len(ids))
        self.log_probs.extend(list(log_probs) if log_probs is not None else [0.0] * len(ids))
        self.versions.extend(list(versions) if versions is not None else [-1] * len(ids))


@dataclass
class Conversation:
    """A trajectory's messages (assistant turns hold the sampled text as rendered) and its segments."""

    messages: list[dict]
    rendered: str  # the template's text of `messages` with the generation prompt, plus the last sampled text
    segments: list[Segment]
    turns: int = 0  # assistant turns sampled
    sampled_tokens: int = 0
    stopped_on_eos: bool = False  # the last sampled turn ended with an end-of-turn token (not cut by max_tokens)
    breaks: int = 0  # template breaks that started a new segment

    @property
    def current(self) -> Segment:
        return self.segments[-1]


class ChatTurns:
    """Builds token-exact conversations with one tokenizer's chat template (and tool schemas, when any)."""

    def __init__(self, tokenizer, tools: Sequence[Mapping[str, Any]] | None = None, on_break: str = "error"):
        if on_break not in ("error", "new_segment"):
            raise ValueError(f"agentic.on_template_break={on_break!r}; choose 'error' or 'new_segment'")
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.on_break = on_break
        self.eos_ids = _end_of_turn_ids(tokenizer)
        self._specials: re.Pattern | None = None

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        kwargs = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_text(self, text: str) -> list[int]:
        """`text` as plain text: a special token's spelling in it stays characters."""
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def start(self, messages: Sequence[Mapping[str, Any]]) -> Conversation:
        messages = [dict(m) for m in messages]
        rendered = self.render(messages)
        return Conversation(messages, rendered, [Segment(self._encode_after([], messages, "", rendered))])

    def empty(self) -> Conversation:
        """A trajectory that never reached the engine (its environment failed at reset): one token, nothing trained."""
        token = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return Conversation([], "", [Segment([token])])

    def add_sampled(
        self,
        conv: Conversation,
        token_ids: Sequence[int],
        log_probs: Sequence[float],
        versions: Sequence[int] | None = None,
    ) -> str:
        """Record one sampled turn (ids, the engine's log-probs and, where known, each token's weight version);
        returns its text (the assistant message)."""
        ids = list(token_ids)
        stopped = bool(ids) and ids[-1] in self.eos_ids
        text = self.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
        conv.current.append(ids, sampled=True, log_probs=log_probs, versions=versions)
        conv.messages.append({"role": "assistant", "content": text})
        conv.rendered += text
        conv.turns += 1
        conv.sampled_tokens += len(ids)
        conv.stopped_on_eos = stopped
        return text

    def _encode_after(self, earlier: list[dict], new: list[dict], seen: str, rendered: str) -> list[int]:
        """The ids of `rendered` after `seen` (the template's text of `earlier + new`): the template's markup as
        tokens, the new messages' contents as plain text."""
        text = rendered[len(seen) :]
        specials = self._special_texts()
        carriers = [  # the model's own replies are its sampled tokens, not data to guard
            i
            for i, m in enumerate(new)
            if m.get("role") != "assistant" and isinstance(m.get("content"), str) and specials.search(m["content"])
        ]
        if not carriers:
            return self.encode(text)
        mark_of = {i: f"ROLLDATA{secrets.token_hex(8)}" for i in carriers}  # letters and digits: templates keep them
        marks = {mark: i for i, mark in mark_of.items()}
        template = self.render(
            earlier + [dict(m, content=mark_of[i]) if i in mark_of else m for i, m in enumerate(new)]
        )
        ids, rebuilt = [], ""
        for piece in re.split(f"({'|'.join(marks)})", template[len(seen) :] if template.startswith(seen) else ""):
            if piece in marks:
                content = new[marks[piece]]["content"]
                ids += self.encode_text(content)
                rebuilt += content
            elif piece:
                ids += self.encode(piece)
                rebuilt += piece
        if rebuilt == text:
            return ids
        # The template changes contents (trims them, say): spell the markup in them apart, render and encode that.
        spelled_apart = lambda content: specials.sub(lambda match: "\u200b".join(match.group(0)), content)
        safe = [dict(m, content=spelled_apart(m["content"])) if i in mark_of else m for i, m in enumerate(new)]
        return self.encode(self.render(earlier + safe)[len(seen) :])

    def _special_texts(self) -> re.Pattern:
        """A pattern matching any special token's spelling (built once)."""
        if self._specials is None:
            added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
            spellings = {token.content for token in added.values() if getattr(token, "special", False)}
            spellings |= set(getattr(self.tokenizer, "all_special_tokens", []) or [])
            spellings = sorted((s for s in spellings if s), key=len, reverse=True)
            self._specials = re.compile("|".join(map(re.escape, spellings)) if spellings else r"(?!)")
        return self._specials

    def extend(self, conv: Conversation, new_messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Append messages after the last assistant turn; returns the ids inserted (loss mask 0).

        Raises TemplateBreak when the rendering with the new messages does not extend what the engine saw (with
        on_break="new_segment" a new segment starts instead, its prompt the whole new rendering)."""
        messages = conv.messages + [dict(m) for m in new_messages]
        rendered = self.render(messages)
        seen = conv.rendered
        if conv.stopped_on_eos:
            seen += self.tokenizer.decode(conv.current.response_ids[-1:], skip_special_tokens=False)
        if not rendered.startswith(seen):
            where = _first_difference(rendered, seen)
            message = (
                f"turn {conv.turns + 1}: the chat template renders the conversation so far differently once the new "
                f"messages follow (from character {where}: the engine saw {seen[where : where + SHOWN_CHARS]!r}, the "
                f"template now renders {rendered[where : where + SHOWN_CHARS]!r}); training on a re-tokenised "
                "history would not be what was sampled. Use a template that keeps earlier turns as they were, or "
                "set agentic.on_template_break: new_segment."
            )
            if self.on_break == "error":
                raise TemplateBreak(message)
            conv.messages, conv.rendered = messages, rendered
            conv.segments.append(Segment(self._encode_after([], messages, "", rendered)))
            conv.breaks += 1
            conv.stopped_on_eos = False
            return []
        inserted = self._encode_after(conv.messages, messages[len(conv.messages) :], seen, rendered)
        conv.current.append(inserted, sampled=False)
        conv.messages, conv.rendered = messages, rendered
        conv.stopped_on_eos = False
        return inserted


def _end_of_turn_ids(tokenizer) -> set[int]:
    """Token ids that end an assistant turn: EOS and, for chat models, the end-of-turn token if it has one."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for token in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    return ids


def _first_difference(a: str, b: str) -> int:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return min(len(a), len(b))
