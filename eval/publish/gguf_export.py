"""Export a trained draft as a llama.cpp GGUF and prove it in llama.cpp itself.

`export_gguf_run(source, out)` writes `out/draft-<outtype>.gguf` (heads.interop.gguf: the EAGLE-3
or DFlash serving layout through llama.cpp's own converter, with the run's target folder as
`--target-model-dir`) and `out/export.json`. The target GGUF is the target's own file when it has
one (the embedded SmolLM2's Q4_1 as shipped) or, with `target_outtype` (f32, f16, ...), its folder
converted into `out/target-<outtype>.gguf` for numerically faithful runs.

The proof runs llama-server twice on held-out prompts, greedy: the target alone, then the target
with the draft. The drafted output must equal llama.cpp's plain output token for token; a
difference is accepted only at a near tie of the plain run (its top-2 log-probabilities, which
differ exactly as the logits do, within `near_tie` of each other), where a batched verify and a
one-token step may round differently, and it is counted in export.json. The acceptance llama.cpp
reports is recorded beside the harness's on the same chain and prompts (they agree on an f32
target: tests/test_llama_cpp.py); with a quantised target it is the Q4_1 model's.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import torch

from data.engines.llama_cpp import GGUF_OUTTYPES, LlamaServer, ServerConfig
from data.generation import eos_token_ids
from eval.engine.drafting import make_proposer
from eval.engine.generator import SpeculativeGenerator, first_difference
from eval.engine.tree_spec import resolve_tree
from eval.engine.verify import GreedyVerifier
from eval.publish.export import CHECK_PROMPTS, ExportCheckError, find_head, run_context, run_target
from heads.base import atomic_save_dir

log = logging.getLogger(__name__)


def _check_prompt_ids(target, prompts: int) -> list[list[int]]:
    from data.chat import ChatEncoder
    from data.formats import read_prompts

    encoder = ChatEncoder(target.tokenizer)
    rows = read_prompts(str(Path(__file__).resolve().parents[2] / CHECK_PROMPTS))[:prompts]
    return [encoder.prompt([{"role": "user", "content": row["turns"][0]}]) for row in rows]


def _top2_gap(probs_entry: dict) -> float | None:
    """log p1 - log p2 of one llama.cpp `completion_probabilities` entry (= the logit gap)."""
    top = probs_entry.get("top_logprobs") or probs_entry.get("probs") or []
    values = []
    for item in top[:2]:
        if "logprob" in item:
            values.append(float(item["logprob"]))
        elif "prob" in item and item["prob"] > 0:
            values.append(math.log(item["prob"]))
    return values[0] - values[1] if len(values) == 2 else None


def llama_cpp_proof(
    target_gguf: str,
    draft_gguf: str,
    spec_type: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    chain: int,
    near_tie: float,
    faithful: bool,
) -> dict:
    """Plain and drafted llama.cpp greedy decoding of `prompts`: equal outputs (or divergences
    at near ties only), and llama.cpp's acceptance."""
    engine = {"cache_type": "f32", "flash_attn": "off"} if faithful else {}
    with LlamaServer(ServerConfig(model=target_gguf, **engine)) as server:
        plain = [server.complete(ids, max_new_tokens, n_probs=2) for ids in prompts]
    spec_cfg = ServerConfig(
        model=target_gguf, draft=draft_gguf, spec_type=spec_type, draft_n_max=chain, **engine
    )
    with LlamaServer(spec_cfg) as server:
        drafted = [server.complete(ids, max_new_tokens) for ids in prompts]
    ties, accepted, tokens = [], 0, 0
    for i, (p, d) in enumerate(zip(plain, drafted)):
        index = first_difference(p.tokens, d.tokens)
        if index is not None:
            gap = _top2_gap(p.probs[index]) if index < len(p.probs) else None
            if gap is None or gap > near_tie:
                raise ExportCheckError(
                    f"llama.cpp decodes prompt {i} differently with the draft (token {index}, "
                    f"top-2 gap {gap}): the draft GGUF changed the target's output; nothing "
                    "was written."
                )
            ties.append({"prompt": i, "token": index, "top2_gap": gap})
        accepted += d.draft_accepted
        tokens += len(d.tokens)
    steps = max(tokens - len(prompts) - accepted, 1)
    return {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "chain": chain,
        "identical": len(prompts) - len(ties),
        "near_tie_divergences": ties,
        "llama_cpp_accepted": accepted,
        "llama_cpp_tau": (tokens - len(prompts)) / steps,
    }


