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
- a restart reads the keys already written (the output and any per-rank part files) and skips
  them, so nothing is generated twice;
- under `accelerate launch` rank r takes every W-th item and writes `OUT.rank{r}.jsonl`; when all
  ranks are done rank 0 merges the parts into OUT (dropping duplicate keys) and removes them.
  A restart may use another number of processes.
- prompts whose rendered conversation exceeds `max_prompt_tokens` at some turn keep the turns
  before it; if that leaves no answer, the key goes to `OUT.skipped.jsonl` with the reason.

The settings and the target's fingerprint live in `OUT.meta.json`; a restart with other settings
or another target is refused (mixing them would silently blend two datasets).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data.chat import ChatEncoder
from data.engines.server_generation import ServerBackendConfig, ServerGenerator
from data.formats import DataFormatError, read_prompts
from data.parts import append_rows, merge_parts, part_files, part_path, read_rows, repair_tail
from data.paths import atomic_write, resolve_path
from data.synthesize import SynthesisSpec, sample_user_turns, synthesis_spec, synthesize

log = logging.getLogger(__name__)
GENERATION_DTYPES = ("float32", "bfloat16", "float16")  # distill.dtype (the hf backend)


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
        target cast once; null: the target as loaded. bfloat16 roughly doubles the rate on CPUs
        with AMX or AVX512-BF16; its greedy answers can part from float32's at near ties, so the
        dtype is part of the settings (a file is never continued in another dtype).
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
    # threads) or "openai" (any OpenAI-compatible server at `server_url`: vLLM, SGLang).
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
        if self.dtype is not None and self.backend != "hf":
            raise ValueError(
                f"distill.dtype applies to the hf backend; {self.backend!r} runs its own "
                "engine (for llama_cpp pick the GGUF type with distill.gguf, e.g. bf16)."
            )
        self.server = ServerBackendConfig(
            backend=self.backend,
            gguf=self.gguf,
            server_url=self.server_url,
            model=self.server_model,
            parallel=self.parallel,
            threads=self.threads,
        )
        if self.out in ("", "???"):
            raise ValueError("distill.out is required: the conversations JSONL to write.")
        if not self.prompts:
            raise ValueError("distill.prompts is empty: give at least one prompt file.")
        self.prompts = [_prompt_spec(p) for p in self.prompts]
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


@dataclass
class WorkItem:
    """One conversation to write. A None turn is a user turn the target writes itself (a
    synthesised follow-up, sampled as `synth` says); `system` opens the conversation."""

    key: str
    source: str
    prompt_id: str
    sample: int
    turns: list[str | None]
    system: str | None = None
    synth: SynthesisSpec | None = None


def synthesis_specs(cfg: DistillConfig) -> list[SynthesisSpec]:
    return [SynthesisSpec(**p["synthesize"]) for p in cfg.prompts if "synthesize" in p]


def work_items(
    cfg: DistillConfig, synthesized: dict[str, list[dict]] | None = None
) -> list[WorkItem]:
    """Every (prompt, sample) of every source, in a fixed order. synthesized: the accepted
    prompts of each synthesis entry by name (data.synthesize.synthesize)."""
    items, seen = [], set()
    for spec in cfg.prompts:
        if "synthesize" in spec:
            synth = SynthesisSpec(**spec["synthesize"])
            if synth.name in seen:
                raise DataFormatError(
                    f"two prompt sources are named {synth.name!r}; give each synthesis entry "
                    "its own name"
                )
            seen.add(synth.name)
            for prompt in (synthesized or {}).get(synth.name, []):
                for sample in range(cfg.num_samples):
                    key = f"{synth.name}/{prompt['id']}/{sample}"
                    items.append(
                        WorkItem(
                            key,
                            synth.name,
                            str(prompt["id"]),
                            sample,
                            prompt["turns"],
                            synth.system,
                            synth,
                        )
                    )
            continue
        source = spec["path"]
        path = resolve_path(source)
        found = str(path) if path.exists() else source
        prompts = read_prompts(found, split=spec["split"])[spec["skip"] :]
        limit = spec["max_rows"] if spec["max_rows"] is not None else cfg.max_rows
        name = Path(source).stem if path.exists() else source
        if name == "question" or name in seen:  # e.g. data/corpora/X/question.jsonl
            name = f"{Path(source).parent.name}_{name}"
        seen.add(name)
        for prompt in prompts[:limit] if limit else prompts:
            for sample in range(cfg.num_samples):
                key = f"{name}/{prompt['id']}/{sample}"
                items.append(WorkItem(key, name, str(prompt["id"]), sample, prompt["turns"]))
    keys = [item.key for item in items]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise DataFormatError(f"prompt id {dup!r} occurs twice in one source; ids must be unique.")
    return items


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
                    f"{meta[key]!r}. Continue with the same settings, or write to a new "
                    "distill.out (or delete the old output and its .meta.json)."
                )
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2) + "\n"))


# ---- generation ------------------------------------------------------------------------------


