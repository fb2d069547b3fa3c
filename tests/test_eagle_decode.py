"""EAGLE drafting in the decoding loop: static and EAGLE-2 dynamic trees, EAGLE-1 and EAGLE-3.

- dynamic trees pick exactly the nodes a brute-force enumeration picks;
- greedy speculative output equals HF generate with stub heads (an oracle that knows the target's
  greedy future, oracles right for the first L depths only, a random draft) and with random real
  heads (heads/eagle.py, heads/eagle3.py), on tiny Llama and Qwen2 targets;
- drafting a whole tree level by level (tree masks, shared cache) equals drafting each path on
  its own, and the draft cache after each step equals a recompute from the committed pairs;
- speculative sampling with EAGLE drafts is lossless (chi-square on a tiny vocabulary);
- the EAGLE-3 training-time-test mask is the mask drafting uses.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import diverse, make_llama, make_qwen2
from torch import nn

from eval.engine import kv_cache
from eval.engine.drafting import make_proposer
from eval.engine.dynamic_tree import (
    Candidates,
    DynamicTreeConfig,
    grow_dynamic_tree,
    select_dynamic_tree,
)
from eval.engine.eagle_proposer import EagleProposer, draft_tree_mask
from eval.engine.generator import SpeculativeGenerator
from eval.engine.proposers import DecodeState
from eval.engine.tree import build_tree, chain_tree
from eval.engine.tree_spec import TreeSpec, load_tree_spec, resolve_tree
from eval.engine.verify import GreedyVerifier, SpeculativeSampler, process_logits
from heads.draft_layer import DraftCache
from heads.target import Target

NEW = 20
PROMPT = torch.tensor([[2, 40, 17, 99, 5, 63, 120, 8]])
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]
DYNAMIC = DynamicTreeConfig(depth=4, top_k=4, total_tokens=12)
CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return diverse((make_llama if request.param == "llama" else make_qwen2)(hidden=32))


@pytest.fixture(scope="module")
def greedy_future(model):
    out = model.generate(PROMPT, max_new_tokens=NEW + 8, do_sample=False, pad_token_id=0)
    return out[0]  # prompt + greedy continuation


def generate(model, proposer, n=NEW, verifier=None, **kwargs):
    gen = SpeculativeGenerator(model, proposer, verifier or GreedyVerifier(), **kwargs)
    return gen.generate(PROMPT, n)


# ---- dynamic tree selection vs brute force ---------------------------------------------------


class ToyDraft:
    """Seeded log-probs over a tiny vocabulary for every path (a draft model without weights)."""

    def __init__(self, vocab: int, seed: int = 0, peaked: bool = False):
        self.vocab, self.seed, self.peaked = vocab, seed, peaked

    def __call__(self, path: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed,) + path) % (2**31))
        logits = torch.randn(self.vocab, generator=g)
        if self.peaked:  # one certain token: log-prob exactly 0, so children tie their parent
            logits = torch.full((self.vocab,), -1e4)
            logits[int(torch.randint(self.vocab, (), generator=g))] = 0.0
        return torch.log_softmax(logits, -1)

    def expand(self, candidates: Candidates, frontier: torch.Tensor) -> torch.Tensor:
        return torch.stack([self(path_of(candidates, int(c))) for c in frontier])


def path_of(candidates: Candidates, c: int) -> tuple[int, ...]:
    path = []
    while c >= 0:
        path.append(int(candidates.tokens[c]))
        c = int(candidates.parent[c])
    return tuple(reversed(path))


def kept_paths(draft: ToyDraft, config: DynamicTreeConfig) -> tuple[list, list[int]]:
    candidates = grow_dynamic_tree(draft(()), draft.expand, config)
    kept, parents = select_dynamic_tree(candidates, config.total_tokens)
    return [path_of(candidates, int(c)) for c in kept], parents


def enumerate_paths(draft: ToyDraft, depth: int) -> dict[tuple[int, ...], float]:
    scores, frontier = {}, [((), 0.0)]
    for _ in range(depth):
        frontier = [
            (path + (t,), score + float(lp))
            for path, score in frontier
            for t, lp in enumerate(draft(path))
        ]
        scores |= dict(frontier)
    return scores


def naive_eagle2(draft: ToyDraft, config: DynamicTreeConfig) -> set[tuple[int, ...]]:
    """EAGLE-2 by the paper's words, on dictionaries of paths."""
    k = config.top_k

    def children(path, score):
        lp = draft(path)
        best = sorted(range(draft.vocab), key=lambda t: -float(lp[t]))[:k]
        return [(path + (t,), score + float(lp[t])) for t in best]

    level = children((), 0.0)
    grown = list(level)
    for _ in range(config.depth - 1):
        frontier = sorted(level, key=lambda x: -x[1])[:k]
        level = [child for path, score in frontier for child in children(path, score)]
        grown += level
    return {path for path, _ in sorted(grown, key=lambda x: -x[1])[: config.total_tokens - 1]}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dynamic_tree_is_the_global_best_when_top_k_is_wide(seed):
    draft = ToyDraft(vocab=4, seed=seed)
    config = DynamicTreeConfig(depth=3, top_k=4, total_tokens=5)  # top_k >= total_tokens - 1
    paths, parents = kept_paths(draft, config)
    scores = enumerate_paths(draft, config.depth)  # all 4 + 16 + 64 paths
    best = sorted(scores, key=lambda p: -scores[p])[: config.total_tokens - 1]
    assert set(paths) == set(best) and len(paths) == 4
    node = {p: i + 1 for i, p in enumerate(paths)}
    assert parents == [-1] + [node.get(p[:-1], 0) for p in paths]  # parents come first


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("top_k, total", [(2, 7), (3, 12), (1, 4)])
def test_dynamic_tree_matches_naive_eagle2(seed, top_k, total):
    draft = ToyDraft(vocab=5, seed=seed)
    config = DynamicTreeConfig(depth=4, top_k=top_k, total_tokens=total)
    paths, _ = kept_paths(draft, config)
    assert set(paths) == naive_eagle2(draft, config) and len(paths) == len(set(paths))
    assert len(paths) == min(total - 1, top_k + 3 * top_k * top_k)


