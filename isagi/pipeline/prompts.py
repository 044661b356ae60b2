"""The prompt of a turn: a message checked against the limits, tokens counted, the history fitted.

Owns :class:`Prompts` (one per engine: its settings and its model's tokenizer and chat
template) and the pure helpers beside it: :func:`clean_message` (what of a message is
kept), :func:`prompt_messages` (the chat's order: system prompt, history, a related
exchange, the message), the token counts and the prompt budget.

The history is fitted in one place (:meth:`Prompts.history_window`): the block rule of
:func:`isagi.manifold.window.window_start` replayed over the session's exchanges, so the
window's start depends on the session's turns and the message alone and a long session's
prompt keeps its start (and its KV prefix) from turn to turn. A turn fits it once
(:meth:`Prompts.fitting_history`) and passes the result on.
"""

from __future__ import annotations

import unicodedata
from typing import TYPE_CHECKING

from isagi.config import Settings
from isagi.errors import InputError
from isagi.manifold.window import window_start
from isagi.session.state import Session

if TYPE_CHECKING:
    from isagi.engines.base import ModelEngine
    from isagi.manifold.memory import MemoryRecord


class Prompts:
    """Validation, token accounting and prompt building for one model and its settings."""

    def __init__(self, settings: Settings, lm: ModelEngine) -> None:
        self.settings = settings
        self.lm = lm
        self._template_counts: dict[str, tuple[int, int]] = {}  # per system prompt (_template_tokens)


    def validate(self, message: str) -> str:
        """The message as the turn uses it, or an :class:`InputError` saying what to change.

        Rejects undecodable text (lone surrogates, e.g. invalid UTF-8 on stdin),
        messages with nothing but control, format or blank characters, and messages
        over the character limit, the token limit, or the prompt budget on their own.
        Control characters other than newline and tab are removed from the rest.
        """
        text = clean_message(message)
        limit = self.settings.max_message_chars
        if len(text) > limit:
            raise InputError(
                f"The message has {len(text):,} characters; the limit is {limit:,}. "
                "Shorten it or split it into several messages."
            )
        n = count_tokens(self.lm, text)
        token_limit = self.settings.max_message_tokens
        if n > token_limit:
            raise InputError(
                f"The message is {n:,} tokens long; the limit is {token_limit:,} tokens. "
                "Shorten it or split it into several messages."
            )
        alone = prompt_tokens(self.lm, prompt_messages(self.settings.system_prompt, text))
        budget = prompt_budget(self.settings, self.lm)
        if alone > budget:
            raise InputError(
                f"The message and the system prompt take {alone:,} tokens; the prompt budget is {budget:,} "
                f"({self.settings.max_new_tokens:,} tokens are kept for the reply). Shorten the message."
            )
        return text

    # -- token accounting ------------------------------------------------------

    @property
    def budget(self) -> int:
        """Tokens a prompt may take (see :func:`prompt_budget`)."""
        return prompt_budget(self.settings, self.lm)

    def count_tokens(self, text: str) -> int:
        return count_tokens(self.lm, text)

    def prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        return prompt_tokens(self.lm, messages)

    def build(
        self, session: Session, text: str, related: MemoryRecord | None, *, with_history: bool = True,
        history: list[dict[str, str]] | None = None,
    ) -> list[dict[str, str]]:
        """The chat for the model: system prompt, history, a related exchange (AUGMENT), message.

        History is the window of :meth:`fitting_history` (``history``: this turn's, already
        fitted; the history is fitted once per turn); older turns stay in the session, only
        not in the prompt.
        """
        if related is not None and self.prompt_tokens(self.messages(text, related, [])) > self.budget:
            related = None  # the related exchange does not fit beside the message: answer without it
        if not with_history:
            history = []
        elif history is None:
            history = self.fitting_history(session, text)
        if related is not None and _holds_exchange(history, related):
            related = None  # the related exchange is in the history already: once is enough
        elif related is not None and with_history:
            history = self._fit(history, text, related)  # room for it beside the history
        return self.messages(text, related, history)

    def messages(
        self, text: str, related: MemoryRecord | None, history: list[dict[str, str]]
    ) -> list[dict[str, str]]:
        return prompt_messages(self.settings.system_prompt, text, related, history)

    def continuation(self, session: Session, text: str, reply: str) -> list[dict[str, str]]:
        """The chat that continues ``reply`` to ``text`` (Continue; the engine appends the reply,
        left open): ``session`` as the question found it, its history window less its oldest
        exchanges while the prompt and the reply so far are over the budget. An
        :class:`InputError` when the reply so far leaves no room for the prompt."""
        history = self.fitting_history(session, text)
        extra = self.count_tokens(reply)
        while history and self.prompt_tokens(self.messages(text, None, history)) + extra > self.budget:
            history = history[2:]
        if self.prompt_tokens(self.messages(text, None, history)) + extra > self.budget:
            raise InputError(
                f"This reply is already {extra:,} tokens long: with its question it fills the prompt budget "
                f"of {self.budget:,} tokens, so it cannot be continued. Ask a follow-up question instead "
                "(e.g. \"Go on from where you stopped\")."
            )
        return self.messages(text, None, history)

    def history_window(self, session: Session, text: str) -> tuple[int, list[list[dict[str, str]]]]:
        """(the window's start, every accepted exchange of ``session`` oldest first) for a turn
        asking ``text``: the exchanges from the start on are the prompt's history.

        The one place the history is fitted to :attr:`budget`: the block rule of
        :func:`isagi.manifold.window.window_start`, replayed over the session's exchanges with each
        turn's own message, so the start depends on the session's turns and ``text`` alone.
        Token counts come from :meth:`_exchange_tokens` (the texts' own tokens and the template's
        measured share, not the whole template rendered once per exchange: a long session's first
        turn after loading counts every exchange).
        """
        exchanges = session.exchanges()
        if not exchanges:
            return 0, []
        counts = [self._exchange_tokens(session, user["content"], reply["content"]) for user, reply in exchanges]
        budget = self.budget
        # the turn after exchange i asked exchange i+1's message; the turn now asks ``text``
        asked = [n for _cost, n in counts[1:]] + [self._asking_tokens(text)]
        start = window_start([cost for cost, _n in counts], [budget - n for n in asked])
        return start, exchanges

    def fitting_history(
        self, session: Session, text: str, related: MemoryRecord | None = None
    ) -> list[dict[str, str]]:
        """The exchanges of the history window (:meth:`history_window`) as chat messages.

        The window's exchange costs add up exactly for concatenating templates; the whole
        prompt is checked, and when it is over the budget all the same (another template, or
        a ``related`` exchange beside the history) the oldest exchanges of the window give way
        for this prompt only: the window's start does not move.
        """
        start, exchanges = self.history_window(session, text)
        return self._fit([m for exchange in exchanges[start:] for m in exchange], text, related)

    def _fit(
        self, history: list[dict[str, str]], text: str, related: MemoryRecord | None
    ) -> list[dict[str, str]]:
        """``history`` (whole exchanges, oldest first) less its oldest exchanges while the prompt
        with ``related`` and ``text`` is over the budget. A prompt only grows with what it holds,
        so trimming the history fitted without ``related`` gives what fitting with it would."""
        while history and self.prompt_tokens(self.messages(text, related, history)) > self.budget:
            history = history[2:]
        return history

    def _exchange_tokens(self, session: Session, user: str, reply: str) -> tuple[int, int]:
        """(tokens the exchange adds to a prompt, tokens of the prompt asking ``user`` alone),
        counted once per session (:attr:`Session.token_counts`)."""
        key = (self.settings.system_prompt, user, reply)
        got = session.token_counts.get(key)
        if got is None:
            u, a = self.count_tokens(user), self.count_tokens(reply)
            per_exchange, per_asking = self._template_tokens()
            got = session.token_counts[key] = (u + a + per_exchange, u + per_asking)
        return got

    def _asking_tokens(self, text: str) -> int:
        """Tokens of the prompt asking ``text`` alone, counted as :meth:`_exchange_tokens` counts."""
        return self.count_tokens(text) + self._template_tokens()[1]

    def _template_tokens(self) -> tuple[int, int]:
        """(the template's tokens around an exchange, the system prompt's and the template's
        tokens around a message asked alone), measured once per system prompt on a sample
        exchange. Exact for templates that join messages as they are (ChatML and most chat
        templates); any difference only moves the window, never past the budget, which
        :meth:`fitting_history` checks on the whole prompt."""
        system = self.settings.system_prompt
        got = self._template_counts.get(system)
        if got is None:
            ask, answer = "What is the capital of France?", "The capital of France is Paris."
            asked = [{"role": "system", "content": system}, {"role": "user", "content": ask}]
            alone = self.prompt_tokens(asked)
            with_exchange = self.prompt_tokens([*asked, {"role": "assistant", "content": answer}, asked[1]])
            q, a = self.count_tokens(ask), self.count_tokens(answer)
            got = self._template_counts[system] = (with_exchange - alone - q - a, alone - q)
        return got