class _Generator:
    """Batched `generate` with left padding, one turn of several conversations at a time."""

    def __init__(self, target, cfg: DistillConfig, encoder: ChatEncoder, eos_ids: list[int]):
        from transformers import GenerationConfig

        from data.generation import NEUTRAL_PROCESSORS

        self.model, self.tok = _generation_model(target.model, cfg.dtype), target.tokenizer
        self.cfg, self.encoder = cfg, encoder
        self.eos = set(eos_ids)
        pad = self.tok.pad_token_id
        self.pad = pad if pad is not None else eos_ids[0]
        self._config = lambda temperature, top_p, max_new_tokens: GenerationConfig(
            max_new_tokens=max_new_tokens,
            min_length=0,
            num_beams=1,
            **(
                NEUTRAL_PROCESSORS
                | (
                    {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
                    if temperature > 0
                    else {"do_sample": False}
                )
            ),
            eos_token_id=eos_ids,
            pad_token_id=self.pad,
        )
        self.config = self._config(cfg.temperature, cfg.top_p, cfg.max_new_tokens)

    def __enter__(self) -> _Generator:  # nothing to start: the model is in this process
        return self

    def __exit__(self, *exc) -> None:
        self.model = None  # frees a cast copy (the target itself stays loaded)

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        seed: int,
        temperature: float | None = None,
        top_p: float | None = None,
        max_new_tokens: int | None = None,
    ) -> list[tuple[list[int], str]]:
        """(answer ids without EOS, "eos" | "length") for each prompt; temperature, top_p and
        max_new_tokens override the answer settings (prompt synthesis samples user turns).
        Prompts are generated in length-sorted groups of batch_size (little padding)."""
        config = self.config
        if temperature is not None or top_p is not None or max_new_tokens is not None:
            config = self._config(
                self.cfg.temperature if temperature is None else temperature,
                self.cfg.top_p if top_p is None else top_p,
                self.cfg.max_new_tokens if max_new_tokens is None else max_new_tokens,
            )
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        answers: list = [None] * len(prompts)
        size = self.cfg.batch_size
        for g, start in enumerate(range(0, len(order), size)):
            group = order[start : start + size]
            done = self._batch([prompts[i] for i in group], (seed + g) % 2**31, config)
            for i, answer in zip(group, done):
                answers[i] = answer
        return answers

    def _batch(self, prompts: list[list[int]], seed: int, config) -> list[tuple[list[int], str]]:
        width = max(map(len, prompts))
        device = self.model.device
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row ends where generation starts
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        torch.manual_seed(seed)
        out = self.model.generate(
            ids.to(device), attention_mask=mask.to(device), generation_config=config
        )
        answers = []
        for row in out[:, width:].tolist():
            cut = next((j for j, t in enumerate(row) if t in self.eos), None)
            answers.append((row, "length") if cut is None else (row[:cut], "eos"))
        return answers


def _generation_model(model, dtype: str | None):
    """The model `generate` runs on: the target itself, or a copy cast to `dtype` (the target
    keeps its weights; features and training read it unchanged)."""
    if dtype is None or getattr(torch, dtype) == model.dtype:
        return model
    import copy

    return copy.deepcopy(model).to(getattr(torch, dtype)).eval()