def test_dynamic_tree_ties_keep_ancestors_and_are_deterministic():
    draft = ToyDraft(vocab=4, peaked=True)  # the certain chain scores 0 at every depth
    config = DynamicTreeConfig(depth=5, top_k=2, total_tokens=7)
    paths, parents = kept_paths(draft, config)
    assert [len(p) for p in paths] == [1, 1, 2, 3, 4, 5]  # the chain, then a tie at -1e4
    for p in paths:  # ancestor-closed
        assert len(p) == 1 or p[:-1] in paths
    assert kept_paths(draft, config) == (paths, parents)
    chain = max(paths, key=len)
    assert len(chain) == 5 and all(chain[:d] in paths for d in range(1, 5))


# ---- stub EAGLE heads ------------------------------------------------------------------------


class ToyEagle(nn.Module):
    """The drafting interface of an EAGLE head on a toy one-layer draft (random weights).

    Keys and values come from the row's input (feature, token, position) and live in a real
    DraftCache, so a wrong pairing, position or mask shows up in the cache and the logits.
    method "eagle3": features from two target layers and a reduced vocabulary (`draft_ids`).
    """

    def __init__(self, model, method="eagle", draft_ids=None):
        super().__init__()
        torch.manual_seed(7)
        H, V = model.config.hidden_size, model.config.vocab_size
        self.method = method
        self.layers = [1, 2] if method == "eagle3" else None
        self.fc = nn.Linear(H * (len(self.layers) if self.layers else 1), H)
        self.embed = nn.Embedding(V, H)
        self.wq, self.wk, self.wv = (nn.Linear(H, H) for _ in range(3))
        ids = torch.arange(V) if draft_ids is None else draft_ids
        self.register_buffer("ids", ids)
        self.out = nn.Linear(H, ids.numel())

    def feature_layers(self):
        return self.layers

    def target_hidden(self, features):
        return self.fc(features["aux"]) if self.layers else features["hidden"]

    def draft_to_target(self, ids):
        return self.ids[ids]

    def draft_hidden(self, tokens, hidden, position_ids, cache, attn_mask):
        return self.step(tokens, hidden, position_ids, cache, attn_mask)[0]

    def step(self, tokens, hidden, position_ids, cache, attn_mask):
        H, q, past = hidden.shape[-1], tokens.shape[1], cache.length
        angle = position_ids[..., None].float() * torch.arange(1, H + 1) / H
        x = torch.tanh(hidden + self.embed(tokens) + torch.sin(angle))  # (1, q, H)
        keys, values = cache.append(self.wk(x)[:, None], self.wv(x)[:, None])
        if attn_mask is None:
            attn_mask = torch.ones(q, past + q, dtype=torch.bool).tril(past)[None, None]
        assert attn_mask.shape == (1, 1, q, past + q)
        out = x + F.scaled_dot_product_attention(self.wq(x)[:, None], keys, values, attn_mask)[:, 0]
        return out, self.out(out)


