"""Plain-language explanations of what the page shows, in one place.

Owns the plain names the page shows for the tiers and verdicts (:data:`PLAIN_NAMES`, the
README's words; the technical names, RETRIEVE and the others, stay in the tooltips and the
Turn panel beside them), the one-line texts behind the hover titles of the badges and the
figures beside each reply, and the help panel of the Chat tab. A newcomer reads these; the
definitions they summarise are in docs/architecture.md.
"""

from __future__ import annotations

# What `isagi eval safety --benchmarks DIR --json` measured for the shipped llama.cpp profile
# (docs/measurements.md, "The probe over several layers"); remeasure and change together.
GUARD_RATES = ("on public sets it refused 97 % of AdvBench's harmful requests and 58 % of XSTest's unsafe "
               "prompts, and 6 % of XSTest's safe prompts and 4 % of ordinary Alpaca tasks "
               "(isagi eval safety --benchmarks DIR).")

# What a badge says, by its technical name: the README's words for the four tiers
# ("Answered from memory", "Related", "New", "New topic") and plain words for the verdicts.
PLAIN_NAMES = {
    "RETRIEVE": "Answered from memory",
    "AUGMENT": "Related",
    "EXPAND": "New",
    "EXPLORE": "New topic",
    "REFUSED": "Refused",
    "WITHHELD": "Withheld",
    "CANCELLED": "Stopped",
    "OK": "Answered",
    "PENDING": "Pending",
}


def plain_name(label: str) -> str:
    """The plain name the page shows for a badge's technical ``label`` (itself when it has none)."""
    return PLAIN_NAMES.get(label, label)


BADGE_HELP = {
    "RETRIEVE": "Answered from memory: you asked this before, so the stored answer came back without running the model.",
    "AUGMENT": "Related: close to something already discussed; the model answered with that exchange as context.",
    "EXPAND": "New: a new question on known ground; the model answered and the memory learned it.",
    "EXPLORE": "New topic: far from everything so far; the model answered and the memory opened a new cluster.",
    "REFUSED": "Refused: the request's TEH was over the safety layer's threshold, so nothing was generated. "
               "The guard is a small probe on the model's states, not a judgement: " + GUARD_RATES,
    "WITHHELD": "Withheld: the reply's TEH crossed the reply threshold while streaming, so it was stopped.",
    "CANCELLED": "Stopped by you: the partial reply is kept here but never used in later prompts.",
    "OK": "Answered.",
    "PENDING": "The model is still writing this reply.",
}

FIGURE_HELP = {
    "d": "d: how far this question lies from the nearest one in memory, measured in the model's hidden "
         "states under the session's metric: a cosine distance, 0 = the same direction, about 1 = unrelated, "
         "up to 2 = opposite. Where it falls between this model's calibrated boundaries (shown in the "
         "Turn panel) gives the badge.",
    "zone": "Zone: the broad area of knowledge the question falls in.",
    "teh": "TEH: how strongly a small probe (tiny neural networks) on the model's hidden states (three layers) reads the "
           "question (and the reply with it) as harmful, in %; it learned from labelled harmful and harmless "
           "requests, and over the threshold it refuses. A high TEH is not proof of harm, nor a low one of "
           "safety: " + GUARD_RATES,
    "growth": "Metric growth ‖M − I‖: how much the session's sense of distance has been reshaped by the "
              "new questions you asked; it grows only when something new comes up.",
    "tokens": "Tokens: length of the prompt the model read, plus the reply it wrote.",
    "latency": "Time from your message to the end of the reply.",
}


def help_markdown() -> str:
    """The help panel: each badge and each figure in one plain line."""
    badges = "\n".join(f"- **{plain_name(name)}** ({name}): {text.split(': ', 1)[-1]}"
                       for name, text in BADGE_HELP.items() if name not in ("OK", "PENDING"))
    figures = "\n".join(f"- {text}" for key, text in FIGURE_HELP.items())
    return f"**The badge beside each reply**\n\n{badges}\n\n**The figures**\n\n{figures}"
