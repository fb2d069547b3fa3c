"""Where an EAGLE-3 draft's validation accuracy and its decoding acceptance part ways (issue 26;
the measured split is in docs/reports/2026-12-02-acceptance-gap/README.md, made by
scripts/acceptance_gap.py).

One primitive, `teacher_forced`, runs the training-time-test unroll of heads/eagle3.py over one
sequence (the sequence's own tokens fed at every depth, fp32 target features) and gives, for each
row t and depth d = i + 1, the draft's best token and whether it is the target's greedy token
there (whole vocabulary). `summarize` turns those hits into:

- top-1 per depth over in-vocabulary positions (what training logs as val/step{i}/top1), over
  all positions (a token outside the draft vocabulary is a miss, as decoding rejects it), and
  conditional on the earlier depths being right (`accept`: what a chain needs);
- chain tau estimates: 1 + p1 + p1 p2 + ... over each of those rates, and the walk of
  heads/acceptance.py, which queries the draft only where greedy chain decoding would.

Block drafters (DFlash, DSpark) go through the same analysis: their teacher-forced chain from
row t is the block anchored at t + 1 (heads/dflash.py `every_chain`, DSpark's Markov walk fed the
sequence's tokens), and DSpark's own `val/tau_estimate` heads the causes table.

On the target's own greedy continuations the walk is not an estimate: it is the tau speculative
decoding must measure, and the draft's teacher-forced top-1 at the rows decoding queried is
what decoding drafted there. lab/analysis/chain_decoding.py records, for every round, the root
position and the drafted chain, so both are checked (cause d: a train/decode mismatch shows up
as a difference).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from heads.acceptance import (
    Validates,
    accepted_lengths,
    chain_tau,
    chain_walk,
    label_runs,
    walk_rows,
)
from heads.base import batch_positions, label_mask, masked_shift
from heads.draft_layer import DraftCache
from heads.eagle3 import ttt_attention_mask
from lab.analysis.chain_decoding import (  # noqa: F401  (part of this module's API)
    ChainRecorder,
    DecodedTurn,
    _ratio,
    decode_stats,
    decode_turns,
    hf_greedy,
    queried_rows,
)


@dataclass
class SequenceHits:
    """Teacher-forced unroll of one sequence; (S, T) per depth i (depth i + 1) and row t."""

    drafted: Tensor  # long: the draft's best token (target ids) for x_{t+i+2}
    hits: Tensor  # bool: drafted is the target's greedy token there, and x_{t+i+2} is a label
    labels: Tensor  # bool: x_{t+i+2} is a label
    in_vocab: Tensor  # bool: the target's greedy token there is in the draft vocabulary
    loss_mask: Tensor  # (T,) long
    greedy: Tensor  # (T,) long: the target's greedy token after each position (whole vocab)


def ttt_unroll(head, batch: dict[str, Tensor], feats: dict[str, Tensor], depth: int) -> list:
    """The draft's outputs (B, T, H), one per step, of Eagle3Head.loss's training-time-test
    unroll: the batch's own tokens fed at every step, packed rows (`segment_ids`) included."""
    ids = batch["input_ids"]
    T = ids.shape[1]
    positions, segments = batch_positions(batch, T), batch.get("segment_ids")
    hidden, cache, outs = head.target_hidden(feats), DraftCache(), []
    for i in range(depth):
        mask = ttt_attention_mask(T, i, ids.device, segments)
        mask = mask if segments is not None else mask[None, None]
        hidden = head.draft_hidden(masked_shift(ids, i + 1), hidden, positions + i, cache, mask)
        outs.append(hidden)
    return outs