class Oracle:
    """Any EAGLE head, with logits that know the target's greedy future (prompt + continuation).

    The row at position p whose token is future[p + 1] scores future[p + 2] first when that
    child sits at draft depth <= correct_depths, and last beyond (forcing accept lengths).
    Committed rows (no tree mask) must carry the target's own feature at p and token x_{p+1}.
    """

    def __init__(self, head, model, future, correct_depths=99):
        self.head, self.future, self.correct_depths = head, future.tolist(), correct_depths
        self.method, self.committed = head.method, 0
        with torch.no_grad():
            states = model(input_ids=future[None], output_hidden_states=True).hidden_states
            layers = head.feature_layers()
            aux = torch.cat([states[i] for i in layers], -1) if layers else None
            self.expected = head.target_hidden({"hidden": states[-1], "aux": aux})[0]

    def feature_layers(self):
        return self.head.feature_layers()

    def target_hidden(self, features):
        return self.head.target_hidden(features)

    def draft_to_target(self, ids):
        return self.head.draft_to_target(ids)

    def _check_committed(self, tokens, hidden, position_ids, attn_mask):
        if attn_mask is not None:
            return
        self.committed = int(position_ids[0, -1]) + 1
        for j, (p, tok) in enumerate(zip(position_ids[0].tolist(), tokens[0].tolist())):
            assert tok == self.future[p + 1], "committed rows pair the feature at p with x_{p+1}"
            assert torch.allclose(hidden[0, j], self.expected[p], atol=1e-4), "wrong feature"

    def draft_hidden(self, tokens, hidden, position_ids, cache, attn_mask):
        self._check_committed(tokens, hidden, position_ids, attn_mask)
        return self.head.draft_hidden(tokens, hidden, position_ids, cache, attn_mask)

    def step(self, tokens, hidden, position_ids, cache, attn_mask):
        self._check_committed(tokens, hidden, position_ids, attn_mask)
        out, logits = self.head.step(tokens, hidden, position_ids, cache, attn_mask)
        ids = self.head.draft_to_target(torch.arange(logits.shape[-1])).tolist()
        to_draft = {t: d for d, t in enumerate(ids)}
        committed, future = attn_mask is None, self.future
        for j, (p, tok) in enumerate(zip(position_ids[0].tolist(), tokens[0].tolist())):
            depth = 1 if committed else p - self.committed + 2  # depth of the child scored
            if p + 2 < len(future) and tok == future[p + 1] and future[p + 2] in to_draft:
                row = logits[0, j]
                good = depth <= self.correct_depths
                row[to_draft[future[p + 2]]] = row.max() + 20 if good else row.min() - 20
        return out, logits