def _seed(base: int, keys: Sequence[str], turn: int) -> int:
    digest = hashlib.sha1(f"{base}|{turn}|{'|'.join(keys)}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


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
    bar = _progress(len(todo), progress and rank == 0)
    t0 = time.perf_counter()
    if todo:
        _generate_all(generator(), todo, cfg, meta, (mine_path, skipped_path(out)), stats, bar, t0)
    if bar is not None:
        bar.close()
    stats["tokens_per_s"] = stats["new_tokens"] / stats["seconds"] if stats["seconds"] else 0.0
    return stats


def _generate_all(gen, todo, cfg: DistillConfig, meta: dict, paths, stats: dict, bar, t0) -> None:
    mine_path, skipped_file = paths
    if cfg.backend == "hf":  # several batches per chunk: each batch holds prompts of similar length
        chunks = (todo[s : s + 4 * cfg.batch_size] for s in range(0, len(todo), 4 * cfg.batch_size))
        results = (_run_batch(gen, chunk, cfg, meta) + (len(chunk),) for chunk in chunks)
    else:
        results = _stream_each(gen, todo, cfg, meta)
    for rows, skipped, tokens, count in results:
        append_rows(mine_path, rows)
        append_rows(skipped_file, skipped)
        stats["rows"] += len(rows)
        stats["skipped"] += len(skipped)
        stats["new_tokens"] += tokens
        stats["seconds"] = time.perf_counter() - t0
        if bar is not None:
            bar.update(count)
            bar.set_postfix(tok_s=f"{stats['new_tokens'] / stats['seconds']:.0f}")


def _stream_each(gen, todo: list[WorkItem], cfg: DistillConfig, meta: dict):
    """A server's work as a stream: every conversation runs its turns on its own, `parallel` at
    a time, and a slot takes the next conversation as soon as it is free, even while an earlier
    one is still running: no barrier where a group of conversations waits for its slowest
    answer. Results are yielded in `todo`'s order (the file stays in order, so a prefix of it is
    a budget): finished conversations behind a slow one wait in memory, at most 16 x `parallel`
    of them. Yields (rows, skipped, new tokens, 1) per conversation."""
    from concurrent.futures import FIRST_COMPLETED, wait

    running_max, buffered_max = 2 * cfg.parallel, 16 * cfg.parallel
    pool = ThreadPoolExecutor(max_workers=cfg.parallel)
    futures: dict = {}
    submitted = written = 0
    try:
        while written < len(todo):
            running = [f for f in futures.values() if not f.done()]
            while (
                submitted < len(todo)
                and len(running) < running_max
                and submitted - written < buffered_max
            ):
                future = pool.submit(_run_batch, gen, [todo[submitted]], cfg, meta)
                futures[submitted] = future
                running.append(future)
                submitted += 1
            head = futures[written]
            if not head.done():
                wait(running, return_when=FIRST_COMPLETED)
                continue
            rows, skipped, tokens = futures.pop(written).result()
            written += 1
            yield rows, skipped, tokens, 1
    finally:  # on an error (or a closed generator) drop what has not started
        pool.shutdown(wait=True, cancel_futures=True)


def _make_generator(target, cfg: DistillConfig, encoder: ChatEncoder, eos: list[int]):
    """The HF generator, or a server's behind the same `generate`; both are context managers
    (a server starts on enter and stops on exit)."""
    if cfg.backend == "hf":
        return _Generator(target, cfg, encoder, eos)
    return ServerGenerator(cfg.server, encoder, cfg.max_new_tokens, cfg.temperature, cfg.top_p, eos)


def _run_batch(gen: _Generator, batch: list[WorkItem], cfg: DistillConfig, meta: dict):
    """All turns of a batch of conversations: (rows, skipped rows, new tokens)."""
    histories: list[list[dict]] = [
        [{"role": "system", "content": item.system}] if item.system else [] for item in batch
    ]
    finish: list[list[str]] = [[] for _ in batch]
    open_items = set(range(len(batch)))
    reasons: dict[int, str] = {}
    tokens = 0
    for turn in range(max(len(item.turns) for item in batch)):
        user = _user_turns(gen, batch, histories, open_items, turn, cfg, reasons)
        active, prompts = [], []
        for i in sorted(open_items):
            if turn >= len(batch[i].turns):
                continue
            history = histories[i] + [{"role": "user", "content": user[i]}]
            ids = gen.encoder.prompt(history)
            if len(ids) > cfg.max_prompt_tokens:
                open_items.discard(i)  # the conversation ends before this turn
                reasons[i] = f"turn {turn + 1} prompt has {len(ids)} > max_prompt_tokens tokens"
                continue
            histories[i] = history
            active.append(i)
            prompts.append(ids)
        if not active:
            break
        answers = gen.generate(prompts, _seed(cfg.seed, [batch[i].key for i in active], turn))
        for i, (ids, why) in zip(active, answers):
            text = gen.tok.decode(ids, skip_special_tokens=True)
            histories[i].append({"role": "assistant", "content": text})
            finish[i].append(why)
            tokens += len(ids) + (why == "eos")
    rows, skipped = [], []
    for i, item in enumerate(batch):
        history = histories[i]
        if not any(m["role"] == "assistant" for m in history):
            skipped.append({"id": item.key, "reason": reasons.get(i, "no turn generated")})
            continue
        rows.append(
            {
                "id": item.key,
                "source": item.source,
                "prompt_id": item.prompt_id,
                "sample": item.sample,
                "messages": history,
                "finish": finish[i],
                "target_fingerprint": meta["target_fingerprint"],
            }
        )
    return rows, skipped, tokens


def _user_turns(gen, batch, histories, open_items, turn: int, cfg, reasons) -> dict[int, str]:
    """This turn's user text per open conversation: given, or (None in the prompt) sampled by
    the target after the conversation so far; a sampled turn the filters reject ends the
    conversation before it."""
    user, ask = {}, []
    for i in sorted(open_items):
        if turn < len(batch[i].turns):
            if batch[i].turns[turn] is None:
                ask.append(i)
            else:
                user[i] = batch[i].turns[turn]
    for synth in {id(batch[i].synth): batch[i].synth for i in ask}.values():
        group = [i for i in ask if batch[i].synth is synth]
        seed = _seed(cfg.seed, [batch[i].key for i in group], turn) ^ 0x5A5A
        sampled = sample_user_turns(gen, gen.encoder, [histories[i] for i in group], synth, seed)
        for i, (text, reject) in zip(group, sampled):
            if reject:
                open_items.discard(i)
                reasons[i] = f"turn {turn + 1}: the sampled follow-up was rejected ({reject})"
            else:
                user[i] = text
    return user


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
