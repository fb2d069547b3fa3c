"""Speculative decoding: draft trees, KV-cache surgery, verifiers, the decoding loop."""

from eval.engine.generator import GenerationResult, SpeculativeGenerator, plain_decode, plain_greedy
from eval.engine.proposers import DecodeState, MedusaProposer, Proposer
from eval.engine.tree import (
    Draft,
    TreeBuffers,
    build_tree,
    build_tree_from_parents,
    chain_tree,
)
from eval.engine.tree_spec import TreeSpec, load_tree_spec, resolve_tree
from eval.engine.verify import (
    GreedyVerifier,
    SpeculativeSampler,
    TypicalVerifier,
    Verdict,
    Verifier,
    make_verifier,
)

__all__ = [
    "DecodeState",
    "Draft",
    "GenerationResult",
    "GreedyVerifier",
    "MedusaProposer",
    "Proposer",
    "SpeculativeGenerator",
    "SpeculativeSampler",
    "TreeBuffers",
    "TreeSpec",
    "TypicalVerifier",
    "Verdict",
    "Verifier",
    "build_tree",
    "build_tree_from_parents",
    "chain_tree",
    "load_tree_spec",
    "make_verifier",
    "plain_decode",
    "plain_greedy",
    "resolve_tree",
]
