"""Re-key the shipped profiles (isagi/profiles/<key>/) after a change that leaves the
calibration as it was, without recalibrating.

A profile's key hashes, among its inputs, the calibration code (``isagi.profile.code_digest``).
When that digest changes but what the calibration computes does not (the digest's own
method changed, or a digested module changed in a way that cannot move a figure), the
shipped profiles are still right and only their key is stale. This script:

1. reads the digested modules as they were at ``--from`` (a git revision at which the
   shipped profiles were current: tests/test_shipped_profiles.py passed there);
2. finds each shipped profile's backend by recomputing its key at that revision (with the
   digest method of that revision: ``--bytes`` for the raw-bytes digest used before the
   syntax-tree one);
3. refuses when a digested module does something different now than at ``--from``, unless
   that module is named with ``--accept`` (say why in the commit message);
4. writes the key of today's code into each profile.json and renames its directory.
   Nothing else in a profile changes.

Run from the repository root::

    python scripts/rekey_profiles.py --from <rev> [--bytes] [--accept isagi.profile] [--dry-run]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from isagi.config import DEFAULT_SYSTEM_PROMPT  # noqa: E402
from isagi.profile import (  # noqa: E402
    DIGESTED_MODULES,
    SHIPPED_QUANTS,
    code_behaviour,
    code_digest,
    digest_name,
    module_sources,
    profile_key,
    shipped_profiles_dir,
)


def sources_at(rev: str) -> dict[str, str]:
    """module -> its source at git revision ``rev``, where it lived then: at its path today or,
    before it moved, at the path of its digest name. A module that did not exist then (split
    out of another) is absent."""
    out: dict[str, str] = {}
    for module in DIGESTED_MODULES:
        for name in dict.fromkeys((module, digest_name(module))):
            shown = subprocess.run(["git", "show", f"{rev}:{name.replace('.', '/')}.py"], cwd=ROOT,
                                   capture_output=True, text=True)
            if shown.returncode == 0:
                out[module] = shown.stdout
                break
    return out


def bytes_digest(sources: dict[str, str]) -> str:
    """The digest before the syntax-tree one: the modules' raw bytes, comments included."""
    h = hashlib.sha256()
    for module in DIGESTED_MODULES:
        h.update(sources[module].encode("utf-8"))
    return h.hexdigest()[:16]


def digest_at(rev: str) -> str:
    """The code digest that revision ``rev`` computes itself, by its own method and with its
    modules where they were then (today's method may differ: that is one reason to re-key)."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", rev, "isagi"], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        out = subprocess.run([sys.executable, "-c", "import isagi.profile as p; print(p.__file__); print(p.code_digest())"],
                             cwd=tmp, env={**os.environ, "PYTHONPATH": tmp}, check=True, capture_output=True, text=True)
    where, digest = out.stdout.split()
    if not where.startswith(tmp):
        raise SystemExit(f"the code of {rev} was not the one imported ({where})")
    return digest


def key_of(meta: dict, backend: str, code: str) -> str:
    return profile_key(meta["model_fingerprint"], SHIPPED_QUANTS[backend], meta["layer"], meta["k"],
                       DEFAULT_SYSTEM_PROMPT, meta["safety"]["layer"], backend, code=code)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="rev", required=True, help="git revision at which the profiles were current")
    ap.add_argument("--bytes", action="store_true", help="that revision keyed on the modules' raw bytes")
    ap.add_argument("--accept", action="append", default=[], metavar="MODULE",
                    help="a digested module whose code changed without changing the calibration")
    ap.add_argument("--dir", type=Path, default=shipped_profiles_dir())
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)

    old, now = sources_at(args.rev), module_sources()
    changed = [m for m in DIGESTED_MODULES if m not in old or code_behaviour(old[m]) != code_behaviour(now[m])]
    refused = [m for m in changed if m not in args.accept]
    if refused:
        print(f"what {', '.join(refused)} does changed since {args.rev}: rebuild the profiles "
              "(isagi/profiles/README.md), or name each with --accept if it cannot move a figure", file=sys.stderr)
        return 1
    old_code = bytes_digest(old) if args.bytes else digest_at(args.rev)
    return rekey(args.dir, old_code, code_digest(now), rev=args.rev, dry_run=args.dry_run)


def rekey(directory: Path, old_code: str, new_code: str, *, rev: str = "the old code", dry_run: bool = False) -> int:
    """Rename each profile in ``directory`` whose name is its key under ``old_code`` to its key
    under ``new_code``, writing that key into its profile.json; 1 if any was not recognised."""
    status = 0
    for path in sorted(p for p in directory.iterdir() if (p / "profile.json").is_file()):
        meta = json.loads((path / "profile.json").read_text())
        backends = [b for b in SHIPPED_QUANTS if key_of(meta, b, old_code) == path.name]
        if len(backends) != 1:
            print(f"{path.name}: not a current shipped profile at {rev}; left alone", file=sys.stderr)
            status = 1
            continue
        key = key_of(meta, backends[0], new_code)
        print(f"{backends[0]}: {path.name} -> {key}")
        if key == path.name or dry_run:
            continue
        if meta["key"] != path.name:
            raise SystemExit(f"{path}: profile.json says key {meta['key']}, not its directory's name")
        meta["key"] = key
        (path / "profile.json").write_text(json.dumps(meta, indent=1))
        path.rename(path.with_name(key))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
