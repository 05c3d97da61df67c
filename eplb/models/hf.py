"""Hugging Face MoE architectures behind the :class:`~eplb.model.MixtureOfExperts` protocol.

:class:`HFMoE` is one EP rank of a transformers causal LM (qwen2_moe, qwen3_moe, mixtral, olmoe,
deepseek_v3, gpt_oss, glm4_moe, qwen3_next). Every MoE layer's fused expert tensors
(``gate_up_proj``/``down_proj``, plus biases for gpt_oss, expert index first) become this rank's
slot tensors (``[num_local_slots, ...]``, what :meth:`expert_weights` returns and the EPLB moves
unchanged); everything else (attention, norms, router, shared experts) is HF's own. Each rank
serves its own requests in one packed forward per step (:meth:`HFMoE.forward_batch`,
:mod:`eplb.models.packed`); the experts run through :mod:`eplb.models.kernel` on the rank that
holds the chosen replica (:mod:`eplb.models.dispatch`), so a request's output is bitwise that of
the unsharded model served by the same code in one process (:func:`reference_probe`).

Weights come from a :class:`CheckpointSource` (a ``save_pretrained`` directory: a rank reads
only its own slots' experts, slice by slice, and reloads lost experts from it) or a
:class:`RandomSource` (a tiny random model from an architecture, a config and a seed).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from eplb.model import mismatched_slots, mismatched_staged
from eplb.models.config import HFModelConfig, tiny_config
from eplb.models.dispatch import register, step_header
from eplb.models.kernel import (
    KERNEL_NAME,
    ExpertsContext,
    check_row_independent,
    decode_rows,
    placement_print,
    row_floor,
)
from eplb.models.local_exchange import LocalExchange
from eplb.models.packed import (
    SeqState,
    choose_tile,
    crop_state,
    forward_packed,
    register_attention,
    relayout_linears,
    wrap_linear_attention,
)
from eplb.models.shared_weights import share_dense
from eplb.placement import Placement

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["CheckpointSource", "DecodeState", "HFMoE", "ModelInfo", "ProbeResult", "RandomSource", "describe",
           "open_source", "reference_probe", "unsharded"]


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The causal LM's decoder layers, ``model.model.layers``."""
    layers = model.get_submodule("model.layers")
    assert isinstance(layers, nn.ModuleList)  # every architecture served keeps its decoder layers in a ModuleList
    return layers


def _experts_of(model: nn.Module, layer: int) -> nn.Module:
    """Decoder layer ``layer``'s fused experts module, ``model.model.layers[layer].mlp.experts``."""
    return _decoder_layers(model)[layer].get_submodule("mlp.experts")


def _moe_layers(model: nn.Module) -> list[int]:
    """Indices of the decoder layers whose ``mlp`` has fused experts (dense layers are skipped)."""
    return [i for i, layer in enumerate(_decoder_layers(model))
            if hasattr(getattr(getattr(layer, "mlp", None), "experts", None), "down_proj")]


def _expert_names(experts: nn.Module) -> tuple[str, ...]:
    return tuple(name for name, _ in experts.named_parameters(recurse=False))


def _storage(experts: nn.Module, names: Sequence[str]) -> tuple[tuple[tuple[tuple[int, ...], torch.dtype], ...],
                                                                 tuple[bool, ...]]:
    """Each expert tensor's slot layout (shape after the slot dim, dtype) and whether it is the
    module's transposed: every matrix is stored ``[in, out]`` (gpt_oss's already are; the others'
    ``[out, in]`` are flipped), so the kernel's GEMMs read the weights untransposed: on MKL a
    transposed operand moved the row floor from 2 to 16 rows on an AVX-512 Xeon (see the kernel)."""
    tails, flips = [], []
    for n in names:
        t = getattr(experts, n)
        flip = t.dim() == 3 and not getattr(experts, "is_transposed", False)
        tails.append((tuple(t.shape[1:][::-1] if flip else t.shape[1:]), t.dtype))
        flips.append(flip)
    return tuple(tails), tuple(flips)


def _is_expert_param(name: str) -> bool:
    return ".mlp.experts." in name


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return model.get_submodule(path), leaf


def _materialize(model: nn.Module, config) -> None:
    """Give every non-expert parameter on the meta device real (uninitialized) memory, and
    recompute non-persistent buffers (rotary frequencies) by building their module again.

    Tied parameters (one object under several names) stay tied: every alias gets the same tensor.
    """
    fresh: dict[int, nn.Parameter] = {}
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if _is_expert_param(name) or p.device.type != "meta":
            continue
        if id(p) not in fresh:
            fresh[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=False)
        module, leaf = _owner(model, name)
        module._parameters[leaf] = fresh[id(p)]
    for module in list(model.modules()):
        meta = {n: b for n, b in module.named_buffers(recurse=False) if b.device.type == "meta"}
        if not meta:
            continue
        with torch.device("cpu"):
            rebuilt = type(module)(getattr(module, "config", None) or config)
        for n, b in meta.items():
            module._buffers[n] = getattr(rebuilt, n).to(b.dtype)


