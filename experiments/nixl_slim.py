"""Unpack a nixl-cu12 wheel keeping only what kvgate's NIXL transport loads, for the device tool.

The wheel is ~68 MB (storage, cloud and InfiniBand plugins, headers, tools); one device call
carries at most 64 MiB. kvgate needs the Python package, the NIXL core libraries, the UCX plugin,
and UCX with its CUDA, CMA and TCP/shared-memory transports (one host). This keeps those and every
library they link against (readelf NEEDED, transitively), drops the rest, and strips what it
keeps.

    python experiments/nixl_slim.py nixl_cu12-1.5.1-cp312-...whl .nixl   # then PYTHONPATH=.nixl
"""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

DROP_DIRS = ("include", "bin", "pkgconfig", "sboms")
KEEP_PLUGINS = ("libplugin_UCX.so",)
KEEP_UCX_MODULES = ("libucm_cuda", "libuct_cuda", "libuct_cma")


def needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    return [line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if "(NEEDED)" in line]


def is_elf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def slim(wheel: str, out: str) -> int:
    """Unpack `wheel` into `out` and prune it; returns the bytes kept."""
    root = Path(out)
    shutil.rmtree(root, ignore_errors=True)
    zipfile.ZipFile(wheel).extractall(root)
    for d in sorted(root.rglob("*")):
        if d.is_dir() and (
            d.name in DROP_DIRS or d.name.endswith((".data", ".scripts")) or d.name.startswith("nixl_ep")
        ):
            shutil.rmtree(d, ignore_errors=True)
    for f in root.rglob("*"):
        if not f.is_file():
            continue
        plugin = f.parent.name in ("plugins", "nixl") and f.name.startswith(("libplugin_", "libtelemetry_"))
        ucx_module = f.parent.name == "ucx"
        if (
            (plugin and f.name not in KEEP_PLUGINS)
            or (ucx_module and not f.name.startswith(KEEP_UCX_MODULES))
            or f.suffix == ".la"
        ):
            f.unlink()
    libs = {f.name: f for f in root.rglob("*.so*") if f.is_file() and is_elf(f)}
    roots = [f for f in libs.values() if f.parent.name in ("plugins", "nixl", "ucx") or f.name.startswith("_")]
    keep, todo = {f.name for f in roots}, list(roots)
    while todo:
        for name in needed(todo.pop()):
            if name in libs and name not in keep:
                keep.add(name)
                todo.append(libs[name])
    for name, f in libs.items():
        if name not in keep:
            f.unlink()
        elif shutil.which("strip"):  # the wheel's libraries keep their symbol tables: ~30% of their size
            subprocess.run(["strip", "--strip-unneeded", str(f)], check=True)
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


if __name__ == "__main__":
    kept = slim(sys.argv[1], sys.argv[2])
    print(f"{sys.argv[2]}: {kept / 2**20:.1f} MiB")
