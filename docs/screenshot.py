"""Retake ``docs/screenshot.png``, the chat page shown in the README.

    python docs/screenshot.py            # needs the dev install and Debian's chromium

Starts ``isagi web`` on the embedded default model with an empty data directory
(:mod:`isagi.bench.live_server`), asks two questions in Chromium (through
Playwright) and the first one again, so the picture shows a streamed reply, the
tier badges and an answer from memory (RETRIEVE), and writes the page as it is.
Nothing here is staged: every figure on the page is what the model and the
manifold did in this run.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent / "screenshot.png"
QUESTIONS = ("What is the capital of France?", "Name three colours of the rainbow.",
             "What is the capital of France?")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _ask(page, text: str) -> None:
    """Send ``text`` and wait until its reply has finished (its info line has a tier badge)."""
    before = page.locator("#isagi-chat .isagi-info").count()
    box = page.locator("#isagi-input textarea")
    box.fill(text)
    box.press("Enter")
    page.wait_for_function(
        "n => Array.from(document.querySelectorAll('#isagi-chat .isagi-info'))"
        ".filter(e => !e.innerText.includes('generating')).length > n", arg=before)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--chromium", default=os.environ.get("ISAGI_CHROMIUM", "/usr/bin/chromium"))
    args = p.parse_args(argv)

    from playwright.sync_api import sync_playwright

    from isagi.bench import live_server

    with tempfile.TemporaryDirectory(prefix="isagi-screenshot-") as home:
        server = live_server.start(Path(home), timeout_s=600)
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1440, "height": 1000})
                page.set_default_timeout(300_000)
                page.goto(server.url)
                page.wait_for_selector("#isagi-input textarea:not([disabled])")
                for q in QUESTIONS:
                    _ask(page, q)
                page.wait_for_timeout(1000)  # the plots' last redraw
                page.screenshot(path=str(args.out), full_page=False)
                browser.close()
        finally:
            server.stop()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
