"""Add llama.cpp's EAGLE-3 layer-input hook to the architectures of build 11434 that lack it.

llama.cpp hands an EAGLE-3 draft the input of chosen target layers through
``res->t_layer_inp[il] = inpL;`` at the top of each model's layer loop. Build 11434 has that line
for Llama and Qwen3 but not for Qwen2 (Qwen2.5, Qwen2.5-Coder) or Gemma-3, where llama-server then
aborts as soon as a draft asks for a layer. Usage: ``python llama_cpp_hooks.py LLAMA_CPP_SRC``.
Idempotent; exits non-zero naming the file when the source does not look as expected.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HOOK = "res->t_layer_inp[il] = inpL;"
FILES = ("src/models/qwen2.cpp", "src/models/gemma3.cpp")
LOOP = re.compile(r"^(?P<indent>[ \t]*)for \(int il = 0; il < n_layer; \+\+il\) \{\n", re.M)


def add_hook(text: str) -> str:
    """Return ``text`` with the hook as the first statement of its (single) layer loop."""
    if HOOK in text:
        return text
    loops = list(LOOP.finditer(text))
    if len(loops) != 1:
        raise ValueError(f"expected one layer loop, found {len(loops)}")
    m = loops[0]
    line = f"{m['indent']}    {HOOK}\n"
    return text[: m.end()] + line + text[m.end():]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: llama_cpp_hooks.py LLAMA_CPP_SRC", file=sys.stderr)
        return 2
    root = Path(argv[1])
    for rel in FILES:
        path = root / rel
        try:
            path.write_text(add_hook(path.read_text()))
        except (OSError, ValueError) as exc:
            print(f"llama_cpp_hooks: cannot patch {path}: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
