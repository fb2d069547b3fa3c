"""Self-distillation: regenerate the assistant turns of a prompt set with the target itself.

A draft head is scored on how often it guesses what the *target* would say, so the best training
text is the target's own output. `distill` takes prompts (anything `data.read_prompts` reads:
MT-bench style `turns`, `prompt`, Alpaca `instruction`, or the user turns of ShareGPT / OpenAI
conversations) and writes a conversations JSONL (OpenAI `messages`) in which every assistant
turn is the target's answer to the conversation so far: multi-turn prompts replay their user
turns and regenerate each answer in turn.

Each work item is (prompt, sample index); its key `SOURCE/PROMPT_ID/SAMPLE` is unique and is
what resume counts on:

- rows are appended one batch at a time and fsynced, so a killed run loses at most the batch in
  flight; a half-written last line is cut off on restart;
- Ctrl-C stops at once (a server backend's answers in flight are dropped, the llama-server or
  vllm serve it started is stopped) after writing every conversation already finished, and
  raises `Interrupted` saying how many are kept;
- a restart reads the keys already written (the output and any per-rank part files) and skips
  them, so nothing is generated twice;
- under `accelerate launch` rank r takes every W-th item and writes `OUT.rank{r}.jsonl`; when all
  ranks are done rank 0 merges the parts into OUT (dropping duplicate keys) and removes them.
  A restart may use another number of processes.
- prompts whose rendered conversation exceeds `max_prompt_tokens` at some turn keep the turns
  before it; if that leaves no answer, the key goes to `OUT.skipped.jsonl` with the reason.

The settings and the target's fingerprint live in `OUT.meta.json`; a restart with other settings
or another target is refused (mixing them would silently blend two datasets).

Here: the settings and the run. The work items and a batch's turns are data/distill_work.py, the
part files data/parts.py, the backends data/engines/ (hf_generation.py, server_generation.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field
from pathlib import Path

from data.chat import ChatEncoder
from data.distill_work import WorkItem, run_batch, synthesis_specs, work_items
from data.engines.hf_generation import HFGenerator
from data.engines.server_generation import RequestPool, ServerBackendConfig, ServerGenerator
from data.engines.vllm import VLLM_ENGINE
from data.errors import Interrupted
from data.parts import append_rows, merge_parts, part_files, part_path, read_rows, repair_tail
from data.paths import atomic_write, resolve_path, sole_writer
from data.synthesize import synthesis_spec, synthesize

log = logging.getLogger(__name__)
GENERATION_DTYPES = ("float32", "bfloat16", "float16")  # distill.dtype (the hf backend)


def _check_source_names(prompts: list[dict]) -> None:
    """A synthesis entry's name keys its conversations, so it may not repeat an earlier
    source's (a file's stem); checked here, before minutes of generation, not after."""
    seen: set[str] = set()
    for spec in prompts:
        if "synthesize" in spec:
            name = spec["synthesize"].get("name", "synth")
            if name in seen:
                raise ValueError(
                    f"two prompt sources are named {name!r}; give the synthesis entry its own "
                    "name (e.g. name: written)"
                )
        else:
            name = Path(str(spec["path"])).stem
        seen.add(name)


@dataclass
class DistillConfig:
    """How to regenerate.

    prompts: prompt files (or hub datasets) for `data.read_prompts`; an entry is a path, or a
        mapping {path, skip, max_rows, split} taking prompts skip .. skip+max_rows of that source
        (e.g. to leave out prompts an evaluator decodes; split: a hub dataset's split).
    out: the conversations JSONL to write (OUT.meta.json and, while running, part files beside).
    temperature: 0 for greedy decoding; > 0 samples (with top_p).
    num_samples: answers per prompt (each its own conversation); with greedy decoding only 1
        makes sense and more are refused.
    max_rows: use the first N prompts of each source (null: all).
    max_prompt_tokens: a turn whose rendered prompt is longer is not generated (see module doc).
    dtype: the hf backend generates in this dtype (float32, bfloat16, float16) on a copy of the
        target cast once, the vllm backend serves the target in it; null: the target's dtype as
        loaded. bfloat16 roughly doubles the rate on CPUs with AMX or AVX512-BF16; its greedy
        answers can part from float32's at near ties, so the dtype is part of the settings (a
        file is never continued in another dtype).
    """

    prompts: list = field(default_factory=list)
    out: str = "???"
    max_new_tokens: int = 256
    batch_size: int = 8
    temperature: float = 0.0
    top_p: float = 1.0
    num_samples: int = 1
    max_rows: int | None = None
    max_prompt_tokens: int = 1536
    seed: int = 0
    # Where answers come from (data/engines/server_generation.py): "hf" (generate, batched),
    # "llama_cpp" (a llama-server on the target GGUF `gguf`, `parallel` slots, `threads`
    # threads), "vllm" (a `vllm serve` of the target's folder, `parallel` sequences, `threads`
    # threads, in `dtype`) or "openai" (any OpenAI-compatible server at `server_url`).
    backend: str = "hf"
    gguf: str | None = None
    server_url: str | None = None
    server_model: str | None = None
    parallel: int = 8
    threads: int = 2
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in GENERATION_DTYPES:
            raise ValueError(
                f"distill.dtype={self.dtype!r}: use one of {', '.join(GENERATION_DTYPES)}, or "
                "null for the target's own dtype."
            )
        if self.dtype is not None and self.backend not in ("hf", "vllm"):
            raise ValueError(
                f"distill.dtype applies to the hf backend (and vllm); {self.backend!r} runs its "
                "own engine (for llama_cpp pick the GGUF type with distill.gguf, e.g. bf16)."
            )
        self.server = ServerBackendConfig(
            backend=self.backend,
            gguf=self.gguf,
            server_url=self.server_url,
            model=self.server_model,
            parallel=self.parallel,
            threads=self.threads,
            dtype=self.dtype,
            max_model_len=self.max_prompt_tokens + self.max_new_tokens,
        )
        if self.out in ("", "???"):
            raise ValueError("distill.out is required: the conversations JSONL to write.")
        if not self.prompts:
            raise ValueError("distill.prompts is empty: give at least one prompt file.")
        self.prompts = [_prompt_spec(p) for p in self.prompts]
        _check_source_names(self.prompts)
        if self.temperature < 0:
            raise ValueError(f"distill.temperature={self.temperature}: use 0 (greedy) or > 0.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"distill.top_p={self.top_p}: use a value in (0, 1].")
        if self.num_samples < 1:
            raise ValueError(f"distill.num_samples={self.num_samples}: need at least 1.")
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError(
                f"distill.num_samples={self.num_samples} with greedy decoding would write the "
                "same answer several times: set distill.temperature > 0 (e.g. 0.7) or use 1."
            )
        for name in ("max_new_tokens", "batch_size", "max_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"distill.{name}={getattr(self, name)}: need at least 1.")

    def settings(self) -> dict:
        """What decides the output text (recorded in OUT.meta.json and checked on resume)."""
        keep = ("max_new_tokens", "temperature", "top_p", "num_samples", "max_prompt_tokens")
        settings = {k: getattr(self, k) for k in keep} | {"seed": self.seed}
        synth = [p["synthesize"] for p in self.prompts if "synthesize" in p]
        if synth:  # the synthesis settings decide which prompts a key names
            settings["synthesize"] = synth
        if self.backend != "hf":  # another engine's kernels write other text: never mix them
            engine = Path(self.gguf).name if self.gguf else self.server_url
            engine = VLLM_ENGINE if self.backend == "vllm" else engine  # a stray gguf: not it
            settings |= {"backend": self.backend, "engine": engine}
        if self.dtype is not None:  # likewise another dtype's rounding (absent: files keep keys)
            settings["dtype"] = self.dtype
        return settings


def _prompt_spec(entry) -> dict:
    """A prompts entry as {path, skip, max_rows, split}, or {synthesize: {SynthesisSpec fields}}
    for prompts the target writes itself (data/synthesize.py)."""
    if isinstance(entry, str):
        return {"path": entry, "skip": 0, "max_rows": None, "split": "train"}
    entry = dict(entry)
    if "synthesize" in entry:
        if isinstance(entry["synthesize"], dict):  # already normalised
            entry = entry["synthesize"]
        return {"synthesize": dataclasses.asdict(synthesis_spec(entry))}
    unknown = set(entry) - {"path", "skip", "max_rows", "split"}
    if "path" not in entry or unknown:
        raise ValueError(
            f"distill.prompts entry {entry}: give a path, or a mapping with 'path' and optionally "
            f"'skip', 'max_rows' and 'split' (unknown keys: {sorted(unknown)})."
        )
    skip, rows = int(entry.get("skip") or 0), entry.get("max_rows")
    if skip < 0 or (rows is not None and int(rows) < 1):
        raise ValueError(f"distill.prompts entry {entry}: skip must be >= 0 and max_rows >= 1.")
    return {
        "path": str(entry["path"]),
        "skip": skip,
        "max_rows": None if rows is None else int(rows),
        "split": str(entry.get("split") or "train"),
    }


# ---- files -----------------------------------------------------------------------------------


def skipped_path(out: Path) -> Path:
    return out.with_name(f"{out.name}.skipped.jsonl")


def meta_path(out: Path) -> Path:
    return out.with_name(f"{out.name}.meta.json")


def _files(out: Path) -> list[Path]:
    return [p for p in (out, *part_files(out), skipped_path(out)) if p.is_file()]


def done_keys(out: Path) -> set[str]:
    """Keys already written (output, part files, skipped list)."""
    keys: set[str] = set()
    for path in _files(out):
        keys.update(row["id"] for row in read_rows(path))
    return keys


def check_meta(out: Path, meta: dict) -> None:
    """Write OUT.meta.json, or refuse to continue a file made with other settings / target."""
    path = meta_path(out)
    if path.is_file():
        old = json.loads(path.read_text())
        for key in ("target_fingerprint", "settings", "chat_template_sha1"):
            if old.get(key) != meta[key]:
                raise ValueError(
                    f"{out} was generated with {key}={old.get(key)!r}, this run has "
                    f"{meta[key]!r}. Continue with the same settings, or write to another file "
                    "(data.self_distill.out; distill.out in scripts/self_distill.py), or delete "
                    "the old output and its .meta.json."
                )
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2) + "\n"))


def distill(
    target,
    cfg: DistillConfig,
    rank: int = 0,
    world_size: int = 1,
    chat_template: str | None = None,
    barrier=None,
    progress: bool = True,
) -> dict:
    """Generate every missing row; returns counts and throughput of this process.

    barrier: called when this rank is done, before rank 0 merges the part files (accelerate's
    `wait_for_everyone`); not needed with one process.
    """
    from data.generation import eos_token_ids

    out = resolve_path(cfg.out) if not Path(cfg.out).is_absolute() else Path(cfg.out)
    encoder = ChatEncoder(target.tokenizer, chat_template)
    meta = {
        "target": target.name_or_path,
        "target_fingerprint": target.fingerprint,
        "chat_template_sha1": hashlib.sha1(encoder.template.encode()).hexdigest(),
        "settings": cfg.settings(),
        "prompts": list(cfg.prompts),
        "max_rows": cfg.max_rows,
    }
    if rank == 0:
        check_meta(out, meta)
    if barrier is not None:
        barrier()
    if rank != 0:
        check_meta(out, meta)
    mine_path = out if world_size == 1 else part_path(out, rank)
    for path in {mine_path, skipped_path(out)}:
        repair_tail(path)
    eos = eos_token_ids(target)
    if not eos:
        raise ValueError("the target has no EOS token id: answers would never end.")
    stack = contextlib.ExitStack()
    started: list = []

    def generator():  # started on first use: nothing to do, no server
        if not started:
            started.append(stack.enter_context(_make_generator(target, cfg, encoder, eos)))
        return started[0]

    with stack:
        synthesized = {
            spec.name: synthesize(
                spec, out, cfg.seed, generator, encoder, rank, world_size, barrier
            )
            for spec in synthesis_specs(cfg)
        }
        stats = _distill_items(cfg, out, meta, synthesized, generator, rank, world_size, progress)
    if barrier is not None:
        barrier()
    if rank == 0:
        moved = merge_parts(out)
        if moved:
            log.info("merged %d rows from part files into %s", moved, out)
    return stats


def _distill_items(cfg, out, meta, synthesized, generator, rank, world_size, progress) -> dict:
    mine_path = out if world_size == 1 else part_path(out, rank)
    done = done_keys(out)
    items = work_items(cfg, synthesized)[rank::world_size]
    todo = [item for item in items if item.key not in done]
    log.info(
        "rank %d: %d items, %d already written, %d to go",
        rank,
        len(items),
        len(items) - len(todo),
        len(todo),
    )
    stats = {"rows": 0, "skipped": 0, "new_tokens": 0, "seconds": 0.0}
    t0 = time.perf_counter()
    if todo:
        with sole_writer(mine_path):  # two runs appending to one file would interleave rows
            gen = generator()  # a server that fails to start does so before the bar is drawn
            bar = _progress(len(todo), progress and rank == 0)
            try:
                _generate_all(gen, todo, cfg, meta, (mine_path, skipped_path(out)), stats, bar, t0)
            except KeyboardInterrupt as interrupt:  # counted from the files: Ctrl-C may have
                kept = len(done_keys(out) & {item.key for item in items})  # cut a count short
                raise Interrupted(
                    f"{kept} of {len(items)} conversations kept in {mine_path}; rerun the same "
                    "command to continue"
                ) from interrupt
            finally:
                if bar is not None:
                    bar.close()
    stats["tokens_per_s"] = stats["new_tokens"] / stats["seconds"] if stats["seconds"] else 0.0
    return stats


def _generate_all(gen, todo, cfg: DistillConfig, meta: dict, paths, stats: dict, bar, t0) -> None:
    mine_path, skipped_file = paths

    def keep(rows: list, skipped: list, tokens: int, count: int = 1) -> None:
        append_rows(mine_path, rows)
        append_rows(skipped_file, skipped)
        stats["rows"] += len(rows)
        stats["skipped"] += len(skipped)
        stats["new_tokens"] += tokens
        stats["seconds"] = time.perf_counter() - t0
        if bar is not None and cfg.backend == "hf":
            bar.update(count)
            bar.set_postfix(tok_s=f"{stats['new_tokens'] / stats['seconds']:.0f}")

    if cfg.backend == "hf":  # several batches per chunk: each batch holds prompts of similar length
        for start in range(0, len(todo), 4 * cfg.batch_size):
            chunk = todo[start : start + 4 * cfg.batch_size]
            keep(*run_batch(gen, chunk, cfg, meta), len(chunk))
    else:
        _stream_each(gen, todo, cfg, meta, keep, _server_progress(bar, gen, t0))


def _server_progress(bar, gen, t0: float):
    """A server stream's bar: conversations as they finish, and the tokens generated so far,
    those of the answers still running included (a long answer ends minutes after it starts)."""
    if bar is None:
        return None
    shown = {"tokens": 0, "asked": 0.0}

    def tick(finished: int) -> None:
        bar.update(finished - bar.n)
        recent = time.perf_counter() - shown["asked"] < TICK_S  # asks the server every TICK_S
        if recent and finished < bar.total:  # (and once at the end)
            return
        shown["asked"] = time.perf_counter()
        shown["tokens"] = max(shown["tokens"], gen.tokens_generated())  # never counts back
        rate = shown["tokens"] / max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix({"tokens": shown["tokens"], "tok_s": f"{rate:.0f}"})

    return tick


TICK_S = 2.0  # a server stream's progress (and a Ctrl-C caught by another thread) every this


def _stream_each(gen, todo: list[WorkItem], cfg, meta: dict, keep, tick=None) -> None:
    """A server's work as a stream: every conversation runs its turns on its own, `parallel` at
    a time, and a slot takes the next conversation as soon as it is free, even while an earlier
    one is still running: no barrier where a group of conversations waits for its slowest
    answer. `keep(rows, skipped, new tokens)` gets the conversations in `todo`'s order (the file
    stays in order, so a prefix of it is a budget): finished conversations behind a slow one
    wait in memory, at most 16 x `parallel` of them. Within each window of that many,
    conversations start longest first (most generations: answers plus synthesised follow-ups),
    so the run does not end on a tail of multi-turn conversations whose turns must wait for
    each other while slots sit idle. `tick(finished conversations)` is called every TICK_S.

    On Ctrl-C or a failed request it stops waiting at once: every finished conversation is
    kept, those waiting behind an unfinished one included (so the file's order then differs
    from an uninterrupted run's; the rows are the same), and the ones running are abandoned."""
    running_max, buffered_max = 2 * cfg.parallel, 16 * cfg.parallel
    pool = RequestPool(cfg.parallel)
    futures: dict = {}
    order = start_order(todo, buffered_max)
    submitted = written = 0
    try:
        while written < len(todo):
            running = [f for f in futures.values() if not f.done()]
            while (
                submitted < len(todo)
                and len(running) < running_max
                and submitted - written < buffered_max
            ):
                index = order[submitted]
                futures[index] = pool.submit(run_batch, gen, [todo[index]], cfg, meta)
                running.append(futures[index])
                submitted += 1
            head = futures.get(written)  # None: not started yet (slots busy with longer ones)
            if head is None or not head.done():
                done, _ = wait(running, timeout=TICK_S, return_when=FIRST_COMPLETED)
                failed = next((f for f in done if f.exception() is not None), None)
                if failed is not None:  # a dead server fails every request: stop at the first
                    failed.result()
                if tick is not None:
                    tick(written + sum(f.done() for f in futures.values()))
                continue
            keep(*futures.pop(written).result())
            written += 1
        if tick is not None:
            tick(written)
    except BaseException:  # Ctrl-C or a failure: keep what is done, in order, then stop
        for index in sorted(futures):
            future = futures[index]
            if future.done() and not future.cancelled() and future.exception() is None:
                keep(*future.result())
        raise
    finally:  # drop what has not started; what runs is abandoned (its server is stopped)
        pool.close()


def generations(item: WorkItem) -> int:
    """How many texts the target writes for a conversation: an answer per user turn, plus each
    user turn it writes itself (None)."""
    return len(item.turns) + sum(turn is None for turn in item.turns)


def start_order(todo: Sequence[WorkItem], window: int) -> list[int]:
    """The order a server stream starts `todo` in: window by window (so results never wait
    behind more than `window` others), most generations first within each, otherwise in order.
    The head of the file is always inside the window being started, so it is never starved."""
    order: list[int] = []
    for first in range(0, len(todo), window):
        block = range(first, min(first + window, len(todo)))
        order.extend(sorted(block, key=lambda i: -generations(todo[i])))
    return order


def _make_generator(target, cfg: DistillConfig, encoder: ChatEncoder, eos: list[int]):
    """The HF generator, or a server's behind the same `generate`; both are context managers
    (a server starts on enter and stops on exit)."""
    if cfg.backend == "hf":
        return HFGenerator(target, cfg, encoder, eos)
    server = cfg.server.for_target(target.model)  # vllm: the folder the target came from
    return ServerGenerator(server, encoder, cfg.max_new_tokens, cfg.temperature, cfg.top_p, eos)


def _progress(total: int, enabled: bool):
    if not enabled or total == 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="self-distill", unit="conv")


__all__ = [
    "DistillConfig",
    "WorkItem",
    "distill",
    "done_keys",
    "merge_parts",
    "repair_tail",
    "work_items",
]