def _counts(ctx: ExpertsContext) -> tuple[torch.Tensor, torch.Tensor]:
    """A context's ``(logical_counts, physical_counts)``: :meth:`HFMoE._bind` gives every context both."""
    assert ctx.logical_counts is not None and ctx.physical_counts is not None
    return ctx.logical_counts, ctx.physical_counts


class RandomSource:
    """A tiny random model: the architecture's tiny config under the user's overrides, seeded.

    Every rank builds the same full model from the seed (tiny by construction), so the canonical
    experts are kept in memory and an expert lost with a rank is rebuilt from the seed.
    """

    def __init__(self, spec: HFModelConfig):
        from transformers import AutoConfig

        assert spec.architecture is not None  # HFModelConfig holds exactly one of path and architecture; no path here
        self.spec = spec
        self.config = AutoConfig.for_model(spec.architecture, **tiny_config(spec.architecture, spec.config))
        self._full: PreTrainedModel | None = None
        self._experts: dict[int, list[torch.Tensor]] = {}

    def _build_full(self) -> PreTrainedModel:
        if self._full is None:
            from transformers import AutoModelForCausalLM

            torch.manual_seed(self.spec.seed)
            model = AutoModelForCausalLM.from_config(self.config).to(getattr(torch, self.spec.dtype)).eval()
            for i in _moe_layers(model):
                experts = _experts_of(model, i)
                self._experts[i] = [getattr(experts, n).detach().clone() for n in _expert_names(experts)]
            self._full = model
        return self._full

    def build(self, load: bool = True) -> PreTrainedModel:
        """The model with its non-expert weights (``load=False``: a meta skeleton, for a joining rank)."""
        from transformers import AutoModelForCausalLM

        if load:
            model = self._build_full()
            self._full = None  # the caller owns it now; the canonical experts were kept
            return model
        # built as _build_full builds it (then cast), so that the buffers have the full model's
        # dtypes: from_config(dtype=...) keeps the rotary frequencies in float32 where .to() casts
        # them, and the joining rank's non-expert broadcast then expected fewer bytes of bfloat16
        # than its source sent (gloo's size check killed it, every scale up of a bf16 model)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config).to(getattr(torch, self.spec.dtype)).eval()
        _materialize(model, self.config)
        return model

    def expert(self, layer: int, expert: int) -> list[torch.Tensor]:
        if not self._experts:
            self._build_full()
            self._full = None
        return [t[expert] for t in self._experts[layer]]