@torch.no_grad()
def teacher_forced(
    head, target, input_ids: Tensor, loss_mask: Tensor, depth: int | None = None
) -> SequenceHits:
    """Hits of the unroll over one sequence, input_ids/loss_mask (T,), against the fp32
    target's greedy tokens (depth: the chain's, default the head's ttt_steps). A block drafter
    (DFlash, DSpark) drafts row t's chain from the block anchored at t + 1 (`every_chain`);
    its depth-d label needs x_{t+2} .. x_{t+d+1} all labels (a block stops at a turn's end)."""
    ids = input_ids.reshape(1, -1).long()
    batch = {"input_ids": ids, "loss_mask": loss_mask.reshape(1, -1).long()}
    feats = target.features(ids, torch.ones_like(ids), layers=head.feature_layers())
    greedy = head.target_argmax(feats["hidden"])  # (1, T)
    if hasattr(head, "every_chain"):  # a block drafter: a block at every row's root
        chains, runs = head.every_chain(batch, feats)  # (K, 1, T) each
        depth = depth or head.max_draft_depth
        if depth > head.max_draft_depth:
            raise ValueError(f"a chain of {depth}: the head drafts at most {head.max_draft_depth}")
        rows = [(chains[i], runs[i]) for i in range(depth)]
    else:
        outs = ttt_unroll(head, batch, feats, depth or head.config.ttt_steps)
        rows = [(head.draft_to_target(head.logits(out).argmax(-1)), None) for out in outs]
    drafted, hits, labels, in_vocab = [], [], [], []
    for i, (best, run) in enumerate(rows):
        best = best[0]  # (T,)
        want = masked_shift(greedy, i + 1)[0]  # the target's token for x_{t+i+2}
        label = label_mask(batch, i + 2)[0] if run is None else run[0]
        drafted.append(best)
        hits.append((best == want) & label)
        labels.append(label)
        in_vocab.append(head.t2d[want])
    stack = torch.stack
    return SequenceHits(
        stack(drafted), stack(hits), stack(labels), stack(in_vocab), batch["loss_mask"][0],
        greedy[0],
    )  # fmt: skip


def summarize(seqs: list[SequenceHits], rows: list[list[int]] | None = None) -> dict:
    """Rates per depth and chain tau estimates over every row of `seqs`, or only `rows[k]` of
    sequence k (e.g. the rows decoding queried; the walk then does not apply)."""
    S = seqs[0].hits.shape[0]
    n = {k: torch.zeros(S, dtype=torch.float64) for k in ("lab", "hit", "inv", "ihit", "rl", "rh")}
    tokens = rounds = 0
    for k, seq in enumerate(seqs):
        pick = slice(None) if rows is None else torch.tensor(rows[k], dtype=torch.long)
        hit, lab, inv = seq.hits[:, pick], seq.labels[:, pick], seq.in_vocab[:, pick]
        reach = torch.ones_like(lab[0])
        for i in range(S):
            n["lab"][i] += lab[i].sum()
            n["hit"][i] += hit[i].sum()
            n["inv"][i] += (lab[i] & inv[i]).sum()
            n["ihit"][i] += (hit[i] & inv[i]).sum()
            n["rl"][i] += (reach & lab[i]).sum()
            n["rh"][i] += (reach & hit[i]).sum()
            reach = reach & hit[i]
        if rows is None:
            t, r = chain_walk(accepted_lengths(seq.hits[:, None]), seq.loss_mask[None])
            tokens, rounds = tokens + t, rounds + r
    rate = _ratio
    out = {
        "rows": int(n["lab"][0]),
        "outside_vocab": [1 - rate(v, x) for v, x in zip(n["inv"], n["lab"], strict=True)],
        "top1_in_vocab": [rate(h, v) for h, v in zip(n["ihit"], n["inv"], strict=True)],
        "top1_all": [rate(h, x) for h, x in zip(n["hit"], n["lab"], strict=True)],
        "accept": [rate(h, x) for h, x in zip(n["rh"], n["rl"], strict=True)],
    }
    out["tau_in_vocab"] = chain_tau(out["top1_in_vocab"])
    out["tau_all"] = chain_tau(out["top1_all"])
    out["tau_cond"] = chain_tau(out["accept"])
    if rows is None:
        out["tau_walk"] = rate(tokens, rounds)
    return out


