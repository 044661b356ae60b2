"""Pack an installed distribution back into a wheel (docker/build.sh's last resort before
compiling llama.cpp on the host: the venv's llama-cpp-python is exactly the wheel pip
built for `make install`, when pip's cache no longer holds it).

    python docker/repack_wheel.py llama-cpp-python OUT_DIR   # prints the wheel's path
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import sys
import zipfile
from pathlib import Path


def repack(name: str, out_dir: Path) -> Path:
    dist = md.distribution(name)
    tag = next(line.split(":", 1)[1].strip() for line in (dist.read_text("WHEEL") or "").splitlines()
               if line.startswith("Tag:"))
    norm = dist.metadata["Name"].replace("-", "_")
    info = f"{norm}-{dist.version}.dist-info"
    target = out_dir / f"{norm}-{dist.version}-{tag}.whl"
    records: list[str] = []
    with zipfile.ZipFile(target.with_suffix(".tmp"), "w", zipfile.ZIP_DEFLATED) as z:
        for f in dist.files or []:
            rel = str(f)
            if rel.startswith("..") or "__pycache__" in rel or rel.endswith(("/RECORD", "/INSTALLER", "/REQUESTED")):
                continue
            if rel.startswith(f"{info}/direct_url.json"):
                continue
            data = Path(f.locate()).read_bytes()
            z.writestr(rel, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append(f"{rel},sha256={digest},{len(data)}")
        records.append(f"{info}/RECORD,,")
        z.writestr(f"{info}/RECORD", "\n".join(records) + "\n")
    target.with_suffix(".tmp").replace(target)
    return target


if __name__ == "__main__":
    print(repack(sys.argv[1], Path(sys.argv[2])))