class CheckpointSource:
    """A local ``save_pretrained`` directory (safetensors, one file or an index of shards).

    Non-expert weights are read whole; expert tensors one expert at a time, with
    ``safe_open(...).get_slice`` for fused tensors (gpt_oss) or the per-expert keys transformers
    writes for the others (``experts.{e}.gate_proj/up_proj/down_proj``; mixtral's
    ``block_sparse_moe.experts.{e}.w1/w3/w2``), so a rank never reads another rank's experts.
    """

    def __init__(self, spec: HFModelConfig):
        from transformers import AutoConfig

        assert spec.path is not None  # open_source opens a checkpoint only for a spec with a path
        self.spec = spec
        self.path = spec.path
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"model path {self.path!r} is not a directory")
        self.config = AutoConfig.from_pretrained(self.path)
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self.files = {k: os.path.join(self.path, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            single = os.path.join(self.path, "model.safetensors")
            if not os.path.exists(single):
                raise FileNotFoundError(f"{self.path} has no model.safetensors nor model.safetensors.index.json")
            from safetensors import safe_open

            with safe_open(single, "pt") as f:
                self.files = dict.fromkeys(f.keys(), single)
        self._handles: dict[str, Any] = {}
        self.bytes_read = 0  # every tensor read from the directory
        self.expert_bytes_read = 0  # of which expert tensors (a rank reads only its own slots' experts)

    def _open(self, key: str):
        from safetensors import safe_open

        file = self.files[key]
        if file not in self._handles:
            self._handles[file] = safe_open(file, "pt")
        return self._handles[file]

    def _read(self, key: str, index: int | None = None) -> torch.Tensor:
        handle = self._open(key)
        t = handle.get_tensor(key) if index is None else handle.get_slice(key)[index]
        self.bytes_read += t.numel() * t.element_size()
        if _is_expert_param(key) or ".block_sparse_moe.experts." in key:
            self.expert_bytes_read += t.numel() * t.element_size()
        return t

    def _candidates(self, name: str) -> list[str]:
        """The checkpoint's keys for parameter ``name``: its own, or mixtral's ``block_sparse_moe`` one."""
        return [c for c in (name, name.replace(".mlp.", ".block_sparse_moe.")) if c in self.files]

    def _key(self, name: str) -> str:
        for candidate in self._candidates(name):
            return candidate
        raise KeyError(f"checkpoint {self.path} has no tensor for parameter {name}")

    def build(self, load: bool = True) -> PreTrainedModel:
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, self.spec.dtype)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config, dtype=dtype).eval()
        self._names = {i: _expert_names(_experts_of(model, i)) for i in _moe_layers(model)}
        self._refuse_unused(model)
        _materialize(model, self.config)
        if load:
            missing = []
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                if _is_expert_param(name):
                    continue
                try:
                    key = self._key(name)
                except KeyError:
                    if name in dict(model.named_buffers()):
                        continue  # a non-persistent buffer, recomputed by _materialize
                    missing.append(name)
                    continue
                with torch.no_grad():
                    t.copy_(self._read(key).to(t.dtype))
            if missing:
                raise KeyError(f"checkpoint {self.path} lacks {len(missing)} weights: {missing[:6]}")
        return model

    def _refuse_unused(self, model: PreTrainedModel) -> None:
        """Raise where the checkpoint holds tensors the model its config.json describes never reads
        (a config of fewer layers than the weights, another architecture's config over them): served,
        the weights would be silently other than the checkpoint's, and the output check, built from
        the same config, could not tell. What the model class itself ignores on load (transformers'
        ``_keys_to_ignore_on_load_unexpected``: DeepSeek-V3's next-token-prediction layer) is allowed."""
        used: set[str] = set()
        for name, _ in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            if not _is_expert_param(name):
                used.update(self._candidates(name))
        for layer, names in self._names.items():
            experts = getattr(_experts_of(model, layer), names[0]).shape[0]
            for name in names:
                used.add(f"model.layers.{layer}.mlp.experts.{name}")
                for keys in self._per_expert_keys(layer, range(experts), name):
                    used.update(keys)
        ignored = [re.compile(p) for p in getattr(type(model), "_keys_to_ignore_on_load_unexpected", None) or ()]
        unused = sorted(k for k in self.files if k not in used and not any(p.search(k) for p in ignored))
        if unused:
            raise ValueError(
                f"checkpoint {self.path} holds {len(unused)} tensors the model its config.json describes does not use "
                f"({', '.join(unused[:4])}{', ...' if len(unused) > 4 else ''}): config.json does not describe these "
                f"weights ({self.config.model_type}, {self.config.num_hidden_layers} layers); fix it or download the "
                "checkpoint again")

    #: per-expert key names transformers writes for each fused tensor: (HF names, mixtral names)
    _PER_EXPERT: ClassVar[dict[str, tuple[tuple[str, ...], ...]]] = {
        "gate_up_proj": (("gate_proj.weight", "up_proj.weight"), ("w1.weight", "w3.weight")),
        "down_proj": (("down_proj.weight",), ("w2.weight",)),
    }

    def _per_expert_keys(self, layer: int, experts: Sequence[int] | range, name: str) -> list[list[str]]:
        """The per-expert keys of fused tensor ``name`` for each of ``experts``, one list per expert and
        naming (transformers', mixtral's): ``[gate, up]`` or ``[down]``; none for an unknown name."""
        return [[f"model.layers.{layer}.{block}.experts.{e}.{part}" for part in parts]
                for block, parts in zip(("mlp", "block_sparse_moe"), self._PER_EXPERT.get(name, ())) for e in experts]

    def _per_expert(self, layer: int, expert: int, name: str) -> torch.Tensor:
        """One fused tensor of one expert from per-expert keys (``gate_up_proj`` is ``[gate; up]``)."""
        if name not in self._PER_EXPERT:
            raise KeyError(f"no per-expert checkpoint layout known for {name}")
        for keys in self._per_expert_keys(layer, [expert], name):
            if all(k in self.files for k in keys):
                return torch.cat([self._read(k) for k in keys])
        raise KeyError(f"checkpoint {self.path} has no {name} of expert {expert} in layer {layer}")

    def expert(self, layer: int, expert: int) -> list[torch.Tensor]:
        """Model layer ``layer``'s expert ``expert``, reading only that expert's bytes."""
        dtype = getattr(torch, self.spec.dtype)
        out = []
        for name in self._names[layer]:
            fused = f"model.layers.{layer}.mlp.experts.{name}"
            t = self._read(fused, expert) if fused in self.files else self._per_expert(layer, expert, name)
            out.append(t.to(dtype))
        return out


def open_source(spec: HFModelConfig) -> RandomSource | CheckpointSource:
    return CheckpointSource(spec) if spec.path is not None else RandomSource(spec)


