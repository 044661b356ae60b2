"""Make ``isagi/data/safety_public.jsonl`` from the public calibration corpora (CatQA, HarmfulQA, CoCoNot).

Run from the repository root with the corpora's folder and the evaluation sets' folder (the
development workspace's ``shared/calibration/public`` and ``shared/benchmarks``)::

    python scripts/import_public_safety.py ../shared/calibration/public ../shared/benchmarks

Every row keeps its source's text and label; this script only maps each row to one of the
project's safety categories (the refusal message names it, and leave-one-category-out
cross-validation holds categories out) and marks what kind of benign row it is. The mapping is
the table in ``isagi/data/SAFETY_DATA.md`` ("Public corpora"). Rows are written in the sources'
order, unedited. A row is dropped, by the rule the project's own rows keep
(``tests/test_safety_data.py``), when its normalised text equals an evaluation prompt or its
token set has a Jaccard similarity above 0.5 with one: the evaluation sets are read for that
check alone.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

CATEGORIES = ("privacy", "illegal_advice", "phishing", "sycophancy", "jailbreak", "toxicity",
              "misinformation", "self_harm")

# CatQA: (category, subcategory) -> project category; subcategory rules first
CATQA_SUB = {"Self-harm": "self_harm", "Financial fraud": "phishing", "Employment scams": "phishing",
             "Investment scams": "phishing", "Identity theft": "privacy", "Phishing": "phishing",
             "Scamming": "phishing", "False advertising": "misinformation",
             "Political misinformation": "misinformation", "Deepfake creation": "privacy"}
CATQA = {"Illegal Activity": "illegal_advice", "Child Abuse": "illegal_advice",
         "Hate/Harass/Violence": "toxicity", "Malware Viruses": "illegal_advice",
         "Physical Harm": "illegal_advice", "Economic Harm": "illegal_advice",
         "Fraud/Deception": "phishing", "Adult Content": "toxicity",
         "Political Campaigning": "misinformation", "Privacy Violation Activity": "privacy",
         "Tailored Financial Advice": "illegal_advice"}
# CoCoNot's safety subcategories (harmful in coconot_eval, benign look-alikes in the contrast set)
COCONOT_SAFETY = {"misinformation": "misinformation", "false information": "misinformation",
                  "privacy violations": "privacy", "dangerous or sensitive topics": "illegal_advice",
                  "copyright violations": "illegal_advice", "triggers for offensive language": "toxicity",
                  "wildchats": "toxicity", "incomprehensible": "toxicity"}
# HarmfulQA has academic topics, not harm categories: the question's words decide, first match wins
HARMFULQA_RULES = (
    ("self_harm", r"self-harm|suicid|hurt (?:myself|themselves)|eating disorder|starv"),
    ("privacy", r"privacy|personal (?:data|information)|surveil|spy|stalk|track someone|dox|private"),
    ("phishing", r"phish|scam|fraud|impersonat|ponzi|pyramid scheme|counterfeit"),
    ("misinformation", r"misinform|disinform|fake news|propaganda|false|mislead|conspirac|rumou?r|"
                       r"falsif|fabricat|hoax|pseudoscien|deny|denial"),
    ("toxicity", r"hate|discriminat|stereotyp|racis|sexis|harass|bull(?:y|ies)|offen[sd]|insult|"
                 r"demean|marginali|prejudic|humiliat|ridicule|xenophob|homophob|mock"),
    ("jailbreak", r"bypass (?:the )?(?:ai|filter|safety)|jailbreak"),
)


def harmfulqa_category(text: str) -> str:
    low = text.lower()
    for category, pattern in HARMFULQA_RULES:
        if re.search(pattern, low):
            return category
    return "illegal_advice"


JACCARD_LIMIT = 0.5


def _tokens(text: str) -> frozenset[str]:
    return frozenset(re.findall(r"[a-z0-9]+", text.lower()))


def evaluation_prompts(benchmarks: Path) -> list[str]:
    """Every prompt of AdvBench, XSTest and the Alpaca seed tasks (instruction, and instruction
    with its inputs), for the overlap rule only."""
    import csv

    out: list[str] = []
    for name in ("advbench_harmful_behaviors.csv", "xstest_prompts.csv"):
        with open(benchmarks / name, encoding="utf-8", newline="") as fh:
            out += [row["prompt"] for row in csv.DictReader(fh)]
    for row in _read(benchmarks / "alpaca_seed_tasks.jsonl"):
        out.append(row["instruction"])
        out += [f"{row['instruction']}\n\n{i['input']}" for i in row.get("instances", []) if i.get("input")]
    return out


def too_close(rows: list[dict], prompts: list[str]) -> set[str]:
    """Texts of ``rows`` that copy or nearly copy an evaluation prompt (module docstring)."""
    norm = {re.sub(r"[^a-z0-9]", "", p.lower()) for p in prompts}
    toks = [_tokens(p) for p in prompts]
    out = set()
    for r in rows:
        mine = _tokens(r["text"])
        if re.sub(r"[^a-z0-9]", "", r["text"].lower()) in norm or any(
                len(mine & t) / max(len(mine | t), 1) > JACCARD_LIMIT for t in toks):
            out.add(r["text"])
    return out


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def convert(folder: Path) -> list[dict]:
    out: list[dict] = []
    for r in _read(folder / "catqa_english.jsonl"):
        cat = CATQA_SUB.get(r["subcategory"], CATQA[r["category"]])
        out.append({"text": r["text"], "label": "harmful", "category": cat, "source": "catqa",
                    "kind": "public_harmful", "origin": f"{r['category']} / {r['subcategory']}"})
    for r in _read(folder / "harmfulqa.jsonl"):
        out.append({"text": r["text"], "label": "harmful", "category": harmfulqa_category(r["text"]),
                    "source": "harmfulqa", "kind": "public_harmful", "origin": f"{r['topic']} / {r['subtopic']}"})
    ordinary = 0
    for name in ("coconot_eval.jsonl", "coconot_contrast_pref.jsonl"):
        for r in _read(folder / name):
            origin = f"{r['category']} / {r['subcategory']}"
            if r["label"] == "harmful":
                row = {"label": "harmful", "category": COCONOT_SAFETY[r["subcategory"]], "kind": "public_harmful"}
            elif r["category"] == "Requests with safety concerns":  # answerable, but looks like a safety case
                row = {"label": "benign", "category": COCONOT_SAFETY[r["subcategory"]], "kind": "public_lookalike"}
            else:  # incomplete, unsupported, indeterminate, humanizing: not a safety matter
                row = {"label": "benign", "category": CATEGORIES[ordinary % len(CATEGORIES)],
                       "kind": "public_ordinary"}
                ordinary += 1
            out.append({"text": r["text"], **row, "source": "coconot", "origin": origin})
    return out


def main(argv: list[str]) -> int:
    folder = Path(argv[1] if len(argv) > 1 else "../shared/calibration/public")
    benchmarks = Path(argv[2] if len(argv) > 2 else folder.parent.parent / "benchmarks")
    data = Path(__file__).resolve().parent.parent / "isagi" / "data"
    rows = convert(folder)
    close = too_close(rows, evaluation_prompts(benchmarks))
    dropped = [r for r in rows if r["text"] in close]
    rows = [r for r in rows if r["text"] not in close]
    print(f"dropped {len(dropped)} rows too close to an evaluation prompt")
    with open(data / "safety_public.jsonl", "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    for lic in ("LICENSE-coconot.txt", "LICENSE-red-instruct.txt"):
        shutil.copyfile(folder / lic, data / "licenses" / lic)
    print(f"wrote {len(rows)} rows to {data / 'safety_public.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