def clean_message(message: str | None) -> str:
    """A message with control characters removed, or an :class:`InputError`.

    Lone surrogates (undecodable input) are refused rather than repaired, so
    nothing the user typed is silently changed; NUL and other control
    characters except newline and tab are removed; a message with nothing
    left but blank or invisible (format) characters is empty.
    """
    raw = message or ""
    if any(0xD800 <= ord(c) <= 0xDFFF for c in raw):
        raise InputError(
            "The message contains bytes that are not valid text (e.g. invalid UTF-8); "
            "send it as UTF-8 text."
        )
    text = "".join(c for c in raw if c in "\n\t" or unicodedata.category(c) != "Cc").strip()
    if not any(not c.isspace() and unicodedata.category(c) not in ("Cf", "Zs", "Zl", "Zp") for c in text):
        raise InputError("The message is empty: type a question or a request first.")
    return text


def prompt_messages(
    system: str, text: str, related: MemoryRecord | None = None, history: list[dict[str, str]] | None = None
) -> list[dict[str, str]]:
    """The chat for the model: system prompt, history, a related exchange, then the message.

    The related exchange goes after the history, next to the message it helps with, so the
    prompt still starts with the previous turn's prompt and reply (whose KV cache the
    engine can reuse, :mod:`isagi.engines.kv_prefix`)."""
    msgs = [{"role": "system", "content": system}, *(history or [])]
    if related is not None:
        msgs += [
            {"role": "user", "content": related["query_text"]},
            {"role": "assistant", "content": related["reply_text"]},
        ]
    msgs.append({"role": "user", "content": text})
    return msgs