@dataclass
class DecodeState:
    """A batch being decoded greedily: the HF model's own KV cache and what was generated."""

    cache: Any
    last: torch.Tensor  # [B] the tokens to feed next
    tokens: list[torch.Tensor] = field(default_factory=list)  # per step [B]
    logits: list[torch.Tensor] = field(default_factory=list)  # per step [B, V]


@dataclass(frozen=True)
class ProbeResult:
    """Greedy tokens and logits of the fixed probe batch, and a digest of their bits."""

    tokens: torch.Tensor  # [B, new_tokens]
    logits: torch.Tensor  # [B, new_tokens, V]
    digest: str

    @classmethod
    def of(cls, tokens: torch.Tensor, logits: torch.Tensor) -> ProbeResult:
        h = hashlib.sha256()
        h.update(tokens.to(torch.int64).contiguous().numpy().tobytes())
        h.update(str(logits.dtype).encode())
        h.update(logits.contiguous().view(torch.uint8).numpy().tobytes())
        return cls(tokens, logits, h.hexdigest())

    def compare(self, reference: ProbeResult) -> dict[str, Any]:
        """``identical`` (same digest) plus how far apart, for the report."""
        same_shape = self.logits.shape == reference.logits.shape
        diff = float((self.logits.float() - reference.logits.float()).abs().max()) if same_shape else float("inf")
        return {"identical": self.digest == reference.digest, "tokens_equal": bool(torch.equal(self.tokens, reference.tokens)),
                "max_abs_logit_diff": diff, "digest": self.digest, "reference_digest": reference.digest}


