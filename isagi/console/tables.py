"""Readable terminal tables for the CLI (``isagi inspect``, ``isagi sessions list``).

Owns how summaries look in a terminal: rich tables with headers, sizes in
human units, tiers in plain words. The commands print these unless
``--json`` asks for the machine-readable form.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.table import Table

from isagi.storage.owners import LOCAL_OWNER

if TYPE_CHECKING:
    from rich.console import JustifyMethod

#: What each tier means, in plain words (the page uses the same wording).
TIER_WORDS = {
    "RETRIEVE": "answered from memory",
    "AUGMENT": "related to an earlier exchange",
    "EXPAND": "new, near known topics",
    "EXPLORE": "a new topic",
}
VERDICT_WORDS = {
    "ok": "answered",
    "refused": "refused by the safety layer",
    "withheld": "reply withheld by the safety layer",
    "cancelled": "stopped by the user",
}


def human_bytes(n: int | float | None) -> str:
    """``1536`` → ``1.5 KiB``."""
    if n is None:
        return "–"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _counts_text(counts: dict[str, int], words: dict[str, str]) -> str:
    if not counts:
        return "–"
    return ", ".join(f"{n} {words.get(k, k.lower())}" for k, n in counts.items())


def _kv_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, title_justify="left", show_header=True, header_style="bold")
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    for key, value in rows:
        table.add_row(key, value)
    return table


def inspect_tables(data: dict[str, Any]) -> list[Table]:
    """The tables of ``isagi inspect``: the file, its header, what it holds, its tensors."""
    header = data.get("header") or {}
    check = data.get("checksum") or {}
    status = check.get("status", "?")
    file_rows = [
        ("path", str(data.get("path", ""))),
        ("format", f"miku v{data.get('format_version')}.{data.get('format_minor', 0)}"),
        ("size", human_bytes(data.get("size_bytes"))),
        ("checksum", f"{check.get('algo', '?')}: {'ok' if status == 'ok' else 'MISMATCH (damaged)'}"),
    ]
    fingerprint = str(header.get("model_fingerprint", ""))
    header_rows = [
        ("created", str(header.get("created", "–"))),
        ("ISAGI version", str(header.get("isagi_version", "–"))),
        ("model", str(header.get("model_id", "–"))),
        ("model fingerprint", fingerprint[:16] + ("…" if len(fingerprint) > 16 else "")),
        ("hidden size d", str(header.get("d", "–"))),
        ("basis dimensions k", str(header.get("k", "–"))),
        ("layer", str(header.get("layer", "–"))),
    ]
    growth = data.get("metric_growth")
    content_rows = [
        ("turns", str(data.get("turns", "–"))),
        ("messages", str(data.get("messages", "–"))),
        ("replies", _counts_text(data.get("verdicts") or {}, VERDICT_WORDS)),
        ("stored exchanges", str(data.get("trajectories", "–"))),
        ("their tiers", _counts_text(data.get("tiers") or {}, TIER_WORDS)),
        ("metric growth ‖M − I‖", "–" if growth is None else f"{growth:.3f}"),
    ]
    tensors = Table(title="Tensors", title_justify="left", header_style="bold")
    columns: tuple[tuple[str, JustifyMethod], ...] = (("name", "left"), ("dtype", "left"), ("shape", "right"),
                                                       ("size", "right"))
    for col, justify in columns:
        tensors.add_column(col, justify=justify, no_wrap=True)
    for name, t in (data.get("tensors") or {}).items():
        tensors.add_row(name, str(t.get("dtype")), " × ".join(map(str, t.get("shape", []))) or "scalar",
                        human_bytes(t.get("bytes")))
    return [_kv_table("File", file_rows), _kv_table("Header", header_rows),
            _kv_table("Contents", content_rows), tensors]


def sessions_table(rows: list[Any]) -> Table:
    """``isagi sessions list``: id, owner, title, turns, last update."""
    table = Table(header_style="bold")
    table.add_column("id", no_wrap=True)
    table.add_column("owner", no_wrap=True)
    table.add_column("title", overflow="fold")
    table.add_column("turns", justify="right", no_wrap=True)
    table.add_column("updated (UTC)", no_wrap=True)
    for r in rows:
        table.add_row(r.id, str(getattr(r, "owner", LOCAL_OWNER)), r.title or "(untitled)", str(r.turns),
                      r.updated_at.strftime("%Y-%m-%d %H:%M"))
    return table