def stub(model, method, future=None, correct_depths=99):
    """A toy head; with `future`, an oracle over it."""
    draft_ids = None
    if method == "eagle3":  # a reduced vocabulary that holds the greedy future, plus others
        keep = set(future.tolist()) if future is not None else set()
        draft_ids = torch.tensor(sorted(keep | set(range(0, 256, 3))))
    head = ToyEagle(model, method, draft_ids).eval()
    return head if future is None else Oracle(head, model, future, correct_depths)


def tree_for(kind):
    return build_tree(TREE) if kind == "static" else DYNAMIC


@pytest.mark.parametrize("tree", ["static", "dynamic"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("oracle", [True, False])
def test_greedy_with_stub_heads_equals_hf_generate(model, greedy_future, tree, method, oracle):
    head = stub(model, method, greedy_future if oracle else None)
    proposer = EagleProposer(head, tree_for(tree))
    result = generate(model, proposer)
    assert result.new_tokens.tolist() == greedy_future[PROMPT.shape[1] :][:NEW].tolist()
    if oracle:  # every step accepts a whole path of depth 4, plus the bonus token
        assert set(result.accept_lengths) == {5}


@pytest.mark.parametrize("accept", [0, 2, 3])
@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_stub_heads_force_each_accept_length(model, greedy_future, accept, tree):
    head = stub(model, "eagle", greedy_future, correct_depths=accept)
    result = generate(model, EagleProposer(head, tree_for(tree)))
    assert result.new_tokens.tolist() == greedy_future[PROMPT.shape[1] :][:NEW].tolist()
    assert set(result.accept_lengths) == {accept + 1}


def test_context_limit_and_chain(model, greedy_future):
    head = stub(model, "eagle3", greedy_future)
    limit = PROMPT.shape[1] + 9
    result = generate(model, EagleProposer(head, DYNAMIC), n=100, max_context=limit)
    assert result.stop_reason == "context" and result.tokens.shape[1] == limit
    assert result.new_tokens.tolist() == greedy_future[PROMPT.shape[1] : limit].tolist()
    chain = generate(model, EagleProposer(head, chain_tree(3)))
    assert set(chain.accept_lengths) == {4}
    root_only = generate(model, EagleProposer(head, build_tree([])), n=4)
    assert root_only.new_tokens.tolist() == greedy_future[PROMPT.shape[1] :][:4].tolist()


# ---- random real heads -----------------------------------------------------------------------


def real_head(target, method):
    from heads.eagle import EagleConfig, EagleHead
    from heads.eagle3 import Eagle3Config, Eagle3Head

    torch.manual_seed(3)
    if method == "eagle":
        head = EagleHead.for_target(EagleConfig(), target)
    else:
        counts = torch.arange(target.vocab_size).flip(0)  # any counts: a reduced vocabulary
        config = Eagle3Config(draft_vocab_size=target.vocab_size // 2)
        head = Eagle3Head.for_target(config, target, token_counts=counts)
    return diverse(head, std=0.3, seed=4).eval()  # strong attention: the context matters


@pytest.fixture(scope="module")
def target(model):
    return Target.from_model(model, None, name_or_path="tiny")


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_real_heads_are_lossless(target, greedy_future, method):
    head = real_head(target, method)
    want = greedy_future[PROMPT.shape[1] :][:NEW].tolist()
    for tree in (TREE, DYNAMIC):
        proposer = make_proposer(head, resolve_tree(tree))
        assert isinstance(proposer, EagleProposer)
        assert proposer.feature_layers == head.feature_layers()
        assert generate(target.model, proposer).new_tokens.tolist() == want


class Recorder:
    """A proposer that keeps every state, its draft and the committed draft cache after it."""

    def __init__(self, inner):
        self.inner, self.feature_layers, self.steps = inner, inner.feature_layers, []

    def propose(self, state):
        draft = self.inner.propose(state)  # leaves the cache at the committed positions
        cache = self.inner.cache
        self.steps.append((state, draft, cache.keys.clone(), cache.values.clone()))
        return draft


def recorded_run(target, head, tree, n=10):
    recorder = Recorder(EagleProposer(head, tree))
    result = generate(target.model, recorder, n=n)
    return recorder.steps, result.tokens[0]


def fresh_chain(target, head, context, path):
    """Draft one path on its own, from scratch: the committed rows, then each node as a plain
    causal row at the next position. context: committed tokens then the root; path: target ids
    below the root. Returns (the committed rows' keys and values, logits scoring the children of
    the path's last node)."""
    ids = context[None]
    features = target.features(ids, torch.ones_like(ids), head.feature_layers())
    hidden = head.target_hidden(features)[:, :-1]  # feature at t, paired with x_{t+1}
    cache, P = DraftCache(), context.numel() - 1
    out, logits = head.step(context[1:][None], hidden, torch.arange(P)[None], cache, None)
    committed = (cache.keys.clone(), cache.values.clone())
    h, lg = out[:, -1:], logits[0, -1]
    for depth, token in enumerate(path, start=1):
        position = torch.tensor([[P + depth - 1]])
        h, logits = head.step(torch.tensor([[token]]), h, position, cache, None)
        lg = logits[0, -1]
    return committed, lg


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_draft_cache_after_each_step_equals_a_recompute(target, greedy_future, method):
    head = real_head(target, method)
    oracle = Oracle(head, target.model, greedy_future, correct_depths=2)  # accepts 0 to 2
    with torch.no_grad():
        steps, sequence = recorded_run(target, oracle, DYNAMIC)
        assert len(steps) >= 3 and max(s.step_tokens.numel() for s, *_ in steps[1:]) > 1
        for state, _, keys, values in steps:
            (want_keys, want_values), _ = fresh_chain(
                target, head, sequence[: state.position + 1], []
            )
            assert keys.shape[2] == state.position
            torch.testing.assert_close(keys, want_keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(values, want_values, atol=1e-5, rtol=1e-4)


def node_path(draft, node):
    path = []
    while node > 0:
        path.append(int(draft.tokens[node]))
        node = int(draft.tree.parent[node])
    return path[::-1]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_static_tree_drafting_equals_path_by_path(target, method):
    head = real_head(target, method)
    tree = build_tree(TREE)
    with torch.no_grad():
        steps, sequence = recorded_run(target, head, tree, n=8)
        for state, draft, _, _ in steps[:4]:
            context = sequence[: state.position + 1]
            for node in range(tree.num_nodes):
                kids = tree.children(node)
                if not kids:
                    continue
                _, logits = fresh_chain(target, head, context, node_path(draft, node))
                top = head.draft_to_target(logits.topk(3).indices).tolist()
                assert [int(draft.tokens[c]) for c in kids] == [top[tree.rank[c]] for c in kids]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_dynamic_tree_drafting_equals_path_by_path(target, method):
    head = real_head(target, method)
    with torch.no_grad():
        steps, sequence = recorded_run(target, head, DYNAMIC, n=8)
        for state, draft, _, _ in steps[:4]:
            context = sequence[: state.position + 1]

            def logprobs(path, context=context):
                return torch.log_softmax(fresh_chain(target, head, context, path)[1].float(), -1)

            def expand(candidates, frontier):
                paths = [path_of(candidates, int(c)) for c in frontier]
                return torch.stack([logprobs(head.draft_to_target(torch.tensor(p))) for p in paths])

            candidates = grow_dynamic_tree(logprobs([]), expand, DYNAMIC)
            kept, parents = select_dynamic_tree(candidates, DYNAMIC.total_tokens)
            assert draft.tree.parent.tolist() == parents
            want = head.draft_to_target(candidates.tokens[kept]).tolist()
            assert draft.tokens[1:].tolist() == want and draft.draft_probs is None


# ---- losslessness of sampling with EAGLE drafts ----------------------------------------------

SMALL_VOCAB = 8


def chisquare_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value; cells expecting < 5 are pooled."""
    assert observed[probs == 0].sum() == 0, "a token the target cannot produce was emitted"
    expected = probs * observed.sum()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat, dof = float(((obs - exp) ** 2 / exp).sum()), obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


@pytest.mark.parametrize(
    "tree, draft_temperature, temperature, top_p",
    [("dynamic", None, 1.0, 1.0), ("static", 1.0, 0.8, 0.9), ("static", None, 0.8, 1.0)],
)
def test_sampling_with_eagle_drafts_is_lossless(tree, draft_temperature, temperature, top_p):
    from heads.eagle import EagleConfig, EagleHead

    model = diverse(make_llama(hidden=32, vocab=SMALL_VOCAB), std=0.25, seed=2)
    target = Target.from_model(model, None, name_or_path="tiny-8")
    torch.manual_seed(0)
    head = EagleHead.for_target(EagleConfig(), target).eval()
    shape = DynamicTreeConfig(depth=3, top_k=3, total_tokens=8) if tree == "dynamic" else TREE
    proposer = make_proposer(head, resolve_tree(shape))
    if draft_temperature is not None:
        proposer = EagleProposer(
            head, build_tree(TREE), draft_temperature, generator=torch.Generator().manual_seed(5)
        )
    sampler = SpeculativeSampler(
        temperature, top_p=top_p, generator=torch.Generator().manual_seed(3)
    )
    gen = SpeculativeGenerator(model, proposer, sampler)
    context = torch.tensor([2, 5, 1, 7, 4])  # prompt, then the root
    with torch.inference_mode():
        cache = kv_cache.make_cache(model)
        out = kv_cache.forward_features(model, cache, context[None, :-1])
        state = DecodeState(out.hidden, context[1:], context.numel() - 1, out.aux)
        samples = []
        for _ in range(1500):
            step, emitted = state, []
            while len(emitted) < 2:  # the first two tokens after the root
                step, tokens = gen.step(cache, step, 512)
                emitted += tokens
            kv_cache.crop_to(cache, state.position)
            samples.append(emitted[0] * SMALL_VOCAB + emitted[1])
        logits = model(input_ids=context[None]).logits[0, -1]
        p1 = process_logits(logits, temperature, 0, top_p)
        nexts = torch.cat([context.repeat(SMALL_VOCAB, 1), torch.arange(SMALL_VOCAB)[:, None]], 1)
        p2 = process_logits(model(input_ids=nexts).logits[:, -1], temperature, 0, top_p)
    observed = torch.bincount(torch.tensor(samples), minlength=SMALL_VOCAB**2).double()
    expected = (p1[:, None] * p2).flatten()
    assert chisquare_pvalue(observed, expected) > 1e-3
    if temperature != 1.0:  # the test has power: the unprocessed distribution is rejected
        raw = (
            torch.softmax(logits, -1)[:, None]
            * torch.softmax(model(input_ids=nexts).logits[:, -1].detach(), -1)
        ).flatten()
        assert chisquare_pvalue(observed, raw) < 1e-6


# ---- EAGLE-3 training-time test vs drafting ---------------------------------------------------


@pytest.mark.parametrize("length, step", [(4, 0), (4, 1), (5, 3)])
def test_ttt_mask_equals_the_drafting_mask(length, step):
    """Row t at TTT step i is the depth-i node of a chain drafted after committing 0..t."""
    from heads.eagle3 import ttt_attention_mask

    ttt = ttt_attention_mask(length, step)  # [T, (step + 1) * T], keys grouped by step
    for t in range(length):
        committed = t + 1
        if step == 0:  # the committed row itself (causal)
            mine = torch.ones(committed, dtype=torch.bool)
            drafted = torch.zeros(0, dtype=torch.bool)
        else:
            row = draft_tree_mask([list(range(step - 1))], committed, step - 1)[0]
            mine, drafted = row[:committed], row[committed:]  # drafted slots = depths 1..step
        want = torch.zeros((step + 1) * length, dtype=torch.bool)
        want[:committed] = mine
        for j, seen in enumerate(drafted.tolist(), start=1):  # depth j = TTT step j, row t
            want[j * length + t] = seen
        assert ttt[t].equal(want), (t, ttt[t], want)


# ---- configuration ---------------------------------------------------------------------------


def test_tree_configs_and_make_proposer(target):
    assert load_tree_spec(CONF / "tree" / "dynamic.yaml").dynamic == DynamicTreeConfig(6, 10, 60)
    chain = load_tree_spec(CONF / "tree" / "chain.yaml")
    assert chain == TreeSpec.static([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]) and chain.depth == 4
    assert resolve_tree({"depth": 3, "top_k": 2}).dynamic == DynamicTreeConfig(3, 2, 60)
    with pytest.raises(ValueError, match="paths"):
        resolve_tree({"depht": 3})
    with pytest.raises(ValueError, match="depth"):
        DynamicTreeConfig(depth=0)
    head = real_head(target, "eagle3")
    assert isinstance(make_proposer(head, resolve_tree(DYNAMIC)).tree, DynamicTreeConfig)
    from heads.medusa import MedusaConfig, MedusaHeads

    medusa = MedusaHeads.for_target(MedusaConfig(num_heads=2), target)
    with pytest.raises(ValueError, match="static tree only"):
        make_proposer(medusa, resolve_tree(DYNAMIC))
    with pytest.raises(ValueError, match="static tree"):
        EagleProposer(head, DYNAMIC, draft_temperature=1.0)
    proposer = EagleProposer(head, DYNAMIC)
    state = DecodeState(torch.zeros(1, 32), torch.tensor([5]), 7)
    with pytest.raises(ValueError, match="continues from position 6"):
        proposer.propose(state)


def test_evaluate_config_selects_the_dynamic_tree():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("evaluate", overrides=["tree=dynamic", "tree.top_k=8", "tree.depth=5"])
    assert resolve_tree(cfg.tree).dynamic == DynamicTreeConfig(depth=5, top_k=8, total_tokens=60)


def test_tau_evaluator_with_eagle_heads(tiny_llama, tmp_path):
    from eval.engine.tau import TauEvaluator

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["abc abc"]}) + "\n")
    head = real_head(tiny_llama, "eagle3")
    for tree in (CONF / "tree" / "dynamic.yaml", {"depth": 3, "top_k": 3, "total_tokens": 9}, 2):
        result = TauEvaluator(prompts, limit=1, max_new_tokens=6, tree=tree)(head, tiny_llama)
        assert 1.0 <= result["tau"] and math.isfinite(result["tau_per_request"])


@pytest.mark.integration
def test_evaluate_runs_an_eagle3_head_on_a_dynamic_tree(tmp_path):
    """evaluate.py's body (eval.bench.harness.run) with `tree=dynamic` and a saved EAGLE-3 head."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from eval.bench.harness import run
    from heads.target import load_target

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"category": "a", "turns": ["Hello there"]}) + "\n")
    overrides = [
        "model=tiny_random_llama",
        "bench=jsonl",
        f"bench.path={prompts}",
        "bench.max_new_tokens=8",
        "bench.warmup=0",
        "methods=[plain,head]",
        "tree=dynamic",
        "tree.depth=3",
        "tree.top_k=4",
        "tree.total_tokens=10",
        f"out_dir={tmp_path / 'out'}",
        "threads=1",
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("evaluate", overrides=overrides)
    target = load_target(instantiate(cfg.model, _convert_="all"))
    real_head(target, "eagle3").save_pretrained(tmp_path / "head")
    cfg.head_path = str(tmp_path / "head")
    summary = run(cfg)
    assert summary["meta"]["head_method"] == "eagle3"
    assert summary["meta"]["tree_nodes"] == 10 and summary["meta"]["tree_depth"] == 3
    assert summary["methods"]["head"]["overall"]["greedy_mismatches"] == 0
