"""vLLM methods for the benchmark: the same requests, in the same run, through `vllm serve`.

- `vllm_plain`: the target in vLLM (its CPU build, eager, the target's dtype), no drafting: the
  baseline `vllm_draft` is sped up against and compared with token for token;
- `vllm_draft`: the same target with head_path's head as vLLM's draft, a chain of
  `vllm.num_speculative_tokens` (null: the run's tree depth), exported on the fly into the run
  dir in the layout `vllm.draft_format` names (null: the head's own, `VLLM_LAYOUTS`) unless
  `vllm.draft_dir` gives one.

Each method keeps one server (data/engines/vllm.py) for the whole run and sends the harness's
token ids, so every method decodes exactly the same prompt, greedily, stopping at the target's
EOS ids. A `Record` is filled from the answer: its token ids, the wall time of the request, and
the accepted draft tokens of every verify step, in order, from vLLM's own per-request
speculative-decoding counters; tau therefore means what it means for the HF methods (tokens per
target verify step, the bonus token included, the prefill's token excluded).

What vLLM's CPU build drafts here, each checked against the harness: EAGLE-3 heads (eagle3 and
speculators layouts), Medusa heads and DFlash heads. Another head is refused in one line before
anything is exported (`REFUSED`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from data.engines.vllm import VllmConfig, VllmServer, local_target_dir
from data.errors import ConfigError
from eval.bench.methods import Record
from heads.interop.vllm_layouts import REFUSED, VLLM_FORMATS, VLLM_LAYOUTS, vllm_method_of

VLLM_METHODS = ("vllm_plain", "vllm_draft")


@dataclass
class VllmSettings:
    """evaluate.py's `vllm` block: the draft and the server's settings."""

    draft_format: str | None = None  # head_path's head exported as; null: its own layout
    draft_dir: str | None = None  # null: head_path's head, exported into the run dir
    num_speculative_tokens: int | None = None  # the chain vLLM drafts; null: the tree's depth
    threads: int | None = None  # vLLM's compute threads; null: the run's `threads`, else 1
    dtype: str | None = None  # null: the harness target's dtype
    kv_cache_gb: int = 2  # VLLM_CPU_KVCACHE_SPACE
    target_dir: str | None = None  # null: the folder the run's target loads from
    startup_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.draft_format is not None and self.draft_format not in VLLM_FORMATS:
            raise ConfigError(
                f"vllm.draft_format={self.draft_format!r}: use one of {', '.join(VLLM_FORMATS)}, "
                "or null for the head's own."
            )
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ConfigError("vllm.num_speculative_tokens must be at least 1, or null.")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"vllm.threads={self.threads}: use 1 or more, or null.")


def check_draft_head(head, draft_format: str | None = None) -> str:
    """The layout vllm_draft exports `head` in; refuses, before any export, a missing head, one
    vLLM's CPU build does not draft with, or a layout it is not served from."""
    if head is None:
        raise ConfigError("vllm_draft needs head_path=DIR (or vllm.draft_dir=DIR).")
    layouts = VLLM_LAYOUTS.get(head.method)
    if layouts is None:
        why = REFUSED.get(head.method, "vLLM has no drafter for it")
        raise ConfigError(
            f"methods: vllm_draft cannot serve a {head.method!r} head on CPU ({why}); drop "
            f"vllm_draft from methods, or benchmark a {', '.join(VLLM_LAYOUTS)} head."
        )
    if draft_format is not None and draft_format not in layouts:
        raise ConfigError(
            f"vllm.draft_format={draft_format}: a {head.method} head goes to vLLM as "
            f"{' or '.join(layouts)}; set one of them, or null."
        )
    return draft_format or layouts[0]


def speculative_config(draft_dir: str | Path, num_tokens: int) -> dict:
    """vLLM's --speculative-config for the draft in `draft_dir`: the method always named."""
    method = vllm_method_of(draft_dir)
    return {"method": method, "model": str(draft_dir), "num_speculative_tokens": num_tokens}


