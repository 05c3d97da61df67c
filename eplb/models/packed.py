"""One forward over a rank's whole batch: requests packed into one sequence, attention per request.

:func:`forward_packed` runs a transformers causal LM once over many requests (prefill and decode
tokens alike), the way vLLM packs a step (varlen): the new tokens of every request side by side
in one ``[1, T]`` sequence, ``T`` padded to a multiple of a row tile (:func:`choose_tile`). Everything that
works row by row runs packed (embeddings, the q/k/v/o projections, norms, rotary, router,
shared experts, dense MLPs; the experts through the dispatch in :mod:`eplb.models.dispatch`);
what mixes rows runs per request, on the request's own Hugging Face cache (a ``DynamicCache`` of
batch 1):

- *attention*: a :class:`RoutingCache` stands in for the model's cache: its ``update`` splits
  the packed keys and values by request, appends each request's to that request's own cache,
  and hands back every request's whole keys and values side by side (each padded to a multiple
  of the tile, so position-wise code between the cache and the attention, like DeepSeek's
  MLA ``expand_kv``, runs at a fixed tile too); the attention function registered as
  :data:`ATTENTION_NAME` then calls the model's own attention function (sdpa, or its eager one
  with gpt_oss's sinks) once per request, with the causal or sliding-window mask transformers
  builds for that request alone (:func:`request_masks`, from the request's cache before the step);
- *linear attention* (qwen3_next's gated delta net): the module's forward is wrapped to run
  once per request on its slice of the rows with the request's own cache.

Why the bits do not depend on the batch: every packed op is row-independent at a fixed row
tile (a GEMM's rows are bitwise the same for any row count >= 4 on this machine, and ``T``, a
multiple of 32, leaves no scalar tail in a vectorized elementwise loop whose transcendentals
would differ in the last bit), and everything else runs per request on inputs that are the
same whoever shares the step. :func:`check_batch_invariant` proves the packed ops at start-up.
The states handed in are never changed: a step returns new ones, so a failed step is rolled
back by keeping the old states.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

__all__ = ["ATTENTION_NAME", "TILES", "RoutingCache", "SeqState", "check_batch_invariant", "choose_tile", "crop_state",
           "forward_packed", "register_attention", "relayout_linears", "request_masks", "wrap_linear_attention"]

#: The row tiles tried, smallest first: packed rows (and each request's keys and values handed to
#: attention) are padded to a multiple of the first one the start-up check passes (see choose_tile).
TILES = (4, 8, 16, 32, 64)
#: The attention function registered in transformers' AttentionInterface while a packed step runs.
ATTENTION_NAME = "eplb_packed"


@dataclass
class SeqState:
    """One request's sequence state: its Hugging Face cache (batch 1) and how many tokens it holds."""

    cache: Any
    length: int


@dataclass
class _Step:
    """What one packed forward's hooks read: each request's rows, cache, masks and keys/values."""

    segments: list[tuple[int, int]]
    caches: list[Any]
    masks: list[dict[str, Any]]
    layer_types: Callable[[int], str]
    attention: str  # the model's own attention implementation
    tile: int
    #: per attention layer: True when the model hands the keys and values the cache returned to the
    #: attention function unchanged (learned on the layer's first step; the model's, across steps)
    passthrough: dict[int, bool] = field(default_factory=dict)
    kv: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    parts: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=dict)
    returned: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: the attention function of each attention module class, looked up at its first layer of the step
    functions: dict[type, Callable[..., tuple[torch.Tensor, Any]]] = field(default_factory=dict)


_ACTIVE: list[_Step] = []