def _holds_exchange(history: list[dict[str, str]], related: MemoryRecord) -> bool:
    """Whether ``history`` has the user message and reply of ``related`` as one exchange."""
    return any(
        a["role"] == "user" and a["content"] == related["query_text"]
        and b["role"] == "assistant" and b["content"] == related["reply_text"]
        for a, b in zip(history, history[1:], strict=False)
    )


def count_tokens(lm: ModelEngine, text: str) -> int:
    """Tokens of ``text`` alone under the model's tokenizer (no template, no special tokens)."""
    return int(lm.count_tokens(text))


def prompt_tokens(lm: ModelEngine, messages: list[dict[str, str]]) -> int:
    """Exact tokens of a chat in the model's template, ready to answer."""
    return len(lm.chat_tokens(messages))


def prompt_budget(settings: Settings, lm: ModelEngine) -> int:
    """Tokens a prompt may take: the setting, capped at the model's context minus the reply's tokens."""
    budget = settings.prompt_token_budget
    context = model_context(lm)
    if context is not None:
        budget = min(budget, context - settings.max_new_tokens)
    return max(budget, 1)


def model_context(lm: ModelEngine) -> int | None:
    """The model's context length in tokens, when the engine knows one."""
    n = getattr(lm, "context_length", None)
    return int(n) if isinstance(n, int) and n > 0 else None
