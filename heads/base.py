"""What every draft head shares: the head Protocols, the loss output, and writing a head folder.

`DraftHead` is the whole contract: what train/, eval/ and the exporters may ask of a head, the
per-method facts included (as class attributes), so that no module outside heads/ keeps a table
keyed by method name. `ParallelDrafter`, `FeatureDrafter` and `BlockDrafter` are the ways a head
drafts. `Validates` (heads/acceptance.py) marks a head whose validation reports more.

A head folder is `config.json` (the head's config dataclass plus the method name and the target
it was trained on) and `model.safetensors`; heads/folder.py reads one back and refuses a folder
that is damaged or that was made for another target.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from safetensors.torch import save_file
from torch import Tensor

from data.errors import DraftsmithError, NonFiniteError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class LossOutput:
    """A differentiable scalar loss plus statistics that add up across batches and ranks.

    `stats` maps a name (e.g. "head0/top1") to a float tensor `[sum, count]`; the training loop
    sums these and reports `sum / count`, so means stay exact under padding and sharding.
    """

    loss: Tensor
    stats: dict[str, Tensor] = field(default_factory=dict)


@runtime_checkable
class DraftHead(Protocol):
    """Everything the rest of draftsmith may ask of a draft head (Medusa, EAGLE, EAGLE-3, ...).

    Class attributes carry the facts about the method, so that train/, eval/ and the exporters
    ask the head class instead of keeping tables keyed by method name:

    method:               the name written into config.json ("medusa"); the registry key.
    config_class:         its config dataclass; `heads.build_head` dispatches on the exact type.
    title:                one line naming the method, for model cards.
    hub_tag:              the Hub tag of its family (Medusa-2 is tagged "medusa").
    export_formats:       heads.interop formats it can be written in ("native" first).
    export_note:          why other formats are refused, when that needs saying ("" otherwise).
    drafting:             the drafting Protocol it implements (ParallelDrafter or FeatureDrafter);
                          eval/ picks the proposer that drafts with that Protocol.
    uses_target_features: False when the head runs the target itself (the loop then feeds plain
                          token batches instead of target features).
    adapts_target:        True when loading the head changes the target (Medusa-2's LoRA), so
                          every method decoding next to it runs the adapted target.
    target_dims:          TargetInfo fields the target must share with the one it was trained
                          on for the head's tensors to fit.
    example_targets:      (optional method) example -> {key: (T,) tensor}, per-token training
                          targets derived from an example's cached features, computed once
                          and kept for every epoch (train.features.ExampleTargets); the keys
                          are data.dataset.DERIVED_KEYS and reach `loss` in the batch.
    runtime_settings:     (optional, default none) config fields that change only how a trained
                          head drafts, not its tensors, so evaluate.py may set them
                          (`head_settings`; see `apply_runtime_settings`).
    """

    method: ClassVar[str]
    config_class: ClassVar[type]
    title: ClassVar[str]
    hub_tag: ClassVar[str]
    export_formats: ClassVar[tuple[str, ...]]
    export_note: ClassVar[str]
    drafting: ClassVar[type]
    uses_target_features: ClassVar[bool]
    adapts_target: ClassVar[bool]
    target_dims: ClassVar[tuple[str, ...]]

    config: Any
    target_info: TargetInfo

    @classmethod
    def for_target(cls, config: Any, target: Any, token_counts: Tensor | None = None) -> Any:
        """A new head for `target` (token_counts: label counts, for a reduced vocabulary)."""

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, target: Any, doc: dict | None = None,
        allow_other_target: bool = False,
    ) -> Any:  # fmt: skip
        """Load a folder written by `save_pretrained` onto `target` (see `open_head`)."""

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write config.json and model.safetensors."""

    def feature_layers(self) -> list[int] | None:
        """HF `hidden_states` indices the head needs as "aux" features, or None."""

    def loss(self, batch: dict[str, Tensor], features: dict[str, Tensor]) -> LossOutput:
        """Loss and the statistics training logs for one batch (data/: the batch layout)."""

    def init_from(self, tensors: dict[str, Tensor], source: str) -> list[str]:
        """Take a saved head's tensors before training (`init_from=`); the names left as built."""

    @property
    def draft_vocab_size(self) -> int:
        """How many tokens the draft scores (D <= the target's vocabulary)."""

    @property
    def max_draft_depth(self) -> int | None:
        """The deepest token one drafting step can propose (None: no limit)."""

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target-vocabulary ids."""


@runtime_checkable
class ParallelDrafter(DraftHead, Protocol):
    """Drafts every depth at once from the target's last hidden state (Medusa): calling the
    head maps h_t (..., H) to logits (K, ..., D), row k scoring the token at depth k + 1."""

    def __call__(self, hidden: Tensor) -> Tensor: ...


@runtime_checkable
class FeatureDrafter(DraftHead, Protocol):
    """Drafts depth by depth, feeding its own predicted features back (EAGLE, EAGLE-3).

    target_hidden(features) -> (..., H): the feature rows it reads from the target;
    draft_hidden(tokens, hidden, position_ids, cache, attn_mask) -> (B, q, H): its next features;
    step(...) -> (next features, logits over the draft vocabulary).
    """

    def target_hidden(self, features: dict[str, Tensor]) -> Tensor: ...

    def draft_hidden(
        self, tokens: Tensor, hidden: Tensor, position_ids: Tensor, cache: Any,
        attn_mask: Tensor | None = None,
    ) -> Tensor: ...  # fmt: skip

    def step(
        self, tokens: Tensor, hidden: Tensor, position_ids: Tensor, cache: Any,
        attn_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]: ...  # fmt: skip


@runtime_checkable
class BlockDrafter(DraftHead, Protocol):
    """Drafts a whole block in one forward from injected target context (DFlash, DSpark).

    The draft keeps, per layer, keys/values of the committed context:
    new_cache() -> an empty cache (`.length`, `.crop(n)`);
    context(features) -> (..., H): the fused context rows of target features ("aux");
    extend_cache(cache, context, position_ids): append committed rows at those positions;
    draft_block(anchor, position, cache) -> (B, max_draft_depth, D): one forward over
        [anchor, MASK, ...] at positions position, position + 1, ...; row d-1 scores the token
        at depth d (d places after the anchor). The cache is read, not changed.
    A head whose slots depend on the token drafted before them (DSpark's Markov head) also has
    draft_chain(root, position, cache, depth, draft_temperature, generator), which the proposer
    then uses for chains (eval/engine/block_proposer.py).
    """

    block_size: int

    def context(self, features: dict[str, Tensor]) -> Tensor: ...

    def new_cache(self) -> Any: ...

    def extend_cache(self, cache: Any, context: Tensor, position_ids: Tensor) -> None: ...

    def draft_block(self, anchor: Tensor, position: Tensor, cache: Any) -> Tensor: ...


@dataclass
class TargetInfo:
    """What a head records about the target it was trained on."""

    name_or_path: str = ""
    hidden_size: int = 0
    vocab_size: int = 0
    num_layers: int = 0
    fingerprint: str = ""

    @classmethod
    def of(cls, target: Any) -> TargetInfo:
        return cls(
            name_or_path=str(target.name_or_path),
            hidden_size=int(target.hidden_size),
            vocab_size=int(target.vocab_size),
            num_layers=int(target.num_layers),
            fingerprint=str(target.fingerprint),
        )


class HeadMismatchError(DraftsmithError, ValueError):
    """A head checkpoint does not fit the target it is being loaded onto."""


def apply_runtime_settings(head: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """Set drafting-only config fields of a loaded head (evaluate.py's `head_settings`, e.g.
    DSpark's `confidence_threshold`): each must be one of the head class's `runtime_settings`;
    the config is validated again, and left as it was when a value is refused. Returns the
    values set."""
    allowed = tuple(getattr(type(head), "runtime_settings", ()))
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise ValueError(
            f"head_settings {unknown}: a {head.method} head can change only "
            f"{list(allowed) or 'nothing'} after training (the rest is in its tensors or "
            "config.json; retrain to change it)."
        )
    if not settings:
        return {}
    old = {key: getattr(head.config, key) for key in settings}
    try:
        for key, value in settings.items():
            setattr(head.config, key, value)
        head.config.__post_init__()
    except Exception:
        for key in settings:
            setattr(head.config, key, old[key])
        raise
    return dict(settings)


def atomic_save_dir(path: str | os.PathLike, write: Any) -> Path:
    """Call `write(tmp_dir)`, make it durable, then put it at `path` in one step.

    The folder is filled under a temporary name beside `path` and its files fsynced, so `path`
    holds either the whole old folder or the whole new one, never a mix. An existing `path` is
    swapped with the new folder atomically where the OS can (Linux renameat2); elsewhere it is
    moved aside first, and an interrupted swap is undone by the next call (see
    `restore_interrupted_swap`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    restore_interrupted_swap(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        write(tmp)
        _usual_permissions(tmp)
        _fsync_tree(tmp)
        if not path.exists():
            os.replace(tmp, path)
        elif _exchange(tmp, path):  # tmp now holds the old folder
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            old = path.with_name(f".{path.name}{_OLD_MARK}{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


_OLD_MARK = ".old-"  # `.<name>.old-<pid>`: the old folder, moved aside during a swap


def restore_interrupted_swap(path: str | os.PathLike) -> bool:
    """Put back the old folder of a swap that was killed between its two renames (only where
    `_exchange` is unsupported); True if one was restored."""
    path = Path(path)
    if path.exists() or not path.parent.is_dir():
        return False
    moved = sorted(path.parent.glob(f".{path.name}{_OLD_MARK}*"), key=lambda p: p.stat().st_mtime)
    if not moved:
        return False
    os.replace(moved[-1], path)
    return True


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux `renameat2(RENAME_EXCHANGE)`);
    False where the OS, libc or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync_tree(folder: Path) -> None:
    """fsync every file under `folder`, then the folders themselves (deepest first)."""
    folders = [folder]
    for item in sorted(folder.rglob("*")):
        if item.is_dir():
            folders.append(item)
        else:
            with open(item, "rb") as f:
                os.fsync(f.fileno())
    for item in reversed(folders):
        _fsync_dir(item)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform that cannot open folders (Windows)
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _usual_permissions(folder: Path) -> None:
    """mkdtemp makes a 0700 folder (and some writers 0600 files): give the folder and its files
    the modes a plain mkdir/open would have under the umask, so other users (a serving engine's
    account) can read a head."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for item in folder.rglob("*"):
        item.chmod((0o777 if item.is_dir() else 0o666) & ~umask)


def check_finite(tensors: dict[str, Tensor], path: str | os.PathLike) -> None:
    """Refuse to write weights holding inf/NaN: such a head drafts garbage and hides why."""
    bad = [name for name, t in tensors.items() if t.is_floating_point() and not t.isfinite().all()]
    if bad:
        raise NonFiniteError(
            f"refusing to save {path}: {len(bad)} tensor(s) hold inf/NaN ({', '.join(bad[:3])}); "
            "training diverged or its features overflowed: lower trainer.lr or set "
            "data.feature_dtype=bfloat16, and train again."
        )


def save_head(
    path: str | os.PathLike, method: str, config: Any, target: TargetInfo, tensors: dict,
    also: Callable[[Path], None] | None = None,
) -> None:  # fmt: skip
    """Write a head folder atomically: config.json (method, config, target) + model.safetensors,
    and whatever `also(folder)` writes into the same folder before it is put in place.

    Identical weights give byte-identical files (sorted JSON and safetensors metadata), so two
    heads can be compared by hash. Weights holding inf/NaN are refused (NonFiniteError).
    """
    doc = {
        "method": method,
        "draftsmith_version": "0.1.0",
        "config": dataclasses.asdict(config),
        "target": dataclasses.asdict(target),
    }
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    check_finite(tensors, path)

    def write(tmp: Path) -> None:
        (tmp / CONFIG_NAME).write_text(json.dumps(doc, indent=2) + "\n")
        save_safetensors(tensors, tmp / WEIGHTS_NAME, {"format": "pt", "method": method})
        if also is not None:
            also(tmp)

    atomic_save_dir(path, write)


class HeadFolderMixin:
    """The one `save_pretrained` of every head class: a head folder (`save_head`) holding
    `folder_tensors()` (the whole state dict unless a head says otherwise) and whatever
    `write_beside(folder)` adds to the same folder (nothing unless a head says otherwise)."""

    def save_pretrained(self, path: str | os.PathLike) -> None:
        tensors = self.folder_tensors()
        save_head(path, self.method, self.config, self.target_info, tensors, self.write_beside)

    def folder_tensors(self) -> dict[str, Tensor]:
        return dict(self.state_dict())

    def write_beside(self, folder: Path) -> None:
        pass


def save_safetensors(tensors: dict[str, Tensor], path: str | os.PathLike, metadata: dict) -> None:
    """`safetensors.torch.save_file` with the metadata in sorted order: the library writes it
    in hash-map order, which differs between processes, so equal weights gave unequal files.
    The header is rewritten in place; sorting keeps its length."""
    save_file(tensors, str(path), metadata=metadata)
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        raw = f.read(size)
        header = json.loads(raw)
        meta = header.pop("__metadata__", None)
        if meta is not None:
            header = {"__metadata__": dict(sorted(meta.items())), **header}
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > size:
            raise RuntimeError(f"{path}: safetensors header grew when sorted (a bug)")
        f.seek(8)
        f.write(text.ljust(size, b" "))


def warm_start(module: torch.nn.Module, tensors: dict[str, Tensor], source: str) -> list[str]:
    """Copy a saved head's tensors (read from `source`) into `module` (a freshly built head, or
    the part of one that has the saved head's layout) before training, e.g. Medusa-1 heads for
    Medusa-2's joint stage. Every saved tensor must exist in `module` with the same shape;
    returns the names `module` has that the file does not (they keep their initial values).
    """
    own = module.state_dict()
    unexpected = sorted(k for k in tensors if k not in own)
    wrong = sorted(k for k in tensors if k in own and own[k].shape != tensors[k].shape)
    if unexpected or wrong:
        shapes = [
            f"{k}: saved {tuple(tensors[k].shape)}, here {tuple(own[k].shape)}" for k in wrong
        ]
        raise HeadMismatchError(
            f"init_from={source}: its tensors do not fit this head (not in this head: "
            f"{unexpected[:4]}; other shapes: {shapes[:4]}). Start from a head of the same method "
            "family and sizes (num_heads, num_layers, draft_vocab_size), or drop init_from."
        )
    module.load_state_dict(tensors, strict=False)
    return sorted(set(own) - set(tensors))


def masked_shift(mask: Tensor, shift: int) -> Tensor:
    """`out[:, t] = mask[:, t + shift]`, 0 past the end: positions with a label `shift` ahead."""
    out = torch.zeros_like(mask)
    if shift < mask.shape[1]:
        out[:, : mask.shape[1] - shift] = mask[:, shift:]
    return out


@torch.no_grad()
def lm_head_argmax(weight: Tensor, hidden: Tensor, chunk: int = 1024) -> Tensor:
    """The greedy token of an lm_head `weight` (V, H) for hidden (..., H) over its whole
    vocabulary, `chunk` rows at a time (the (rows, V) logits are the largest tensor of a
    training step)."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    best = [
        torch.nn.functional.linear(c.to(weight.dtype), weight).argmax(-1) for c in rows.split(chunk)
    ]
    if not best:
        return torch.zeros(hidden.shape[:-1], dtype=torch.long, device=hidden.device)
    return torch.cat(best).reshape(hidden.shape[:-1])


# ---- packed rows ----------------------------------------------------------------------------
# A packed batch (data/dataset.py `pack_examples`, `trainer.pack_tokens`) holds several
# conversations per row and carries `segment_ids` (B, T) (1, 2, ... per conversation, 0 on
# padding) and `position_ids` (B, T) (restarting at 0 in each conversation). A padded batch has
# neither, and these helpers then give exactly what the heads computed before packing existed.


def label_mask(batch: dict[str, Tensor], shift: int) -> Tensor:
    """(B, T) bool: position t has an assistant label `shift` tokens ahead *in its own
    conversation* (`loss_mask[t + shift]`, and in a packed row the same segment as t)."""
    valid = masked_shift(batch["loss_mask"], shift).bool()
    segments = batch.get("segment_ids")
    if segments is not None:
        valid &= masked_shift(segments, shift) == segments
    return valid


def batch_positions(batch: dict[str, Tensor], length: int) -> Tensor:
    """(B, length) position ids of the first `length` tokens: the batch's own (restarting per
    conversation in packed rows) or 0, 1, ... for padded rows."""
    ids = batch["input_ids"]
    if "position_ids" in batch:
        return batch["position_ids"][:, :length]
    return torch.arange(length, device=ids.device).expand(ids.shape[0], length)


def segment_causal_mask(segments: Tensor | None) -> Tensor | None:
    """(B, 1, T, T) bool: row t may attend to s <= t of its own conversation (block-diagonal
    causal); None for a padded batch (plain causal attention)."""
    if segments is None:
        return None
    T = segments.shape[1]
    rows = torch.arange(T, device=segments.device)
    causal = rows[None, :] <= rows[:, None]  # (T, T)
    return (causal & (segments[:, :, None] == segments[:, None, :]))[:, None]


def stat_pair(value, count, device) -> Tensor:
    """A `[sum, count]` statistic (see LossOutput)."""
    value = torch.as_tensor(value, dtype=torch.float32, device=device).reshape(())
    return torch.stack([value, torch.tensor(float(count), device=device)])