def _padded(n: int, tile: int) -> int:
    return max(tile, -(-n // tile) * tile)


class RoutingCache:
    """The model's ``cache`` during a packed step: routes each request's new keys and values to
    its own cache, and returns all requests' whole keys and values side by side."""

    def __init__(self, step: _Step):
        self.step = step

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values, spans = [], [], []
        offset = 0
        for (start, end), cache in zip(self.step.segments, self.step.caches):
            k, v = cache.update(key_states[:, :, start:end].contiguous(), value_states[:, :, start:end].contiguous(),
                                layer_idx, *args, **kwargs)
            keys.append(k)
            values.append(v)
            spans.append((offset, offset + k.shape[2]))
            offset += _padded(k.shape[2], self.step.tile)
        self.step.kv[layer_idx] = spans
        self.step.parts[layer_idx] = (keys, values)
        if self.step.passthrough.get(layer_idx):
            # the attention function reads each request's own keys and values (step.parts): hand
            # the model a stand-in of the side-by-side shape, no copy (an in-place write to it fails)
            shape = (keys[0].shape[0], keys[0].shape[1], offset, keys[0].shape[3])
            return keys[0].new_zeros(()).expand(shape), values[0].new_zeros(()).expand(*shape[:3], values[0].shape[3])
        whole = _side_by_side(keys, spans, offset), _side_by_side(values, spans, offset)
        self.step.returned[layer_idx] = whole
        return whole


def _side_by_side(parts: list[torch.Tensor], spans: list[tuple[int, int]], total: int) -> torch.Tensor:
    first = parts[0]
    out = first.new_empty(first.shape[0], first.shape[1], total, first.shape[3])
    for part, (start, end), gap_end in zip(parts, spans, [s for s, _ in spans[1:]] + [total]):
        out[:, :, start:end] = part
        out[:, :, end:gap_end] = 0  # the padding after each request's keys (only zeros need writing)
    return out


def _model_attention(module: nn.Module, implementation: str) -> Callable[..., tuple[torch.Tensor, Any]]:
    """The attention function the module runs outside a packed step (its modeling file's eager one for eager)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)


def packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The model's own attention once per request, on the request's rows, keys, values and mask."""
    step = _ACTIVE[-1]
    layer = int(module.layer_idx)  # type: ignore[arg-type]  # every attention module carries its layer index
    function = step.functions.get(type(module))
    if function is None:
        function = step.functions[type(module)] = _model_attention(module, step.attention)
    kind = step.layer_types(layer)
    kwargs.pop("position_ids", None)  # the packed positions; sdpa and eager do not read them
    direct = step.passthrough.get(layer)
    if direct is None:  # the layer's first step: did the keys and values come through unchanged?
        returned = step.returned.get(layer)
        step.passthrough[layer] = returned is not None and key is returned[0] and value is returned[1]
    keys, values = step.parts[layer]
    out = None
    for i, ((start, end), (k0, k1)) in enumerate(zip(step.segments, step.kv[layer])):
        k_i, v_i = ((keys[i], values[i]) if direct else
                    (key[:, :, k0:k1].contiguous(), value[:, :, k0:k1].contiguous()))
        o, _ = function(module, query[:, :, start:end].contiguous(), k_i, v_i, step.masks[i][kind], **kwargs)
        if out is None:
            out = o.new_empty(o.shape[0], query.shape[2], *o.shape[2:])
            out[:, step.segments[-1][1]:] = 0  # the padding rows; every request's rows are written below
        out[:, start:end] = o
    assert out is not None  # a packed step holds at least one request
    return out, None


def register_attention() -> None:
    """Register :data:`ATTENTION_NAME` in transformers' AttentionInterface (idempotent)."""
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention)


def wrap_linear_attention(model: Any) -> None:
    """Make every ``linear_attn`` module (qwen3_next) run per request during a packed step."""
    for layer in model.model.layers:
        module = getattr(layer, "linear_attn", None)
        if module is None or getattr(module, "_eplb_wrapped", False):
            continue
        original = module.forward

        def per_request(hidden_states: torch.Tensor, *args: Any, _original: Callable = original, **kwargs: Any):
            if not _ACTIVE:
                return _original(hidden_states, *args, **kwargs)
            step = _ACTIVE[-1]
            kwargs.pop("cache", None)
            kwargs.pop("attention_mask", None)
            kwargs.pop("position_ids", None)
            out = hidden_states.new_zeros(hidden_states.shape)
            for i, (start, end) in enumerate(step.segments):
                out[:, start:end] = _original(hidden_states[:, start:end], cache=step.caches[i],
                                              attention_mask=step.masks[i].get("linear_attention"), **kwargs)
            return out

        module.forward = per_request
        module._eplb_wrapped = True


def layer_types(config: Any) -> Callable[[int], str]:
    """The mask kind of each decoder layer, as the model's own forward picks it."""
    types = getattr(config, "layer_types", None)
    if types:
        return lambda i: str(types[i])
    default = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    return lambda i: default


def request_masks(config: Any, kinds: Collection[str], cache: Any, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    """The masks transformers builds for this request alone (its cache as before the step)."""
    from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING as MASKS

    embeds = torch.zeros((), dtype=dtype).expand(1, positions.numel(), int(config.hidden_size))
    return {kind: MASKS[kind](config=config, inputs_embeds=embeds, attention_mask=None, cache=cache,
                              position_ids=positions[None]) for kind in kinds}


#: the most keys a model's memo of mask-free steps holds (see _masks) before it starts afresh
_MASK_MEMO = 1 << 16


def _masks(model: Any, kinds: frozenset[str], cache: Any, positions: torch.Tensor, past: int, dtype: torch.dtype
           ) -> dict[str, Any]:
    """:func:`request_masks`, remembered where transformers builds no mask at all (its usual answer for
    a decode step under sdpa): a mask depends only on the model, its attention implementation, its
    cache's class, how many tokens the request holds and how many it adds, and the dtype, so a step
    of the same sizes needs none either. Building the answer costs 70-200 us per request and step on this machine."""
    memo = getattr(model, "_eplb_maskless", None)
    if memo is None or len(memo) > _MASK_MEMO:
        memo = model._eplb_maskless = set()
    key = (kinds, model.config._attn_implementation, type(cache), past, positions.numel(), dtype)
    if key in memo:
        return dict.fromkeys(kinds)
    masks = request_masks(model.config, kinds, cache, positions, dtype)
    if all(mask is None for mask in masks.values()):
        memo.add(key)
    return masks


def _fork(cache: Any) -> Any:
    """A copy of ``cache`` whose updates leave ``cache`` as it is (tensors are shared until replaced)."""
    from transformers.cache_utils import LinearAttentionLayer

    forked = _shallow(cache)
    forked.layers = [copy.deepcopy(layer) if isinstance(layer, LinearAttentionLayer) else _shallow(layer)
                     for layer in cache.layers]
    return forked


_PLAIN: dict[type, bool] = {}


def _shallow(obj: Any) -> Any:
    """``copy.copy(obj)``, at a fifth of its cost for a plain object (its state all in ``__dict__``:
    no slot holding a value, no ``__new__``, ``__copy__`` or ``__reduce_ex__`` of its own); a fork runs it for
    every layer of every request's cache, every step."""
    cls = type(obj)
    plain = _PLAIN.get(cls)
    if plain is None:
        plain = _PLAIN[cls] = (hasattr(obj, "__dict__") and not hasattr(cls, "__copy__") and cls.__new__ is object.__new__
                               and cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__
                               and not any(c.__dict__.get("__slots__") for c in cls.__mro__))
    if not plain:
        return copy.copy(obj)
    new = object.__new__(cls)
    new.__dict__.update(obj.__dict__)
    return new


def crop_state(state: SeqState, length: int) -> SeqState:
    """``state`` cut back to its first ``length`` tokens (a new state; ``state`` is unchanged)."""
    if not 0 <= length <= state.length:
        raise ValueError(f"cannot crop a state of {state.length} tokens to {length}")
    if length == state.length:
        return state
    forked = _fork(state.cache)
    try:
        for layer in forked.layers:
            if hasattr(layer, "crop"):
                layer.crop(length - state.length)
            else:
                raise RuntimeError(f"{type(layer).__name__} holds no per-token history")
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"this model's state cannot be cut back from {state.length} to {length} tokens ({exc}); "
                         "keep the state from before the step instead (forward_batch never changes its inputs)") from exc
    return SeqState(forked, length)


def _pack(inputs: Sequence[tuple[torch.Tensor, SeqState | None]], tile: int
          ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """Token ids and positions of the packed sequence (padded to the tile), and each request's rows."""
    ids, positions, segments = [], [], []
    row = 0
    for tokens, state in inputs:
        past = 0 if state is None else state.length
        ids.append(tokens)
        positions.append(torch.arange(past, past + tokens.numel()))
        segments.append((row, row + tokens.numel()))
        row += tokens.numel()
    pad = _padded(row, tile) - row
    ids.append(torch.zeros(pad, dtype=torch.long))
    positions.append(torch.zeros(pad, dtype=torch.long))
    return torch.cat(ids), torch.cat(positions), segments


def forward_packed(model: Any, inputs: Sequence[tuple[torch.Tensor, SeqState | None]],
                   on_rows: Callable[[list[tuple[int, int]]], None], *, tile: int) -> tuple[torch.Tensor, list[SeqState]]:
    """Logits ``[len(inputs), V]`` of each request's last new token, and the requests' new states.

    ``on_rows(segments)`` is told each request's packed rows ``[start, end)`` before the model runs
    (the experts dispatch only the real rows, and treat a one-row segment, a decode, as such);
    ``tile`` is the row tile :func:`choose_tile` proved on this model."""
    from transformers import DynamicCache

    config = model.config
    ids, positions, segments = _pack(inputs, tile)
    caches = [DynamicCache(config=config) if state is None else _fork(state.cache) for _, state in inputs]
    types = layer_types(config)
    kinds = frozenset(types(i) for i in range(int(config.num_hidden_layers)))
    dtype = model.get_input_embeddings().weight.dtype
    masks = [_masks(model, kinds, cache, positions[start:end], 0 if state is None else state.length, dtype)
             for cache, (start, end), (_, state) in zip(caches, segments, inputs)]
    learned = getattr(model, "_eplb_passthrough", None)
    if learned is None:
        learned = model._eplb_passthrough = {}
    step = _Step(segments, caches, masks, types, config._attn_implementation, tile, learned)
    on_rows(segments)
    _ACTIVE.append(step)
    config._attn_implementation = ATTENTION_NAME
    try:
        hidden = model.model(input_ids=ids[None], position_ids=positions[None],
                                              cache=RoutingCache(step), use_cache=True).last_hidden_state
    finally:
        config._attn_implementation = step.attention
        _ACTIVE.pop()
    last = torch.tensor([end - 1 for _, end in segments])
    rows = hidden.new_zeros(_padded(len(segments), tile), hidden.shape[-1])
    rows[: len(segments)] = hidden[0, last]
    logits = model.get_output_embeddings()(rows)[: len(segments)]
    states = [SeqState(cache, (0 if state is None else state.length) + tokens.numel())
              for cache, (tokens, state) in zip(caches, inputs)]
    return logits, states


def relayout_linears(model: nn.Module) -> int:
    """Store every ``nn.Linear`` (and router) weight outside the experts ``[in, out]`` in memory (the same
    ``[out, in]`` tensor to torch, as a transposed view), so ``F.linear``'s GEMM reads it
    untransposed. On MKL the transposed operand changes a row's bits below 16 rows on an AVX-512
    Xeon (4 on an AVX2 one) and costs more; untransposed, a row's bits stay the same from 2 rows up.
    A weight shared with another module (a tied lm_head) is left as it is. Values are unchanged;
    later writes (``copy_``) keep the layout. Returns how many weights moved."""
    users: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    moved = 0
    for name, module in model.named_modules():
        linear = isinstance(module, nn.Linear) or type(module).__name__.endswith(("Router", "Gate"))
        w = module._parameters.get("weight") if linear else None
        if w is None or ".experts" in name or users.get(id(w), 0) > 1 or w.dim() != 2 or w.t().is_contiguous():
            continue
        module.weight = nn.Parameter(w.detach().t().contiguous().t(), requires_grad=w.requires_grad)
        moved += 1
    return moved


def choose_tile(model: nn.Module) -> int:
    """The smallest row tile of :data:`TILES` that :func:`check_batch_invariant` passes on this
    machine (GEMM kernels change a row's bits below a row count that depends on the CPU and the
    weights' layout; an elementwise loop runs a tail scalar, so a narrow tensor's rows may change
    bits with the row count). Raises the largest tile's error if none passes."""
    for tile in TILES:
        try:
            check_batch_invariant(model, tile=tile)
        except RuntimeError:
            if tile == TILES[-1]:
                raise
            continue
        return tile
    raise AssertionError("unreachable")


def check_batch_invariant(model: nn.Module, *, tile: int, seed: int = 0) -> None:
    """Raise if a packed op's rows change bits with the number of rows in the call.

    Runs a seeded copy of every distinct row-wise module outside the experts (``nn.Linear``,
    norms, dense MLPs, routers; weights in the module's own memory layout), the rotary embedding
    and every distinct MoE block around its experts on random rows: once in one call of at least
    three ``tile``-row tiles and :data:`CHECK_ROWS` rows, and again one tile at a time in another
    order, and compares bitwise (what :func:`forward_packed` relies on).
    """
    g = torch.Generator().manual_seed(seed)
    seen: set[tuple] = set()
    for name, module in model.named_modules():
        width = _in_features(module) if _row_wise(module) else None
        key = (type(module).__name__, width, tuple(tuple(p.shape) for p in module.parameters()))
        if width is None or key in seen:
            continue
        seen.add(key)
        probe = _seeded_copy(module, g)
        dtype = next(probe.parameters()).dtype
        n = _tiles(tile)
        x = torch.randn(n * tile, width, generator=g).to(dtype)
        with torch.no_grad():
            whole = _flat(probe(x))
            parts = [_flat(probe(x[i * tile:(i + 1) * tile])) for i in _shuffled(n)]
        _compare(name, module, whole, _unshuffle(parts), tile)
    _check_rotary(model, g, tile)
    _check_moe_blocks(model, g, tile)


class _RowExperts(nn.Module):
    """Stands in for a MoE block's experts in :func:`_check_moe_blocks`: exact row-wise arithmetic
    (a product and a sum: the same bits in a vectorized and a scalar loop), so that what the check
    sees is the block's own code around the experts."""

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return hidden * top_k_weights[:, :1].to(hidden.dtype) + top_k_index[:, :1].to(hidden.dtype)


def _check_moe_blocks(model: nn.Module, g: torch.Generator, tile: int) -> None:
    """Every distinct MoE block's own code around its experts (router, shared experts, the gate of
    the shared experts and its sigmoid, the sums) on packed rows: the same bits in one call and tile
    by tile. An elementwise op over a narrow tensor (qwen3_next's ``[T, 1]`` shared-expert gate)
    runs its tail scalar below twice the vector width, which a row-wise module check cannot see."""
    seen: set[tuple] = set()
    for name, block in model.named_modules():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, nn.Module):
            continue
        key = (type(block).__name__, tuple((n, tuple(p.shape)) for n, p in block.named_parameters() if ".experts" not in f".{n}"))
        if key in seen:
            continue
        seen.add(key)
        probe = copy.deepcopy(block, memo={id(experts): _RowExperts()})  # the experts' weights are not copied
        with torch.no_grad():
            for p in probe.parameters():
                p.copy_((torch.randn(p.shape, generator=g) * 0.2).to(p.dtype))
        dtype = next(model.parameters()).dtype
        width = int(cast(Any, model).config.hidden_size)
        n = _tiles(tile)
        x = torch.randn(1, n * tile, width, generator=g).to(dtype)

        def run(rows: torch.Tensor, probe: nn.Module = probe) -> torch.Tensor:
            out = probe(rows)
            parts = out if isinstance(out, tuple) else (out,)
            n = rows.shape[1]
            return torch.cat([t.reshape(n, -1).to(torch.float64) for t in parts
                              if isinstance(t, torch.Tensor) and t.numel() % n == 0 and t.numel()], dim=1)

        with torch.no_grad():
            whole = run(x)
            parts = [run(x[:, i * tile:(i + 1) * tile]) for i in _shuffled(n)]
        _compare(name, block, whole, _unshuffle(parts), tile)


#: The fewest rows the batch check runs in one call: enough for every vectorized loop's main body
#: (PyTorch's take two vectors per iteration, 32 floats on AVX-512), so that a narrow tensor's
#: tail-versus-vector difference shows between the whole call and a tile.
CHECK_ROWS = 64


def _tiles(tile: int) -> int:
    """How many tiles the batch check runs in one call: at least 3, and at least CHECK_ROWS rows."""
    return max(3, -(-CHECK_ROWS // tile))


def _shuffled(n: int) -> list[int]:
    """The order the check runs ``n`` tiles one at a time in: the last first, then the rest."""
    return [n - 1, *range(n - 1)]


def _unshuffle(parts: list[torch.Tensor]) -> torch.Tensor:
    """The tiles run in :func:`_shuffled` order, back in row order."""
    return torch.cat([*parts[1:], parts[0]])


def _compare(name: str, module: nn.Module, whole: torch.Tensor, tiles: torch.Tensor, tile: int) -> None:
    if not torch.equal(whole, tiles):
        raise RuntimeError(
            f"{name} ({type(module).__name__}) is not batch-invariant on this machine at a {tile}-row tile: its rows "
            f"change bits with the number of rows in the call (max diff {float((whole.float() - tiles.float()).abs().max()):.3g}); "
            "a request's tokens would depend on the other requests in its step")


def _check_rotary(model: nn.Module, g: torch.Generator, tile: int) -> None:
    """The rotary embedding's cos/sin of packed positions: the same bits in one call and tile by tile."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        return
    dtype = next(model.parameters()).dtype
    n = _tiles(tile)
    x = torch.zeros(1, n * tile, 8, dtype=dtype)
    positions = torch.randint(0, 64, (1, n * tile), generator=g)
    with torch.no_grad():
        whole = torch.cat([t.reshape(n * tile, -1) for t in rotary(x, positions)], dim=1)
        parts = [torch.cat([t.reshape(tile, -1) for t in rotary(x[:, :tile], positions[:, i * tile:(i + 1) * tile])], dim=1)
                 for i in range(n)]
    _compare("model.rotary_emb", rotary, whole, torch.cat(parts), tile)


def _row_wise(module: nn.Module) -> bool:
    name = type(module).__name__
    if any("experts" in n for n, _ in module.named_modules()) or not any(True for _ in module.parameters()):
        return False
    return isinstance(module, nn.Linear) or name.endswith(("RMSNorm", "LayerNorm", "MLP", "Router"))


def _in_features(module: nn.Module) -> int | None:
    if isinstance(module, nn.Linear):
        return int(module.in_features)
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() in (1, 2):
        return int(weight.shape[-1])
    for child in module.modules():
        if isinstance(child, nn.Linear):
            return int(child.in_features)
    return None


def _seeded_copy(module: nn.Module, g: torch.Generator) -> nn.Module:
    """A copy of ``module`` with seeded weights (a joining rank's weights are not there yet); a wide
    linear (an lm_head) keeps its input width and at most 1024 outputs (a row's bits follow the input width)."""
    if isinstance(module, nn.Linear) and module.out_features > 1024:
        wide = nn.Linear(module.in_features, 1024, bias=module.bias is not None, dtype=module.weight.dtype)
        if module.weight.t().is_contiguous():  # relaid out (relayout_linears): probe the same layout
            wide.weight = nn.Parameter(wide.weight.detach().t().contiguous().t())
        probe: nn.Module = wide
    else:
        probe = copy.deepcopy(module)  # clones keep each tensor's strides
    with torch.no_grad():
        for p in probe.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * 0.2).to(p.dtype))
    return probe


def _flat(out: Any) -> torch.Tensor:
    """Every tensor a module returned, as float64 rows side by side (routers return several)."""
    parts = out if isinstance(out, tuple) else (out,)
    return torch.cat([t.reshape(t.shape[0], -1).to(torch.float64) for t in parts if isinstance(t, torch.Tensor)], dim=1)