def harness_acceptance(head, target, prompts: list[list[int]], max_new_tokens: int, chain: int):
    """Accepted draft tokens of the same chain in draftsmith's harness (HF target), counted as
    llama.cpp counts them: within the token budget (new tokens - the prefill's - steps), so a
    last step whose draft ran past max_new_tokens is not credited beyond it."""
    proposer = make_proposer(head, resolve_tree(chain))
    eos = eos_token_ids(target)
    generator = SpeculativeGenerator(target.model, proposer, GreedyVerifier(), eos)
    accepted = tokens = steps = 0
    for ids in prompts:
        result = generator.generate(torch.tensor([ids]), max_new_tokens)
        decoded = result.new_tokens.numel() - 1
        accepted += decoded - len(result.accept_lengths)
        steps += len(result.accept_lengths)
        tokens += decoded
    return {"harness_accepted": accepted, "harness_tau": tokens / max(steps, 1)}


def export_gguf_run(
    source: str | Path,
    out: str | Path,
    *,
    outtype: str = "f32",
    target_outtype: str | None = None,
    check_prompts: int = 4,
    check_tokens: int = 32,
    chain: int = 3,
    near_tie: float = 0.05,
    overwrite: bool = False,
) -> dict:
    """Write the draft GGUF (and the target's when asked) into `out`, proved in llama.cpp."""
    import heads
    from data.engines.llama_tools import QUANT_TYPES
    from heads.interop.gguf import TargetGGUF, export_gguf, gguf_for_target, spec_type_for

    allowed = (*GGUF_OUTTYPES, *(q for q in QUANT_TYPES if q not in GGUF_OUTTYPES))
    if target_outtype is not None and target_outtype not in allowed:
        raise ValueError(
            f"--target-outtype {target_outtype}: use one of {', '.join(allowed)}, or leave "
            "it out for the target's own GGUF."
        )
    choice = TargetGGUF.parse(target_outtype)  # the target's own file, or converted once
    head_dir, run_dir = find_head(source)
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists: choose another --out, or pass --overwrite.")
    context = run_context(run_dir)
    run = run_target(head_dir, context)
    target = run.target
    head = heads.from_pretrained(head_dir, target).eval()
    spec_type = spec_type_for(head)
    found: dict = {}

    def write(folder: Path) -> None:
        draft = export_gguf(head, target, run.source, folder / f"draft-{outtype}.gguf", outtype)
        tgt_file = gguf_for_target(run.config, choice)
        if target_outtype:  # a converted copy travels with the export
            shutil.copyfile(tgt_file, folder / f"target-{target_outtype}.gguf")
            tgt_file = folder / f"target-{target_outtype}.gguf"
        prompts = _check_prompt_ids(target, check_prompts)
        faithful = target_outtype in ("f32",)
        proof = llama_cpp_proof(
            str(tgt_file), str(draft), spec_type, prompts, check_tokens, chain, near_tie, faithful
        )
        proof |= harness_acceptance(head, target, prompts, check_tokens, chain)
        doc = {
            "format": "gguf",
            "draft": draft.name,
            "spec_type": spec_type,
            "target_gguf": tgt_file.name if target_outtype else str(tgt_file),
            "serve": f"llama-server -m TARGET.gguf -md {draft.name} --spec-type {spec_type} "
            f"--spec-draft-n-max {chain}",
            "check": proof,
        }
        (folder / "export.json").write_text(json.dumps(doc, indent=2) + "\n")
        found.update(doc)

    atomic_save_dir(out, write)
    log.info("exported %s as GGUF to %s: %s", head_dir, out, found["check"])
    return found


def gguf_summary(out: str | Path, doc: dict) -> str:
    """What the command line prints after export_gguf_run: the draft file and its proof."""
    check = doc["check"]
    return (
        f"wrote {out}/{doc['draft']} ({doc['spec_type']}); llama.cpp with the draft = "
        f"plain on {check['identical']}/{check['prompts']} prompts "
        f"({len(check['near_tie_divergences'])} near-tie divergences); accepted draft tokens "
        f"llama.cpp {check['llama_cpp_accepted']}, harness {check['harness_accepted']}"
    )