def first_turn(input_ids: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """The conversation up to the end of its first assistant turn, labels on that turn only."""
    labels = loss_mask.tolist()
    start = labels.index(1)
    end = start
    while end + 1 < len(labels) and labels[end + 1]:
        end += 1
    return input_ids[: end + 1], loss_mask[: end + 1]


def data_agreement(seqs: list[SequenceHits], examples: list[tuple[Tensor, Tensor]]) -> float:
    """Share of label positions where the data's token is the (fp32) target's greedy token
    given the data's context (1.0 on the target's own greedy answers)."""
    same = total = 0
    for seq, (ids, mask) in zip(seqs, examples, strict=True):
        labels = mask[1:].bool()
        same += int((seq.greedy[:-1] == ids[1:])[labels].sum())
        total += int(labels.sum())
    return _ratio(same, total)


# ---- the whole analysis -----------------------------------------------------------------------


def answered(prompt: Tensor, answer: list[int]) -> tuple[Tensor, Tensor]:
    """(input_ids, loss_mask) (T,) of a prompt [1, P] or (P,) and an answer, labels on it."""
    prompt = prompt.reshape(-1)
    ids = torch.cat([prompt, torch.tensor(answer, dtype=torch.long)])
    mask = torch.zeros_like(ids)
    mask[prompt.numel() :] = 1
    return ids, mask


def first_turn_prompts(examples: list[dict]) -> list[tuple[Tensor, int]]:
    """(prompt [1, P], the data's answer length) of each conversation's first assistant turn."""
    out = []
    for example in examples:
        ids, mask = first_turn(example["input_ids"], example["loss_mask"])
        start = mask.tolist().index(1)
        out.append((ids[None, :start], int(mask.sum())))
    return out


def walked_rows(seqs: list[SequenceHits]) -> list[list[int]]:
    """Per sequence, the rows greedy chain decoding queries (heads.acceptance.walk_rows)."""
    out = []
    for seq in seqs:
        accepted = accepted_lengths(seq.hits[:, None])[0].tolist()
        runs = label_runs(seq.loss_mask.tolist())
        out.append([t for first, last in runs for t in walk_rows(accepted, first, last)])
    return out


@torch.no_grad()
def loss_metrics(
    head, target, examples: list[dict], feature_dtype: torch.dtype = torch.float16,
    autocast: torch.dtype | None = None,
) -> dict:  # fmt: skip
    """val/<stat> as the trainer computes them: head.validate (head.loss for a head without
    one) in eval mode, one conversation a batch, target features rounded to the feature
    cache's dtype, the step under the run's autocast (None: fp32)."""
    from data.dataset import collate

    sums: dict[str, Tensor] = {}
    head.eval()
    measure = head.validate if isinstance(head, Validates) else head.loss
    for example in examples:
        ids = example["input_ids"][None]
        feats = target.features(ids, torch.ones_like(ids), layers=head.feature_layers())
        feats = {k: v.to(feature_dtype) for k, v in feats.items()}
        derived = {}
        if hasattr(head, "example_targets"):  # EAGLE-3's cached greedy tokens
            derived = head.example_targets({**example, "hidden": feats["hidden"][0]})
        batch = collate([{**example, **derived}])
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            stats = measure(batch, feats).stats
        for key, value in stats.items():
            sums[key] = sums.get(key, 0) + value.detach().double()
    return {f"val/{k}": float(s / c) for k, (s, c) in sums.items() if c > 0}


def analyse(
    head, target, val_examples: list[dict], bench: list[tuple[Tensor, list[int]]],
    regenerated: list[tuple[Tensor, list[int]]] = (), max_new_tokens: int = 128, depth: int = 3,
    decode_limit: int | None = None, precision: dict | None = None,
) -> dict:  # fmt: skip
    """Every measurement of the gap (see the module doc).

    bench: (prompt [1, P], HF generate's greedy answer) per MT-bench first turn (`hf_greedy`);
    regenerated: the same for the first turns of the first len(regenerated) validation
    conversations; decode_limit: how many bench prompts speculative decoding runs (all by
    default; on the rest the walk over the greedy answer stands for it, exact when the decoded
    turns show no mismatch); precision: `loss_metrics`'s feature_dtype and autocast (the run's,
    from `load_run`)."""
    head.eval()

    def unrolled(pairs):
        return [teacher_forced(head, target, ids, mask, depth) for ids, mask in pairs]

    pairs = [(e["input_ids"], e["loss_mask"]) for e in val_examples]
    val = unrolled(pairs)
    firsts = unrolled([first_turn(ids, mask) for ids, mask in pairs][: len(regenerated)])
    greedy = unrolled([answered(p, a) for p, a in regenerated])
    answers = unrolled([answered(p, a) for p, a in bench])
    shown = bench[:decode_limit]
    turns = decode_turns(
        head, target, [p for p, _ in shown], max_new_tokens, depth, [a for _, a in shown]
    )
    decoded = unrolled([turn.sequence() for turn in turns])
    result = {
        "depth": depth,
        "validation": summarize(val),
        "validation_trainer": loss_metrics(head, target, val_examples, **(precision or {})),
        "data_agreement": data_agreement(val, pairs),
        "mt_bench": summarize(answers),
        "mt_bench_queried": summarize(answers, walked_rows(answers)),
        "decode": decode_stats(turns, decoded),
        "decode_walk": summarize(decoded)["tau_walk"],
        "decode_queried": summarize(decoded, queried_rows(turns)),
    }
    if regenerated:
        result["validation_first_turns"] = summarize(firsts)
        result["validation_fp32_greedy"] = summarize(greedy)
    return result


def causes(result: dict) -> list[tuple[str, float, float | None]]:
    """(step, chain tau, change) from the old estimate to measured decoding, a cause a step."""
    v, m, d = result["validation"], result["mt_bench"], result["decode"]
    steps = []
    sampled = result.get("validation_trainer", {}).get("val/tau_estimate")
    if sampled is not None:  # DSpark's own estimate: 1 - TV, speculative sampling at T = 1
        steps.append(("DSpark val/tau_estimate: 1 + sum of prod (1 - TV), uniform anchors",
                      sampled))  # fmt: skip
    first = "validation top-1 in-vocab, unconditional: 1 + q1 + q1 q2 + ... (old estimate)"
    if sampled is not None:
        first = "(g) greedy: validation top-1 in-vocab, unconditional: 1 + q1 + q1 q2 + ..."
    steps += [
        (first, v["tau_in_vocab"]),
        ("(a) out-of-vocabulary positions count as misses", v["tau_all"]),
        ("(f) conditional chain acceptance p(d | 1..d-1 right)", v["tau_cond"]),
        ("(c) only the positions decoding queries (walk) = val/chain_tau_est", v["tau_walk"]),
    ]  # fmt: skip
    if "validation_first_turns" in result:
        f, g = result["validation_first_turns"], result["validation_fp32_greedy"]
        steps += [
            ("    first assistant turns only (same walk)", f["tau_walk"]),
            ("(e) the fp32 target's greedy answers to those prompts", g["tau_walk"]),
        ]
    steps.append(("(b) MT-bench first turns, fp32 greedy answers (walk)", m["tau_walk"]))
    out = [(name, tau, None if i == 0 else tau - steps[i - 1][1]) for i, (name, tau) in
           enumerate(steps)]  # fmt: skip
    change = d["tau"] - result["decode_walk"]  # (d): decoding against the walk, same turns
    out.append(("(d) decoding in the harness minus the walk, same turns", m["tau_walk"] + change,
                change))  # fmt: skip
    return out


def markdown(result: dict) -> str:
    """The causes table and the per-depth rates, as
    docs/reports/2026-12-02-acceptance-gap/README.md shows them."""
    lines = ["| step | chain tau | change |", "|---|---:|---:|"]
    for name, tau, change in causes(result):
        lines.append(f"| {name} | {tau:.3f} | {'' if change is None else f'{change:+.3f}'} |")
    lines += ["", "| set | rows | outside vocab | top-1 in-vocab | top-1 all | conditional "
              "| tau uncond in-vocab | tau uncond all | tau cond | tau walk |",
              "|---|---:|---|---|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for key in ("validation", "validation_first_turns", "validation_fp32_greedy", "mt_bench",
                "mt_bench_queried", "decode_queried"):  # fmt: skip
        if key not in result:
            continue
        s = result[key]
        walk = f"{s['tau_walk']:.3f}" if "tau_walk" in s else "-"
        lines.append(
            f"| {key} | {s['rows']} | {_fmt(s['outside_vocab'])} | {_fmt(s['top1_in_vocab'])} "
            f"| {_fmt(s['top1_all'])} | {_fmt(s['accept'])} | {s['tau_in_vocab']:.3f} "
            f"| {s['tau_all']:.3f} | {s['tau_cond']:.3f} | {walk} |"
        )
    d = result["decode"]
    lines += ["", f"decoding: tau {d['tau']:.3f} over {d['rounds']} rounds (the walk over the same "
              f"turns: {result['decode_walk']:.3f}); acceptance per depth "
              f"conditional {_fmt(d['accept'])}, unconditional {_fmt(d['accept_unconditional'])};"
              f" drafted-token mismatches against the unroll {d['drafted_mismatches']}, "
              f"accepted-length mismatches {d['accepted_mismatches']}, turns differing from HF "
              f"generate {d['greedy_mismatches']}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def _fmt(values: list[float]) -> str:
    return " / ".join(f"{v:.3f}" for v in values)


# ---- inputs -----------------------------------------------------------------------------------


def load_run(run_dir: str) -> tuple[object, list[dict], dict]:
    """(target, validation conversations, precision) of a training run, from its config.yaml:
    the same target and the same split (the data files are reused from the cache the run
    filled); precision: the feature cache's dtype and the training step's autocast, as
    `loss_metrics` takes them."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from data.config import DataConfig
    from data.prepare import prepare_data
    from heads.target import load_target
    from train.run import engine_gguf
    from train.rundir import read_run_config

    cfg = OmegaConf.create(read_run_config(run_dir))
    model_cfg = instantiate(cfg.model)
    target = load_target(model_cfg)
    data_cfg = instantiate(cfg.data, _target_=DataConfig, _convert_="all")
    engine_gguf(data_cfg, model_cfg)  # the engine file names the data, as in training
    cast = data_cfg.feature_dtype if data_cfg.feature_dtype != "int8" else "float16"
    precision = {
        "feature_dtype": getattr(torch, cast),
        "autocast": torch.bfloat16 if _trained_in_bf16(cfg) else None,
    }
    return target, prepare_data(data_cfg, target).val, precision


def _trained_in_bf16(cfg) -> bool:
    from train.config import resolve_mixed_precision

    return resolve_mixed_precision(cfg.trainer.get("mixed_precision", "auto")) == "bf16"


def chat_prompts(path: str, limit: int, tokenizer) -> list[Tensor]:
    """The first `limit` questions' first turns, chat template applied: [1, P] each."""
    from data import read_prompts
    from data.paths import resolve_path
    from eval.bench.harness import encode_chat

    rows = read_prompts(str(resolve_path(path)))[:limit]
    return [encode_chat(tokenizer, [{"role": "user", "content": q["turns"][0]}]) for q in rows]


def references_for(
    path: str | None, target, prompts: list, max_new_tokens: int | list[int]
) -> list[list[int]]:
    """HF generate's greedy answers to `prompts`: read from `path` (JSON) when it holds them for
    this target, these prompts and this length, else computed (and written there)."""
    from train.rundir import write_json_atomic

    want = {"target": target.fingerprint, "max_new_tokens": max_new_tokens}
    asked = [p[0].tolist() for p in prompts]
    if path and Path(path).is_file():
        doc = json.loads(Path(path).read_text())
        rows = doc.get("rows", [])[: len(asked)]
        if {k: doc.get(k) for k in want} == want and [r["prompt"] for r in rows] == asked:
            return [r["tokens"] for r in rows]
    answers = hf_greedy(target, prompts, max_new_tokens)
    if path:
        rows = [{"prompt": p, "tokens": a} for p, a in zip(asked, answers, strict=True)]
        write_json_atomic(path, {**want, "rows": rows})
    return answers


class NoHeadError(FileNotFoundError):
    """The run dir holds no kept head and none was given."""


def measure_run(
    run_dir: str, head_dir: str | Path | None, *, prompts: str, limit: int,
    max_new_tokens: int = 128, depth: int = 3, val_limit: int | None = None,
    greedy_limit: int = 0, greedy_max_new: int = 128, decode_limit: int | None = None,
    references: str | None = None, val_references: str | None = None, command: str = "",
) -> dict:  # fmt: skip
    """`analyse` on a training run (scripts/acceptance_gap.py): its target and validation split
    (`load_run`), the head in `head_dir` (None: the run's kept head, else NoHeadError), the
    first `limit` questions of `prompts` answered by HF generate (cached in `references`), the
    first `greedy_limit` validation first turns answered again (at most `greedy_max_new` tokens;
    cached in `val_references`); with a "setup" section saying what was measured, in how long."""
    import heads
    from train.rundir import kept_head

    started = time.perf_counter()
    target, val, precision = load_run(run_dir)
    head_dir = Path(head_dir) if head_dir else kept_head(run_dir)
    if head_dir is None:
        raise NoHeadError(f"{run_dir} holds no head (best_head/ or head/): pass --head.")
    head = heads.from_pretrained(str(head_dir), target).eval()
    bench = chat_prompts(prompts, limit, target.tokenizer)
    answers = references_for(references, target, bench, max_new_tokens)
    val = val[:val_limit]
    firsts = first_turn_prompts(val[:greedy_limit])
    limits = [min(n, greedy_max_new) for _, n in firsts]
    firsts_prompts = [p for p, _ in firsts]
    regenerated = references_for(val_references, target, firsts_prompts, limits)
    result = analyse(
        head, target, val, list(zip(bench, answers, strict=True)),
        list(zip(firsts_prompts, regenerated, strict=True)), max_new_tokens, depth,
        decode_limit, precision,
    )  # fmt: skip
    result["setup"] = {
        "head": str(head_dir),
        "command": command,
        "validation_conversations": len(val),
        "regenerated_first_turns": len(firsts),
        "decoded": len(bench[:decode_limit]),
        "prompts": prompts,
        "limit": limit,
        "max_new_tokens": max_new_tokens,
        "trainer_precision": {k: str(v) for k, v in precision.items()},
        "seconds": round(time.perf_counter() - started, 1),
    }
    return result
