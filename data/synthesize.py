"""Prompts written by the target itself (Magpie-style self-synthesis).

An instruct model that is shown its chat template up to the start of a user turn continues it
with a plausible user request. `data.self_distill.prompts` entries of the form
``{synthesize: N, ...}`` use that: the target writes N first user turns (sampled, filtered and
de-duplicated here), then answers them like any other prompt (data/distill.py), and with
``follow_ups: k`` it also writes k later user turns, each after its own answer to the turn
before. The data then needs no corpus, only the target.

Candidates are written to a resumable JSONL file beside the distillation output
(``OUT.synth-<name>-<digest>.jsonl``), in fixed blocks of :data:`BLOCK` candidates: block b holds
candidates ``b*BLOCK .. (b+1)*BLOCK-1`` and is generated with a seed derived from (seed, name, b),
so the text of a candidate does not depend on how many processes wrote it or how often the run
was interrupted (a block is appended in one write; a half-written one is cut off and redone).
Under ``accelerate launch`` every process generates its own blocks into a part file; all of them
then read every file and take the same decision.

Which candidates become prompts is decided from the file alone, in candidate order: a candidate
is rejected by the filters (:func:`reject_reason`: empty, cut at the token limit, too short, too
long, repeated text, non-printable characters, template markers), then as an exact duplicate
(same text after normalising case, punctuation and spacing) or a near duplicate (word-trigram
Jaccard similarity to an earlier accepted prompt at or above ``near_duplicate``); the first N
survivors are the prompts. Generation stops once N are accepted (or after ``max_candidates``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from data.errors import ConfigError
from data.parts import append_rows, merge_parts, part_files, part_path, read_rows, repair_tail
from data.paths import resolve_path

log = logging.getLogger(__name__)

BLOCK = 32  # candidates per generation block (fixed: it decides which seed writes which text)
_FIELDS_HELP = (
    "synthesize (count), name, system, follow_ups, temperature, top_p, top_k, max_new_tokens, "
    "min_chars, max_chars, min_words, near_duplicate, max_candidates, seed, openings"
)


@dataclass
class SynthesisSpec:
    """One `{synthesize: N, ...}` prompts entry.

    synthesize: how many first user turns to keep.
    name: the source name in the conversation keys (``NAME/INDEX/SAMPLE``).
    system: a system message to start every conversation with (null: the template's default).
    follow_ups: later user turns the target writes after its own answers (0: single-turn).
    temperature / top_p / top_k / max_new_tokens: how user turns are sampled; a turn that
        reaches max_new_tokens without ending is dropped (it was cut mid-request). top_k 0 (no
        cut) makes llama-server sort the whole vocabulary for every slot and token: at Qwen's
        152k ids it lost a quarter of its speed at 8 slots; large vocabularies want top_k 50.
    min_chars / max_chars / min_words: length filters on the stripped text.
    near_duplicate: word-trigram Jaccard similarity at or above which a candidate is a near
        duplicate of an earlier accepted prompt (1.0 keeps near duplicates; exact ones go anyway).
    max_candidates: give up after this many candidates (null: 8 x synthesize).
    seed: the sampling seed (the distillation seed is mixed in as well).
    openings: texts a first user turn starts with, to steer what kind of request the target
        writes (candidate i continues ``openings[i % len(openings)]``, e.g. "Write a Python
        function" for coding requests); the opening stays part of the prompt. Follow-ups are
        written freely. A text instead of a list names a file of openings, one per line (blank
        lines and lines starting with # skipped; relative paths from the repository root), so
        several data configs share one set. null: the target starts the request itself.
    """

    synthesize: int
    name: str = "synth"
    system: str | None = None
    follow_ups: int = 0
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 0
    max_new_tokens: int = 96
    min_chars: int = 12
    max_chars: int = 1200
    min_words: int = 3
    near_duplicate: float = 0.7
    max_candidates: int | None = None
    seed: int = 0
    openings: list[str] | str | None = None

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ConfigError(f"prompts entry {{synthesize: {self.synthesize}, ...}}: {what}")

        need(isinstance(self.synthesize, int) and self.synthesize >= 1, "synthesize must be >= 1")
        need(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", str(self.name))), "name: letters, digits, _.-")
        need(self.follow_ups >= 0, "follow_ups must be >= 0")
        need(self.temperature > 0, "temperature must be > 0 (greedy would write one prompt)")
        need(0 < self.top_p <= 1, "top_p must be in (0, 1]")
        need(self.top_k >= 0, "top_k must be >= 0 (0: no cut)")
        need(self.max_new_tokens >= 1, "max_new_tokens must be >= 1")
        need(0 <= self.min_chars <= self.max_chars, "need 0 <= min_chars <= max_chars")
        need(0 < self.near_duplicate <= 1, "near_duplicate must be in (0, 1]")
        need(
            self.max_candidates is None or self.max_candidates >= self.synthesize,
            "max_candidates must be >= synthesize",
        )
        if isinstance(self.openings, str | Path):
            self.openings = read_openings(self.openings)
        if self.openings is not None:
            self.openings = list(self.openings)
            need(bool(self.openings), "openings must be a non-empty list of texts (or null)")
            for k, o in enumerate(self.openings):
                need(
                    isinstance(o, str) and bool(o.strip()),
                    f"openings[{k}]={o!r} is not a non-empty text (in YAML, quote an opening "
                    "that holds ': ', e.g. \"A puzzle:\")",
                )

    def opening(self, i: int) -> str:
        """The text candidate i starts with ("" without openings)."""
        return self.openings[i % len(self.openings)] if self.openings else ""

    @property
    def candidate_limit(self) -> int:
        return self.max_candidates or 8 * self.synthesize

    def digest(self) -> str:
        fields = asdict(self)
        if fields["openings"] is None:  # written before openings existed: keep their file names
            del fields["openings"]
        if fields["top_k"] == 0:  # written before top_k existed (no cut): keep their file names
            del fields["top_k"]
        return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]


def read_openings(path: str | Path) -> list[str]:
    """The openings listed in a text file, one per line (blank lines and # comments skipped)."""
    resolved = resolve_path(path)
    if not resolved.is_file():
        raise ConfigError(
            f"openings file {str(path)!r} not found; give a list of openings, or a text file "
            "with one opening per line (relative paths start at the repository root)."
        )
    lines = [line.strip() for line in resolved.read_text(encoding="utf-8").splitlines()]
    found = [line for line in lines if line and not line.startswith("#")]
    if not found:
        raise ConfigError(f"openings file {str(path)!r} lists no openings (one per line).")
    return found


def synthesis_spec(entry: dict) -> SynthesisSpec:
    """A prompts mapping with a `synthesize` key as a SynthesisSpec (clear error on bad keys)."""
    unknown = set(entry) - {f for f in SynthesisSpec.__dataclass_fields__}
    if unknown:
        raise ConfigError(
            f"prompts entry {entry}: unknown keys {sorted(unknown)}; a synthesis entry takes "
            f"{_FIELDS_HELP}."
        )
    return SynthesisSpec(**entry)


def candidates_path(out: Path, spec: SynthesisSpec) -> Path:
    return out.with_name(f"{out.name}.synth-{spec.name}-{spec.digest()}.jsonl")


# ---- filters and de-duplication ---------------------------------------------------------------

_WORD = re.compile(r"\w+", re.UNICODE)


def normalise(text: str) -> str:
    """Lower case, words only, single spaces: two texts equal here are exact duplicates."""
    return " ".join(_WORD.findall(text.lower()))


def shingles(text: str) -> set[str]:
    """Word trigrams of the normalised text (its words, if it has fewer than three)."""
    words = normalise(text).split()
    if len(words) < 3:
        return set(words)
    return {" ".join(words[i : i + 3]) for i in range(len(words) - 2)}


def reject_reason(text: str, finish: str, spec: SynthesisSpec, special_ids: bool = False) -> str:
    """Why a sampled user turn is unusable ("" if it is fine). `special_ids`: the sampled ids
    held special tokens other than the end of turn (the model wrote template markers)."""
    stripped = text.strip()
    if not stripped:
        return "empty"
    if finish != "eos":
        return "cut at max_new_tokens"
    if special_ids:
        return "template markers"
    if any(unicodedata.category(c)[0] == "C" and c not in "\n\t" for c in stripped):
        return "non-printable characters"
    if len(stripped) < spec.min_chars or len(stripped.split()) < spec.min_words:
        return "too short"
    if len(stripped) > spec.max_chars:
        return "too long"
    if _repetitive(stripped):
        return "repeated text"
    return ""


def _repetitive(text: str) -> bool:
    """Degenerate loops: a line said three times or more, or few distinct word trigrams."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and Counter(lines).most_common(1)[0][1] >= 3:
        return True
    words = normalise(text).split()
    if len(words) < 12:
        return False
    grams = [" ".join(words[i : i + 3]) for i in range(len(words) - 2)]
    return len(set(grams)) / len(grams) < 0.5


class Deduplicator:
    """Accepts texts in order, refusing exact and near duplicates of those accepted before."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.exact: set[str] = set()
        self.sets: list[set[str]] = []
        self.index: dict[str, list[int]] = {}

    def check(self, text: str) -> str:
        """ "" and remember the text, or "exact duplicate" / "near duplicate"."""
        key = normalise(text)
        if key in self.exact:
            return "exact duplicate"
        mine = shingles(text)
        if self.threshold < 1 and mine:
            overlap: Counter[int] = Counter()
            for s in mine:
                overlap.update(self.index.get(s, ()))
            for j, common in overlap.items():
                union = len(mine) + len(self.sets[j]) - common
                if common / union >= self.threshold:
                    return "near duplicate"
        self.exact.add(key)
        for s in mine:
            self.index.setdefault(s, []).append(len(self.sets))
        self.sets.append(mine)
        return ""


def select(rows: Sequence[dict], spec: SynthesisSpec) -> tuple[list[dict], Counter]:
    """The accepted prompts (at most spec.synthesize, in candidate order) and the count of each
    rejection reason. rows: candidate rows {"i", "text", "reject"}."""
    dedup = Deduplicator(spec.near_duplicate)
    kept, reasons = [], Counter()
    for row in sorted(rows, key=lambda r: r["i"]):
        if len(kept) == spec.synthesize:
            break
        reason = row["reject"] or dedup.check(row["text"])
        if reason:
            reasons[reason] += 1
        else:
            kept.append(row)
    return kept, reasons


# ---- generation -------------------------------------------------------------------------------


def _block_seed(base: int, spec: SynthesisSpec, block: int) -> int:
    digest = hashlib.sha1(f"synth|{base}|{spec.seed}|{spec.name}|{block}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def sample_user_turns(
    gen,
    encoder,
    histories: Sequence[list[dict]],
    spec: SynthesisSpec,
    seed: int,
    openings: Sequence[str] | None = None,
) -> list[tuple[str, str]]:
    """For each history, a user turn sampled by the target: (text, reason it is rejected or "").
    openings: per history, the text the turn starts with (the target continues it; it is part
    of the returned text)."""
    openings = list(openings) if openings is not None else [""] * len(histories)
    prompts = [encoder.user_prefix(h, o) for h, o in zip(histories, openings, strict=True)]
    answers = gen.generate(
        prompts,
        seed,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        max_new_tokens=spec.max_new_tokens,
    )
    special = set(getattr(encoder.tokenizer, "all_special_ids", []) or [])
    out = []
    for (ids, finish), opening in zip(answers, openings, strict=True):
        text = (opening + encoder.tokenizer.decode(ids, skip_special_tokens=True)).strip()
        marked = any(t in special for t in ids)
        out.append((text, reject_reason(text, finish, spec, marked)))
    return out


def synthesize(
    spec: SynthesisSpec,
    out: Path,
    base_seed: int,
    get_generator: Callable[[], object],
    encoder,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
) -> list[dict]:
    """Generate candidates until `spec.synthesize` are accepted (or the candidate limit is hit);
    returns the accepted prompts as read_prompts rows {"id", "category", "turns"}.

    get_generator: returns the started generator (called only if something is left to do).
    """
    path = candidates_path(out, spec)
    mine = path if world_size == 1 else part_path(path, rank)
    repair_tail(mine)
    system = [{"role": "system", "content": spec.system}] if spec.system else []
    while True:
        every = _read_candidates(path)
        done_blocks = {row["i"] // BLOCK for row in every}
        limit_blocks = -(-spec.candidate_limit // BLOCK)
        missing = [b for b in range(limit_blocks) if b not in done_blocks]
        # decide on the unbroken run of blocks from 0 only (a killed process may leave a gap)
        end = (missing[0] if missing else limit_blocks) * BLOCK
        rows = [row for row in every if row["i"] < end]
        kept, reasons = select(rows, spec)
        if len(kept) >= spec.synthesize or not missing:
            break
        # the next blocks, one per process; all processes see the same files, so agree on them
        need = spec.synthesize - len(kept)
        rate = len(kept) / max(1, len(rows)) if rows else 1.0
        want = max(1, min(len(missing), -(-int(need / max(rate, 0.05)) // BLOCK)))
        share = missing[: max(want, world_size)][rank::world_size]
        if rank == 0:  # a block takes minutes on a CPU: say where the step stands
            log.info(
                "synthesis %s: %d of %d prompts kept from %d candidates; writing %d more "
                "blocks of %d",
                spec.name,
                len(kept),
                spec.synthesize,
                len(rows),
                len(share),
                BLOCK,
            )
        for n, block in enumerate(share, 1):
            first = block * BLOCK
            seed = _block_seed(base_seed, spec, block)
            openings = [spec.opening(first + j) for j in range(BLOCK)]
            texts = sample_user_turns(
                get_generator(), encoder, [system] * BLOCK, spec, seed, openings
            )
            append_rows(
                mine,
                [
                    {"id": f"{spec.name}/{first + j}", "i": first + j, "text": t, "reject": r}
                    for j, (t, r) in enumerate(texts)
                ],
            )
            passed = sum(not r for _, r in texts)
            log.info("synthesis %s: block %d of %d written, %d of %d passed the filters",
                     spec.name, n, len(share), passed, BLOCK)  # fmt: skip
        if barrier is not None:
            barrier()
    if barrier is not None:
        barrier()
    if rank == 0 and world_size > 1:
        merge_parts(path)
    if barrier is not None:
        barrier()
    summary = ", ".join(f"{n} {why}" for why, n in reasons.most_common())
    log.info(
        "synthesis %s: kept %d of %d candidates (rejected: %s)",
        spec.name,
        len(kept),
        len(rows),
        summary or "none",
    )
    if len(kept) < spec.synthesize:
        log.warning(
            "synthesis %s: only %d of the %d prompts asked for passed the filters within "
            "max_candidates=%d; raise max_candidates or loosen the filters",
            spec.name,
            len(kept),
            spec.synthesize,
            spec.candidate_limit,
        )
    return [
        {"id": row["i"], "category": spec.name, "turns": [row["text"]] + [None] * spec.follow_ups}
        for row in kept
    ]


def _read_candidates(path: Path) -> list[dict]:
    rows: dict[int, dict] = {}
    for file in (path, *part_files(path)):
        if file.is_file():
            for row in read_rows(file):
                rows.setdefault(row["i"], row)
    return list(rows.values())


__all__ = [
    "BLOCK",
    "Deduplicator",
    "SynthesisSpec",
    "candidates_path",
    "normalise",
    "reject_reason",
    "select",
    "synthesis_spec",
    "synthesize",
]