class VllmMethod:
    """One benchmark method served by one `vllm serve` (started on first use)."""

    def __init__(self, name: str, config: VllmConfig, eos_ids: list[int]) -> None:
        self.name, self.config, self.eos_ids = name, config, list(eos_ids)
        drafts = config.speculative is not None
        self.max_draft_depth = config.speculative["num_speculative_tokens"] if drafts else 0
        self.baseline = "vllm_plain" if drafts else None
        self.server: VllmServer | None = None

    def run(self, input_ids: Tensor, max_new_tokens: int) -> Record:
        if self.server is None:
            self.server = VllmServer(self.config).start()
        ids = input_ids[0].tolist()
        t0 = time.perf_counter()
        done = self.server.complete(ids, max_new_tokens, stop_token_ids=self.eos_ids)
        seconds = time.perf_counter() - t0
        if done.accepted_per_step is None:  # no draft: one token per forward
            lengths = [1] * max(len(done.tokens) - 1, 0)
        else:
            lengths = [a + 1 for a in done.accepted_per_step]
        return Record(
            tokens=done.tokens,
            target_forwards=1 + len(lengths),
            prefill_tokens=min(1, len(done.tokens)),
            accept_lengths=lengths,
            seconds=seconds,
        )

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def build_vllm_methods(names, settings: VllmSettings, eos_ids: list[int]) -> list[VllmMethod]:
    """The vLLM methods among `names`, in that order (settings resolved: folders given)."""
    if not settings.target_dir or not settings.num_speculative_tokens:
        raise ValueError("vLLM methods need vllm.target_dir and the chain (resolve them first).")
    base = dict(
        model=settings.target_dir,
        threads=settings.threads or 1,
        dtype=settings.dtype or "float32",
        kv_cache_gb=settings.kv_cache_gb,
        startup_timeout_s=settings.startup_timeout_s,
    )
    out = []
    for name in names:
        if name == "vllm_plain":
            out.append(VllmMethod(name, VllmConfig(**base), eos_ids))
        elif name == "vllm_draft":
            if not settings.draft_dir:
                raise ValueError("vllm_draft needs vllm.draft_dir (or head_path).")
            spec = speculative_config(settings.draft_dir, settings.num_speculative_tokens)
            out.append(VllmMethod(name, VllmConfig(**base, speculative=spec), eos_ids))
    return out


def vllm_settings(cfg, head, run_target, out_dir: Path, tree_depth: int) -> VllmSettings:
    """evaluate.py's `vllm` block resolved: the target folder, the dtype and threads of the run,
    the chain (null: `tree_depth`, the run's tree) and the draft folder (head_path's head
    exported into the run dir in `draft_format`)."""
    from omegaconf import OmegaConf

    from heads.interop import export_draft

    doc = OmegaConf.to_container(cfg.vllm, resolve=True)
    settings = VllmSettings(**doc)
    target = run_target.target
    if settings.target_dir is None:
        settings.target_dir = local_target_dir(
            run_target.source, run_target.config.revision, "or set vllm.target_dir=DIR"
        )
    if settings.dtype is None:
        settings.dtype = str(next(target.model.parameters()).dtype).removeprefix("torch.")
    if settings.threads is None:
        settings.threads = int(cfg.get("threads") or 1)
    if settings.num_speculative_tokens is None:
        settings.num_speculative_tokens = tree_depth
    if settings.draft_dir is None and "vllm_draft" in cfg.methods:
        settings.draft_format = check_draft_head(head, settings.draft_format)
        deepest = head.max_draft_depth
        if deepest is not None and settings.num_speculative_tokens > deepest:
            raise ConfigError(
                f"vllm.num_speculative_tokens={settings.num_speculative_tokens}: this "
                f"{head.method} head drafts at most {deepest} tokens a step; set it to {deepest} "
                "or fewer (null: the run's tree depth)."
            )
        folder = Path(out_dir) / f"vllm-draft-{settings.draft_format}"
        export_draft(head, target, settings.draft_format, folder, verifier=settings.target_dir)
        settings.draft_dir = str(folder)
    return settings
