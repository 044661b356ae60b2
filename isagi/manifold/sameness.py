"""Exact sameness check for the RETRIEVE tier: the content key of a query.

Geometry alone cannot make RETRIEVE safe (docs/architecture.md, Definitions: near misses):
"capital of France" and "capital of Germany" sit closer in hidden-state
space than two paraphrases. So a cached reply may be returned only when the
two questions have *equal content keys*: the same content words, in the same
order, after removing differences that never change the answer.

The rule (``content_key``), in order:

1. Unicode NFKC, lowercase, typographic quotes/dashes mapped to ASCII.
2. Common English contractions expanded: ``what's`` -> ``what is``,
   ``don't`` -> ``do not``, ``can't``/``cannot`` -> ``can not``,
   ``won't`` -> ``will not``, ``'re``/``'ve``/``'ll``/``'m``/``'d``.
   ``'s`` is expanded only after pronouns and wh-words (``it's``,
   ``where's``), ``let's`` -> ``let us``; a possessive (``France's``) becomes ``frances``.
3. Tokenise, keeping what carries meaning: words (any script), numbers with
   decimal points between digits (``3.14``; thousands commas ``1,000`` are
   joined to ``1000``), the operators ``+ - * / = < > % ^`` (and ``<=``,
   ``>=``, ``==``, ``!=``, ``**``, ``//``), brackets ``( ) [ ] { }`` (they
   group: ``(2+3)*4`` is not ``2+(3*4)``), currency signs ``$ € £ ¥``, a
   factorial ``!`` right after a digit or ``)``, code-ish tokens (``c++``,
   ``c#``, ``f#``, ``node.js``, ``os.path``, ``.py``). A hyphen between two
   words (``well-known``) splits them; next to a digit or a one-letter
   operand it is a minus. Every other punctuation mark is dropped.
4. Leading filler is removed, repeatedly: greetings (``hi``, ``hello``,
   ``hey``, ``good morning`` ...), ``please``, and request wrappers that
   never change the question (``could you please``, ``can you tell me``,
   ``tell me``, ``i want to know``, ``do you know`` ...). Trailing
   politeness is removed: ``please``, ``thanks``, ``thank you`` ....
   ``can you``/``could you`` alone are NOT dropped ("can you swim?").
5. The articles ``the``, ``an`` and ``a`` are dropped (``a`` is kept when it
   is not followed by a real word, or follows an operator: there it is a
   variable, as in ``a + b`` or ``solve for a``).

Never dropped: negations (``not``, ``no``, ``never``, ``without``), numbers,
comparatives and superlatives, direction-carrying prepositions (``to``,
``from``, ``before``, ``after``, ``into``, ``above``, ``below``), wh-words
and auxiliaries (``what``/``who``, ``is``/``was``: they change the answer),
and word order. The key is the remaining tokens joined by single spaces.

Known limitation: letter case is folded, so ``String`` and ``string`` (C#)
share a key; a surface case change must count as a duplicate, and the
geometric tier check still applies on top of the key.

Two duplicates in the project's sense (isagi/data/README.md) always get equal
keys; near-misses never do; most paraphrases do not either, which is the
safe direction (they fall to AUGMENT, never to a wrong RETRIEVE).
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["content_key", "same_content"]

_CHAR_MAP = str.maketrans(
    {
        "\u2018": "'",
        "\u2019": "'",
        "\u02bc": "'",
        "`": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u2013": "-",
        "\u2014": " ",
        "\u2212": "-",
        "\u00d7": "*",
        "\u00f7": "/",
    }
)

_NT_IRREGULAR = {
    "can't": "can not",
    "cannot": "can not",
    "won't": "will not",
    "shan't": "shall not",
    "ain't": "is not",
}
_S_HOSTS = "it|that|what|where|who|how|there|here|he|she|when|why|which|this"
_RE_NT_IRREG = re.compile(r"\b(can't|cannot|won't|shan't|ain't)\b")
_RE_NT = re.compile(r"\b(\w+)n't\b")
_RE_S = re.compile(rf"\b({_S_HOSTS})'s\b")
_RE_RE = re.compile(r"\b(\w+)'re\b")
_RE_VE = re.compile(r"\b(\w+)'ve\b")
_RE_LL = re.compile(r"\b(\w+)'ll\b")
_RE_M = re.compile(r"\bi'm\b")
_RE_LETS = re.compile(r"\blet's\b")
_RE_D = re.compile(r"\b(i|you|he|she|we|they|it|that|who|what)'d\b")

_RE_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")

# One token: a number; a word (possibly dotted, possibly ending in ++ or #);
# a leading-dot extension; or an operator.
_RE_TOKEN = re.compile(
    r"""
    (?P<num>\d+(?:\.\d+)*(?:[^\W\d_][\w]*)?)          # 3.14, 10km, 2nd
  | (?P<ext>(?<![\w.])\.[^\W_][\w]*)                  # .py, .json
  | (?P<word>[^\W\d_][\w']*(?:\.[^\W_][\w]*)*(?:\+\+|\#)?)  # node.js, c++, c#
  | (?P<op><=|>=|==|!=|\*\*|//|[+\-*/=<>%^()\[\]{}$€£¥]|(?<=[\d)])!)
    """,
    re.VERBOSE,
)

_LEADING_FILLERS: tuple[tuple[str, ...], ...] = tuple(
    tuple(p.split())
    for p in sorted(
        [
            "hi",
            "hello",
            "hey",
            "hiya",
            "yo",
            "greetings",
            "good morning",
            "good afternoon",
            "good evening",
            "hi there",
            "hello there",
            "hey there",
            "ok",
            "okay",
            "please",
            "excuse me",
            "quick question",
            "could you please",
            "can you please",
            "would you please",
            "could you tell me",
            "can you tell me",
            "would you tell me",
            "tell me",
            "i want to know",
            "i would like to know",
            "i wanna know",
            "do you know",
            "i was wondering",
        ],
        key=lambda s: -len(s.split()),
    )
)
_TRAILING_FILLERS: tuple[tuple[str, ...], ...] = tuple(
    tuple(p.split())
    for p in sorted(
        ["please", "thanks", "thank you", "thanks a lot", "thank you very much", "thx", "cheers"],
        key=lambda s: -len(s.split()),
    )
)
_OPS = {"+", "-", "*", "/", "=", "<", ">", "%", "^", "<=", ">=", "==", "!=", "**", "//"}


def _expand_contractions(text: str) -> str:
    text = _RE_NT_IRREG.sub(lambda m: _NT_IRREGULAR[m.group(1)], text)
    text = _RE_NT.sub(r"\1 not", text)
    text = _RE_S.sub(r"\1 is", text)
    text = _RE_RE.sub(r"\1 are", text)
    text = _RE_VE.sub(r"\1 have", text)
    text = _RE_LL.sub(r"\1 will", text)
    text = _RE_M.sub("i am", text)
    text = _RE_LETS.sub("let us", text)
    return _RE_D.sub(r"\1 would", text)


def _tokens(text: str) -> list[str]:
    out: list[str] = []
    for m in _RE_TOKEN.finditer(text):
        kind = m.lastgroup  # each alternative is one named group, the whole match
        tok = m.group(kind or 0)
        if kind == "word":
            tok = tok.replace("'", "")
            if not tok:
                continue
        elif kind == "op" and tok == "-":
            # A hyphen joining two longer words is a word break, not a minus.
            before = text[: m.start()].rstrip()
            after = text[m.end() :].lstrip()
            glued = m.start() > 0 and text[m.start() - 1].isalpha() and after[:1].isalpha()
            if glued:
                left = re.search(r"(\w+)$", before)
                right = re.match(r"(\w+)", after)
                if left and right and len(left.group(1)) > 1 and len(right.group(1)) > 1:
                    continue
        out.append(tok)
    return out


def _strip_phrases(
    tokens: list[str], phrases: tuple[tuple[str, ...], ...], leading: bool
) -> list[str]:
    changed = True
    while changed and tokens:
        changed = False
        for p in phrases:
            n = len(p)
            if n >= len(tokens):
                continue  # never strip a query down to nothing
            part = tuple(tokens[:n]) if leading else tuple(tokens[-n:])
            if part == p:
                tokens = tokens[n:] if leading else tokens[:-n]
                changed = True
                break
    return tokens


def content_key(text: str) -> str:
    """Return the normalised content key of ``text`` (see the module docstring)."""
    if not isinstance(text, str):
        raise TypeError(f"content_key expects a str, got {type(text).__name__}")
    t = unicodedata.normalize("NFKC", text).translate(_CHAR_MAP).lower()
    t = _expand_contractions(t)
    t = _RE_THOUSANDS.sub("", t)
    toks = _tokens(t)
    toks = _strip_phrases(toks, _LEADING_FILLERS, leading=True)
    toks = _strip_phrases(toks, _TRAILING_FILLERS, leading=False)
    kept: list[str] = []
    for i, tok in enumerate(toks):
        if tok in ("the", "an"):
            continue
        if tok == "a":
            prev = toks[i - 1] if i > 0 else ""
            nxt = toks[i + 1] if i + 1 < len(toks) else ""
            word = nxt[1:] if nxt.startswith(".") else nxt  # "a .py file"
            if len(word) > 1 and word.isalpha() and prev not in _OPS:
                continue
        kept.append(tok)
    return " ".join(kept)


def same_content(a: str, b: str) -> bool:
    """True when two queries may share a cached reply (equal, non-empty content keys)."""
    ka, kb = content_key(a), content_key(b)
    return bool(ka) and ka == kb


# -- context dependence ---------------------------------------------------------

_CONNECTORS = (  # openers that continue the previous message, whatever the length
    "and", "or", "but", "also", "then", "now", "so", "what about", "how about", "same",
    "another", "again", "instead", "make it", "do it", "do that", "why not", "ok", "okay",
)
_PREPOSITIONS = frozenset("in on for to of with without into from at by".split())
_ANAPHORA = frozenset(
    "it its it's itself this that these those they them their theirs he him his she her hers "
    "former latter one ones same".split()
)
SHORT = 5  # a message of at most this many words is a fragment if it opens with a preposition or refers back
_WORD = re.compile(r"[a-z0-9']+")


def depends_on_context(text: str) -> bool:
    """Whether a message probably needs the conversation to be understood ("And Germany?").

    A message counts as context-dependent when it is at most two words
    ("When?"), opens with a connector ("and …", "what about …", "now …"), or is
    short (at most ``SHORT`` words) and opens with a preposition ("in water?")
    or refers back with a pronoun or "one"/"same" ("who wrote it?"). Longer
    messages carry their own subject ("Is it rude to not tip in Japan?"). The rule errs towards "dependent": a self-contained
    question it flags only loses the chance of being answered from memory in
    another context, while a missed follow-up could be answered with another
    context's reply. Measured on the project's follow-up corpus by
    ``tests/test_sameness.py``.
    """
    norm = unicodedata.normalize("NFKC", text).lower().replace("\u2019", "'")
    words = _WORD.findall(norm)
    if len(words) <= 2:
        return True
    opening = " ".join(words[:2])
    if any(opening == c or words[0] == c for c in _CONNECTORS):
        return True
    if len(words) > SHORT:
        return False
    return words[0] in _PREPOSITIONS or any(w in _ANAPHORA for w in words)