class HFMoE:
    """One EP rank of a Hugging Face MoE model (see the module docstring).

    ``placement`` and ``(rank, num_ranks)`` say which slots this rank holds; ``group`` is the
    EP group the experts combine over (``None``: the default group; unused with one rank).
    ``materialize=False`` leaves the slots unfilled (a rank whose experts arrive by transfer);
    ``load_non_expert=False`` leaves the non-expert weights for :meth:`sync_non_expert`.
    Each rank serves its own requests (:meth:`forward_batch`); the experts of every MoE layer
    are exchanged over the group (:mod:`eplb.models.dispatch`).
    """

    def __init__(self, spec: HFModelConfig | dict, placement: Placement, rank: int, num_ranks: int, *,
                 group: Any = None, timeout: float = 30.0, materialize: bool = True,
                 load_non_expert: bool = True, self_check: bool = True):
        register()
        register_attention()
        self.spec = spec if isinstance(spec, HFModelConfig) else HFModelConfig.model_validate(spec)
        self.source = open_source(self.spec)
        self.model = self.source.build(load=load_non_expert)
        self.model.set_experts_implementation(KERNEL_NAME)
        relayout_linears(self.model)
        wrap_linear_attention(self.model)
        self.moe_layer_ids = _moe_layers(self.model)
        self.group = group
        self.timeout = timeout
        first = _experts_of(self.model, self.moe_layer_ids[0])
        self.names = _expert_names(first)
        tails, self._flips = _storage(first, self.names)
        self._tails = list(tails)
        self.num_moe_layers = len(self.moe_layer_ids)
        self.num_logical_experts = getattr(first, self.names[0]).shape[0]
        self.num_expert_groups = int(getattr(self.model.config, "n_group", None) or 1)
        self.hidden_size = int(self.model.config.hidden_size)
        self.top_k = int(self.model.config.num_experts_per_tok)
        self.vocab_size = int(self.model.config.vocab_size)
        self._contexts: list[ExpertsContext] = []
        self._weights: list[list[torch.Tensor]] = []
        #: the group's collectives over shared memory, and the (group, rank, ranks) it was set up for
        self._local: LocalExchange | None = None
        self._local_for: tuple[Any, int, int] | None = None
        #: the mapping the dense weights read where the group's ranks share them (see eplb.models.shared_weights)
        self._dense_map: Any = None
        #: this rank has served a step in an earlier group (or alone): a later group is a rescale's,
        #: which does not share the dense weights again (see eplb.models.shared_weights.share_dense)
        self._served_before = False
        #: measure the experts' and the exchanges' CPU (take_cpu_split); off: the clock costs
        self.measure_cpu = False
        #: a slot's rows are padded to this many: the machine's floor for bits independent of the row count
        self.min_rows = row_floor(first, self._probe_weights(), self.hidden_size, self._tails[0][1])
        #: a slot's decode rows go in groups of at most this many, unpadded: they keep a row's bits alone
        self.decode_rows = decode_rows(first, self._probe_weights(), self.hidden_size, self._tails[0][1],
                                       floor=self.min_rows)
        #: packed rows are padded to a multiple of this: the smallest tile proved batch-invariant here
        self.tile = choose_tile(self.model)
        self.install_placement(placement, rank, num_ranks)
        self.replace_weights(self.allocate(self.num_local_physical_experts))
        if materialize:
            self.load_canonical()
        if self_check:
            self.self_check()

    # -- the protocol -------------------------------------------------------------------------
    def expert_weights(self) -> list[list[torch.Tensor]]:
        return self._weights

    def install_placement(self, placement: Placement, rank: int, num_ranks: int) -> None:
        if placement.num_layers != self.num_moe_layers or placement.num_logical != self.num_logical_experts:
            raise ValueError(f"placement has {placement.num_layers} layers x {placement.num_logical} experts; the model "
                             f"has {self.num_moe_layers} MoE layers x {self.num_logical_experts} experts")
        self.placement = placement
        self.rank = rank
        self.num_ranks = num_ranks
        self.num_physical_experts = placement.num_physical
        self.num_local_physical_experts = placement.slots_per_rank(num_ranks)
        self._bind()

    # -- weights ------------------------------------------------------------------------------
    def allocate(self, num_local: int) -> list[list[torch.Tensor]]:
        """Uninitialized slot tensors for ``num_local`` slots, per MoE layer, in :attr:`names` order."""
        return [[torch.empty((num_local, *tail), dtype=dtype) for tail, dtype in self._tails]
                for _ in range(self.num_moe_layers)]

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's tensors in one layer."""
        return sum(torch.Size(tail).numel() * torch.empty((), dtype=dtype).element_size() for tail, dtype in self._tails)

    def replace_weights(self, weights: list[list[torch.Tensor]]) -> None:
        """Serve from these slot tensors (a rescale's new weights); the EPLB writes them in place."""
        self._weights = weights
        self._bind()

    def _bind(self) -> None:
        """Point every MoE layer's experts module and kernel context at the current maps and tensors."""
        if not self._weights:
            return
        old = {c.layer: c for c in self._contexts}
        self._contexts = []
        for index, layer_id in enumerate(self.moe_layer_ids):
            experts = _experts_of(self.model, layer_id)
            tensors = self._weights[index]
            for name, t, flip in zip(self.names, tensors, self._flips):
                # the module's parameters are views of the slot tensors in its own layout: state_dict and the kernel agree
                experts._parameters[name] = nn.Parameter(t.transpose(1, 2) if flip else t, requires_grad=False)
            prev = old.get(index)
            ctx = ExpertsContext(
                layer=index, names=self.names, weights=tensors,
                logical_to_physical=self.placement.logical_to_physical[index],
                replica_count=self.placement.replica_count[index], rank=self.rank, num_ranks=self.num_ranks,
                slots_per_rank=self.num_local_physical_experts, group=self.group, timeout=self.timeout,
                min_rows=self.min_rows, decode_rows=self.decode_rows, timed=self.measure_cpu,
                placement_print=placement_print(self.placement.logical_to_physical[index], self.placement.replica_count[index]),
                logical_counts=torch.zeros(self.num_logical_experts, dtype=torch.int64),
                physical_counts=torch.zeros(self.num_physical_experts, dtype=torch.int64),
                rank_pairs=torch.zeros(self.num_ranks, dtype=torch.int64),
            )
            if prev is not None and _counts(prev)[1].numel() == _counts(ctx)[1].numel():
                ctx.logical_counts, ctx.physical_counts = _counts(prev)
            if prev is not None and prev.rank_pairs is not None and prev.rank_pairs.numel() == self.num_ranks:
                ctx.rank_pairs = prev.rank_pairs
            # ignore: torch types Module.__setattr__'s value as Tensor | Module, yet plain attributes work
            experts._eplb = ctx  # type: ignore[assignment]
            self._contexts.append(ctx)

    def set_group(self, group: Any) -> None:
        """The EP group to combine over from now on (after a rescale formed a new one)."""
        self.group = group
        for ctx in self._contexts:
            ctx.group = group

    def canonical_expert(self, layer: int, expert: int) -> list[torch.Tensor]:
        """The source's tensors of logical ``expert`` in MoE layer ``layer``, in the slots' layout (the reload path)."""
        tensors = self.source.expert(self.moe_layer_ids[layer], expert)
        return [t.t().contiguous() if flip else t for t, flip in zip(tensors, self._flips)]

    def load_canonical(self, layers: Sequence[int] | None = None) -> None:
        """Fill this rank's slots from the source; a checkpoint is read only for these slots' experts."""
        view = self.placement.rank_view(self.rank, self.num_ranks)
        for layer in range(self.num_moe_layers) if layers is None else layers:
            loaded: dict[int, list[torch.Tensor]] = {}
            for local, expert in enumerate(view.physical_to_logical[layer].tolist()):
                if expert not in loaded:
                    loaded[expert] = self.canonical_expert(layer, expert)
                with torch.no_grad():
                    for dst, src in zip(self._weights[layer], loaded[expert]):
                        dst[local].copy_(src)

    def verify(self) -> list[tuple[int, int]]:
        """``(layer, physical slot)`` of every local slot that does not hold exactly its expert."""
        return mismatched_slots(self)

    def verify_staged(self, layer: int, new_row: torch.Tensor, rank_plan, staging: list[torch.Tensor]) -> list[int]:
        """Local slots of a staged layer that do not hold exactly the expert ``new_row`` assigns."""
        return mismatched_staged(self, layer, new_row, rank_plan, staging)

    def _probe_weights(self) -> dict[str, torch.Tensor]:
        """Seeded weights of the experts' shapes and dtypes, 4 slots (the slots may not be filled yet)."""
        g = torch.Generator().manual_seed(0)
        return {n: (torch.randn((4, *tail), generator=g) * 0.2).to(dtype) for n, (tail, dtype) in zip(self.names, self._tails)}

    def self_check(self) -> None:
        """Start-up check that the experts kernel's bits do not depend on rows per call (see kernel)."""
        experts = _experts_of(self.model, self.moe_layer_ids[0])
        check_row_independent(experts, self._probe_weights(), self.hidden_size, self._tails[0][1], min_rows=self.min_rows,
                              decode_rows=self.decode_rows)

    # -- non-expert weights for joining ranks ---------------------------------------------------
    def non_expert_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every replicated tensor (parameters and buffers outside the experts), in name order."""
        seen: set[int] = set()
        out = []
        for name, t in sorted([*self.model.named_parameters(), *self.model.named_buffers()]):
            if _is_expert_param(name) or id(t) in seen:
                continue
            seen.add(id(t))
            out.append((name, t))
        return out

    def sync_non_expert(self, src: int, group: Any = None, timeout: float | None = None) -> dict[str, float]:
        """Broadcast the non-expert weights from group rank ``src`` to every rank of ``group``.

        A collective: every rank of ``group`` calls it (``None``: the default group; the joining
        rank is not in :attr:`group` yet, so the group is always named by the caller). Tensors go
        as one flat buffer per dtype. Returns ``{"bytes": ..., "seconds": ...}``.
        """
        started = time.perf_counter()
        limit = timedelta(seconds=self.timeout if timeout is None else timeout)
        # group.rank(), not dist.get_rank(group): a joining rank's standby group is not the default
        # group, and it has no default group yet
        me = group.rank() if group is not None else dist.get_rank()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for _, t in self.non_expert_tensors():
            by_dtype.setdefault(t.dtype, []).append(t)
        total = 0
        for dtype in sorted(by_dtype, key=str):
            tensors = by_dtype[dtype]
            flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if me == src else \
                torch.empty(sum(t.numel() for t in tensors), dtype=dtype)
            work = dist.broadcast(flat, src=dist.get_global_rank(group, src) if group is not None else src,
                                  group=group, async_op=True)
            if not work.wait(timeout=limit):
                raise TimeoutError(f"non-expert weight broadcast ({dtype}) did not finish within {limit}")
            if me != src:
                offset = 0
                with torch.no_grad():
                    for t in tensors:
                        t.copy_(flat[offset : offset + t.numel()].view_as(t))
                        offset += t.numel()
            total += flat.numel() * flat.element_size()
        return {"bytes": float(total), "seconds": time.perf_counter() - started}

    # -- load -----------------------------------------------------------------------------------
    def take_load(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs the dispatch delivered since the last call: ``(logical [layers, L], physical [layers, P])``.

        Summed over the whole group from the pair counts every rank exchanges in the dispatch
        (no collective of its own), so identical on every rank. The counters restart at zero.
        """
        logical = torch.stack([_counts(c)[0].clone() for c in self._contexts])
        physical = torch.stack([_counts(c)[1].clone() for c in self._contexts])
        for c in self._contexts:
            for counts in _counts(c):
                counts.zero_()
        return logical, physical

    def take_dispatch_balance(self) -> float | None:
        """Mean over max of the pairs each rank's experts computed since the last call, averaged
        over the MoE layers that computed any (the group's, identical on every rank); ``None``
        when nothing was dispatched. The counters restart at zero."""
        ratios = []
        for c in self._contexts:
            assert c.rank_pairs is not None  # _bind gives every context its counter
            top = int(c.rank_pairs.max()) if c.rank_pairs.numel() else 0
            if top:
                ratios.append(float(c.rank_pairs.float().mean()) / top)
            c.rank_pairs.zero_()
        return sum(ratios) / len(ratios) if ratios else None

    def time_cpu(self, on: bool = True) -> None:
        """Measure the CPU split that :meth:`take_cpu_split` reports (off by default: it reads the
        process's CPU clock around every exchange)."""
        self.measure_cpu = on
        for c in self._contexts:
            c.timed = on

    def take_cpu_split(self) -> dict[str, float]:
        """CPU seconds this rank spent in the experts kernel and in the exchanges (posting and
        waiting) since the last call, summed over the MoE layers (for benchmarks; zeros unless
        :meth:`time_cpu` is on)."""
        out = {"expert_cpu_s": 0.0, "collective_cpu_s": 0.0}
        for c in self._contexts:
            for key in out:
                out[key] += c.stats.get(key, 0.0)
                c.stats[key] = 0.0
        return out

    def _recording(self, on: bool) -> None:
        for c in self._contexts:
            c.record = on

    # -- serving ------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward_batch(self, inputs: Sequence[tuple[torch.Tensor, Any]]) -> tuple[torch.Tensor, list[Any]]:
        """ONE forward over this rank's whole batch; a collective on the EP group.

        ``inputs[i] = (new token ids of request i [n_i], its state or None for a new request)``;
        returns ``(logits [len(inputs), V] of each request's last new token, the new states)``.
        The states given are left unchanged (a failed step is rolled back by keeping them).
        Every rank of the group calls it once per step in which any rank has tokens; a rank
        with none calls it with ``[]`` and only takes part in the MoE exchanges. A request's
        logits are bitwise independent of the other requests, their order, the rank and the
        EP size (see :mod:`eplb.models.packed`).
        """
        checked = [self._checked_input(i, tokens, state) for i, (tokens, state) in enumerate(inputs)]
        self._attach_local()
        if not checked:
            self._idle_step()
            return torch.empty(0, self.vocab_size, dtype=self.dtype), []

        def on_rows(segments: Sequence[tuple[int, int]]) -> None:
            rows = segments[-1][1]
            # a request's one new token is a decode row (see pair_forward): its kind, like its bits,
            # is the request's own, whoever shares the step
            sizes = [end - start for start, end in segments]
            decode = torch.from_numpy(np.repeat(np.array(sizes) == 1, sizes))
            for c in self._contexts:
                c.rows, c.decode = rows, decode
            step_header(self._contexts, rows, self.top_k)

        try:
            return forward_packed(self.model, checked, on_rows, tile=self.tile)
        finally:
            for c in self._contexts:
                c.rows, c.decode = None, None

    def local_exchange(self) -> LocalExchange | None:
        """The shared-memory exchange of the group this rank serves in now, once a step has set it
        up (the same on every rank of the group, so a collective can go over it or gloo alike)."""
        return self._local if self._local_is_current() else None

    def _local_is_current(self) -> bool:
        """Whether the exchange was set up for the group, rank and size this rank serves in now."""
        last = self._local_for
        return last is not None and last[0] is self._serving_group() and last[1:] == (self.rank, self.num_ranks)

    def _serving_group(self) -> Any:
        """The process group this rank serves in (``group``, or torch's default one)."""
        return self.group if self.group is not None else dist.distributed_c10d._get_default_group()

    def _attach_local(self) -> None:
        """Give the contexts the group's shared-memory exchange, set up at the first step on a new
        group (a collective: every rank of the group runs this step; see :mod:`eplb.models.local_exchange`)."""
        if self.num_ranks == 1:
            self._served_before = True
            return
        if not self._local_is_current():
            if self._local is not None:
                self._local.close()
            group = self._serving_group()
            self._local, self._local_for = None, (group, self.rank, self.num_ranks)
            self._local = LocalExchange.create(group, self.rank, self.num_ranks, self.timeout)
            if self._local is not None:  # the group is on this host: its ranks read one copy of the dense weights
                mapped, _ = share_dense(self.model, group, self.rank, self.num_ranks, self.timeout,
                                        first_group=not self._served_before)
                if mapped is not None:  # (else the weights keep the mapping they read alive themselves)
                    self._dense_map = mapped
            self._served_before = True
        for c in self._contexts:
            c.local = self._local

    def _checked_input(self, index: int, tokens: Any, state: Any) -> tuple[torch.Tensor, SeqState | None]:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.numel() == 0 or tokens.is_floating_point():
            raise ValueError(f"request {index}: new tokens must be a non-empty 1-D tensor of token ids")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
            raise ValueError(f"request {index}: token ids must be in [0, {self.vocab_size})")
        if state is not None and not isinstance(state, SeqState):
            raise ValueError(f"request {index}: state must be None or a state forward_batch returned")
        return tokens.to(torch.long), state

    def _idle_step(self) -> None:
        """Take part in every MoE layer's exchanges with no tokens of our own (vLLM's dummy batch)."""
        from eplb.models.dispatch import exchange

        step_header(self._contexts, 0, 0)
        dtype = self.dtype
        hidden = torch.empty(0, self.hidden_size, dtype=dtype)
        for c, layer_id in zip(self._contexts, self.moe_layer_ids):
            exchange(c, _experts_of(self.model, layer_id), hidden, torch.empty(0, 1, dtype=torch.long),
                     torch.empty(0, 1, dtype=dtype))

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype (its ``model.dtype`` spec)."""
        return getattr(torch, self.spec.dtype)

    @staticmethod
    def state_length(state: Any) -> int:
        """Tokens held in a state's KV cache."""
        return int(state.length)

    @staticmethod
    def crop_state(state: Any, length: int) -> Any:
        """``state`` cut back to ``length`` tokens (a new state; see :func:`eplb.models.packed.crop_state`)."""
        return crop_state(state, length)

    # -- decoding -------------------------------------------------------------------------------
    def next_logits(self, input_ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        """Logits of the next token after ``input_ids [B, T]`` (``cache``: the states this returned
        before, ``None``: a prefill): ``(logits [B, V], states)``. One :meth:`forward_batch`."""
        states = [None] * input_ids.shape[0] if cache is None else cache
        return self.forward_batch(list(zip(input_ids, states)))

    _forward = next_logits

    def prefill(self, input_ids: torch.Tensor) -> DecodeState:
        """Start decoding ``input_ids [B, T]`` (equal-length prompts); the first greedy token is chosen.

        A collective: every rank of the EP group calls it at the same step, each with its own ids.
        """
        logits, cache = self._forward(input_ids, None)
        state = DecodeState(cache=cache, last=logits.argmax(dim=-1))
        state.tokens.append(state.last)
        state.logits.append(logits)
        return state

    def decode_step(self, state: DecodeState) -> torch.Tensor:
        """One greedy step of every sequence in ``state``; returns the new tokens ``[B]``."""
        logits, state.cache = self._forward(state.last[:, None], state.cache)
        state.last = logits.argmax(dim=-1)
        state.tokens.append(state.last)
        state.logits.append(logits)
        return state.last

    def generate(self, input_ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy ``new_tokens`` per sequence: ``(tokens [B, n], logits [B, n, V])``."""
        state = self.prefill(input_ids)
        for _ in range(new_tokens - 1):
            self.decode_step(state)
        return torch.stack(state.tokens, dim=1), torch.stack(state.logits, dim=1)

    def probe_batch(self) -> torch.Tensor:
        p = self.spec.probe
        g = torch.Generator().manual_seed(p.seed)
        return torch.randint(0, self.vocab_size, (p.batch, p.prompt_len), generator=g)

    def probe(self) -> ProbeResult:
        """Greedy tokens and logits of the fixed probe batch (a collective on the EP group: every
        rank runs the whole batch as its own requests, so every rank checks its own compute).

        The probe's pairs are not recorded as load.
        """
        self._recording(False)
        try:
            tokens, logits = self.generate(self.probe_batch(), self.spec.probe.new_tokens)
        finally:
            self._recording(True)
        return ProbeResult.of(tokens, logits)


@dataclass(frozen=True)
class ModelInfo:
    """What a deployment needs to know before building a rank: counts, and one expert's tensors."""

    num_moe_layers: int
    num_logical_experts: int
    num_expert_groups: int
    names: tuple[str, ...]
    tails: tuple[tuple[tuple[int, ...], torch.dtype], ...]  # per tensor: shape after the slot dim (slot layout), dtype

    @property
    def expert_bytes(self) -> int:
        return sum(torch.Size(t).numel() * torch.empty((), dtype=d).element_size() for t, d in self.tails)

    def allocate(self, num_local: int) -> list[list[torch.Tensor]]:
        """Uninitialized slot tensors for ``num_local`` slots (a standby rank's memory)."""
        return [[torch.empty((num_local, *t), dtype=d) for t, d in self.tails] for _ in range(self.num_moe_layers)]


def describe(spec: HFModelConfig | dict) -> ModelInfo:
    """Layer and expert counts and the expert layout of ``spec``, from a meta-device build (no weights)."""
    from transformers import AutoModelForCausalLM

    spec = spec if isinstance(spec, HFModelConfig) else HFModelConfig.model_validate(spec)
    cfg = open_source(spec).config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, spec.dtype))
    layers = _moe_layers(model)
    experts = model.model.layers[layers[0]].mlp.experts
    names = _expert_names(experts)
    return ModelInfo(len(layers), getattr(experts, names[0]).shape[0], int(getattr(cfg, "n_group", None) or 1), names,
                     _storage(experts, names)[0])


def unsharded(spec: HFModelConfig | dict) -> HFMoE:
    """The unsharded model in this process: one rank, one slot per expert, the same kernel."""
    info = describe(spec)
    placement = Placement.static(info.num_moe_layers, info.num_logical_experts, info.num_logical_experts)
    return HFMoE(spec, placement, 0, 1)


def reference_probe(spec: HFModelConfig | dict) -> ProbeResult:
    """The probe of the unsharded single-process model: what every EP probe must equal bitwise."""
    return unsharded(spec).probe()
