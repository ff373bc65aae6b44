"""Partition of a Keras model into front-to-back layer modules.

Egeria freezes *modules* (a stem, a residual block, a transformer block), not
single layers. A module boundary is a tensor that every path from the inputs
to the outputs passes through: a cut point of the layer graph.

For Functional and Sequential models the partition is automatic:

1. order the layer calls topologically and find every position where exactly
   one tensor is live (the cut points); the stretches between cut points are
   the *atoms* (a residual block is one atom, because its skip connection
   keeps two tensors live inside it; so is a squeeze-excite branch);
2. adjacent atoms whose boundary layers are named as one block join
   (`block_1_expand`/`block_1_depthwise`/`block_1_project` of MobileNetV2,
   `block2a_*` of EfficientNet, `conv2_block1_preact_*` and the residual
   atom after it in ResNet50V2); Keras's default names (`dense_3`) never
   join anything;
3. a stretch holding trainable weights of a computing layer (Dense, Conv,
   attention, embedding...) starts a module; stretches without any
   (activations, pooling, dropout, `Rescaling`, a `Normalization`
   preprocessing layer, a layer the user froze) and normalization-only
   stretches join the module in front of them (at the very front: the
   module behind), so every module has something to freeze;
4. an attention stretch and the residual feed-forward stretch after it (a
   Transformer block written inline with stock layers) form one module;
5. a module with under 0.1% of the model's forward FLOPs (a token or
   position embedding: a table lookup) joins the module behind it. Frozen
   alone it would save nothing, and freezing a Transformer's embeddings
   early cost accuracy (docs/benchmarks.md, charlm-long).

Subclassed models have no inspectable graph: give the groups yourself as
lists of layer names (`modules=[["stem_conv", "stem_bn"], ["block1"], ...]`).
The same argument overrides the automatic partition of any model.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import keras

from tf_hwopt import _internals

_NORMALIZATION = (
    keras.layers.BatchNormalization,
    keras.layers.LayerNormalization,
    keras.layers.GroupNormalization,
    keras.layers.UnitNormalization,
)
_ATTENTION = (
    keras.layers.MultiHeadAttention,
    keras.layers.GroupQueryAttention,
    keras.layers.Attention,
    keras.layers.AdditiveAttention,
)


# Below this share of the forward FLOPs, a module is not worth freezing on its own (rule 5 above).
_NEGLIGIBLE_FLOPS_SHARE = 1e-3


@dataclasses.dataclass(frozen=True)
class Module:
    """A group of layers frozen together.

    Attributes:
        index: position from the front (0 = first module).
        name: a readable name (the first and last layer names).
        layers: the layers of the module, front to back.
        output_layer: the layer whose output is the module's boundary tensor;
            plasticity is measured on it.
        params: number of weights (trainable or not) in the module.
        flops: forward FLOPs per example, or `None` when unknown.
    """

    index: int
    name: str
    layers: tuple
    output_layer: object
    params: int
    flops: float | None = None

    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]


def graph_kind(model) -> str:
    """`"sequential"`, `"functional"` or `"subclassed"`."""
    if isinstance(model, keras.Sequential):
        return "sequential"
    if _internals.is_functional(model):
        return "functional"
    return "subclassed"


def _functional_layer_order(model) -> list:
    """Layers (no InputLayer) in topological order of their first call."""
    seen, order = set(), []
    for node in _internals.ordered_nodes(model):
        op = node.operation
        if isinstance(op, keras.layers.InputLayer) or id(op) in seen:
            continue
        seen.add(id(op))
        order.append(op)
    return order


def _functional_atoms(model) -> list[list]:
    """Splits the layer calls at every position where exactly one tensor is live."""
    nodes = [n for n in _internals.ordered_nodes(model) if not isinstance(n.operation, keras.layers.InputLayer)]
    # For each tensor: the position of the call producing it (-1: a model
    # input) and of the last call consuming it (len(nodes): a model output).
    produced: dict[int, int] = {}
    last_use: dict[int, int] = {}
    for i, node in enumerate(nodes):
        for tensor in keras.tree.flatten(node.outputs):
            produced[id(tensor)] = i
        for tensor in keras.tree.flatten(node.input_tensors):
            last_use[id(tensor)] = i
    for tensor in keras.tree.flatten(model.outputs):
        last_use[id(tensor)] = len(nodes)
    # live[c]: tensors live across the cut after call c, i.e. start <= c < end.
    live = [0] * (len(nodes) + 1)
    for tensor_id, end in last_use.items():
        start = produced.get(tensor_id, -1)
        for c in range(max(start, 0), end):
            live[c] += 1
    atoms, current = [], []
    for i, node in enumerate(nodes):
        current.append(node.operation)
        if live[i] == 1 or i == len(nodes) - 1:
            atoms.append(_dedupe(current))
            current = []
    return atoms


def _dedupe(layers):
    seen, out = set(), []
    for layer in layers:
        if id(layer) not in seen:
            seen.add(id(layer))
            out.append(layer)
    return out


def _is_heavy(layer) -> bool:
    """Whether a layer has trainable weights of its own computing (not normalization)."""
    return bool(layer.trainable_weights) and not isinstance(layer, _NORMALIZATION)


def _explicit_name_tokens(layer) -> list[str] | None:
    """The `_`-separated tokens of a name the model's author chose, or None.

    Keras's default names (`dense_3`, `layer_normalization_1`) carry no block
    structure and give None.
    """
    if _internals.auto_layer_name_pattern(layer).fullmatch(layer.name):
        return None
    return layer.name.split("_")


def _same_named_block(a, b) -> bool:
    """Whether two adjacent layers are named as parts of one block.

    `block_1_expand` and `block_1_depthwise`, `block2a_dwconv` and
    `block2a_se_squeeze`, `conv2_block1_preact_relu` and `conv2_block1_0_conv`
    are; `block_1_project` and `block_2_expand`, or any Keras default name,
    are not. The names must share a leading run of tokens that numbers the
    block (holds a digit) or has two or more tokens, and the first tokens
    after it must not both be numbers of their own (`_1` vs `_2`).
    """
    ta, tb = _explicit_name_tokens(a), _explicit_name_tokens(b)
    if not ta or not tb:
        return False
    k = 0
    while k < min(len(ta), len(tb)) and ta[k] == tb[k]:
        k += 1
    if k == 0:
        return False
    common = ta[:k]
    if k < 2 and not any(ch.isdigit() for ch in common[0]):
        return False
    x = ta[k] if k < len(ta) else None
    y = tb[k] if k < len(tb) else None
    if x is None or y is None:
        other = x if y is None else y
        return other is not None and not other.isdigit()
    return not (any(ch.isdigit() for ch in x) and any(ch.isdigit() for ch in y))


def _merge_named_blocks(atoms: list[list]) -> list[list]:
    """Joins adjacent atoms whose boundary layers are named as one block."""
    blocks: list[list] = []
    for atom in atoms:
        if blocks and _same_named_block(blocks[-1][-1], atom[0]):
            blocks[-1].extend(atom)
        else:
            blocks.append(list(atom))
    return blocks


def _is_attention_block(group) -> bool:
    return any(isinstance(layer, _ATTENTION) for layer in group)


def _is_residual_feed_forward(group) -> bool:
    return (
        not _is_attention_block(group)
        and any(isinstance(layer, keras.layers.Add) or _internals.is_add_operation(layer) for layer in group)
        and any(_is_heavy(layer) for layer in group)
    )


def _merge_transformer_blocks(groups: list[list]) -> list[list]:
    """Joins each attention sub-block with the residual feed-forward after it.

    A Transformer block written inline with stock layers cuts into two
    stretches (attention, then feed-forward, each closed by its residual
    add); they form one module. The last group (the head) is never joined.
    """
    merged: list[list] = []
    i = 0
    while i < len(groups):
        group = list(groups[i])
        if (
            _is_attention_block(group)
            and i + 2 < len(groups)
            and _is_residual_feed_forward(groups[i + 1])
        ):
            group.extend(groups[i + 1])
            i += 1
        merged.append(group)
        i += 1
    return merged


def _group_atoms(atoms: list[list]) -> list[list]:
    """Modules from atoms: blocks by name, weightless stretches joined, Transformer blocks joined."""
    groups: list[list] = []
    pending: list = []
    for atom in _merge_named_blocks(atoms):
        if any(_is_heavy(layer) for layer in atom):
            groups.append(pending + atom)
            pending = []
        elif groups:
            groups[-1].extend(atom)
        else:
            pending.extend(atom)
    if pending:
        if groups:
            groups[-1].extend(pending)
        else:
            groups.append(pending)
    return _merge_transformer_blocks(groups)


def _all_layers_by_name(model) -> dict:
    layers = {}
    for layer in _internals.all_layers(model):
        layers.setdefault(layer.name, layer)
    return layers


def _explicit_groups(model, modules: Sequence[Sequence[str]]) -> list[list]:
    if isinstance(modules, (str, bytes)) or not isinstance(modules, Sequence):
        raise ValueError(
            "`modules` must be a list of lists of layer names, front to back. "
            f"Received: modules={modules!r}"
        )
    by_name = _all_layers_by_name(model)
    seen: dict[str, int] = {}
    groups = []
    for i, group in enumerate(modules):
        if isinstance(group, (str, bytes)) or not isinstance(group, Sequence) or not group:
            raise ValueError(
                f"`modules[{i}]` must be a non-empty list of layer names. Received: {group!r}"
            )
        layers = []
        for name in group:
            if name not in by_name:
                raise ValueError(
                    f"`modules[{i}]` names layer {name!r}, which model {model.name!r} "
                    f"does not have. Known layers: {sorted(by_name)}"
                )
            if name in seen:
                raise ValueError(
                    f"`modules` lists layer {name!r} in both modules[{seen[name]}] and "
                    f"modules[{i}]; each layer must belong to at most one module."
                )
            seen[name] = i
            layers.append(by_name[name])
        groups.append(layers)
    kind = graph_kind(model)
    if kind != "subclassed":
        order = (
            list(model.layers) if kind == "sequential" else _functional_layer_order(model)
        )
        rank = {id(layer): r for r, layer in enumerate(order)}
        for i, group in enumerate(groups):
            missing = [layer.name for layer in group if id(layer) not in rank]
            if missing:
                raise ValueError(
                    f"`modules[{i}]` names nested layers {missing}; for a "
                    f"{kind} model name its top-level layers."
                )
            groups[i] = sorted(group, key=lambda layer: rank[id(layer)])
        for i in range(1, len(groups)):
            prev_last = rank[id(groups[i - 1][-1])]
            first = rank[id(groups[i][0])]
            if first < prev_last:
                raise ValueError(
                    f"`modules` are out of order: modules[{i}] starts at layer "
                    f"{groups[i][0].name!r}, which comes before layer "
                    f"{groups[i - 1][-1].name!r} of modules[{i - 1}]. List modules "
                    "front to back, each layer after those of the module before it."
                )
    return groups


def _join_negligible(groups: list[list], flops: dict) -> list[list]:
    """Groups with under `_NEGLIGIBLE_FLOPS_SHARE` of the FLOPs joined to the group behind them.

    The last group (the head) never moves; the groups are kept as they are
    when joining would leave fewer than 2.
    """
    sizes = [sum(flops[layer.name] for layer in group) for group in groups]
    total = sum(sizes)
    if not total:
        return groups
    joined, pending = [], []
    for i, (group, size) in enumerate(zip(groups, sizes)):
        if size < _NEGLIGIBLE_FLOPS_SHARE * total and i < len(groups) - 1:
            pending.extend(group)
            continue
        joined.append(pending + group)
        pending = []
    return joined if len(joined) >= 2 else groups


def partition_modules(
    model: keras.Model,
    modules: Sequence[Sequence[str]] | None = None,
    *,
    sample_input=None,
    count_flops: bool = True,
) -> list[Module]:
    """Splits `model` into front-to-back modules.

    Args:
        model: a built Keras model.
        modules: optional explicit partition, a list of lists of layer names
            ordered front to back. Required for subclassed models.
        sample_input: one batch of inputs, used to count FLOPs of subclassed
            models.
        count_flops: whether to count forward FLOPs per module (without
            them, modules with negligible FLOPs are not joined).

    Returns:
        The list of `Module`s, front to back. The last one is the head.

    Raises:
        ValueError: unknown, overlapping or out-of-order layer names, a
            subclassed model without `modules`, or fewer than 2 modules.

    Example:
    >>> mods = partition_modules(model)
    >>> [m.layer_names for m in mods]
    """
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built. Build it (call it on a batch, or "
            "give it an Input) before partitioning it into modules."
        )
    kind = graph_kind(model)
    if modules is not None:
        groups = _explicit_groups(model, modules)
    elif kind == "sequential":
        groups = _group_atoms([[layer] for layer in model.layers])
    elif kind == "functional":
        groups = _group_atoms(_functional_atoms(model))
    else:
        raise ValueError(
            f"Model {model.name!r} is a subclassed model, whose layer graph "
            "cannot be inspected. Pass `modules`, a list of lists of its layer "
            "names ordered front to back, e.g. modules=[['conv1', 'bn1'], "
            "['block1'], ['head']]."
        )
    if len(groups) < 2:
        raise ValueError(
            f"Model {model.name!r} splits into {len(groups)} module(s); Egeria needs "
            "at least 2 (one that can freeze, and the head, which never freezes). "
            "Pass `modules` to choose the partition."
        )
    flops = None
    if count_flops:
        names = [layer.name for group in groups for layer in group if isinstance(layer, keras.layers.Layer)]
        try:
            flops = forward_flops_by_layer(model, names, sample_input=sample_input)
            # Operations that are not layers (`h + a`) are counted as free.
            flops.update({op.name: 0.0 for group in groups for op in group if not isinstance(op, keras.layers.Layer)})
        except Exception:  # noqa: BLE001 - FLOPs are informative only
            flops = None
    if modules is None and flops is not None:
        groups = _join_negligible(groups, flops)
    result = []
    for i, group in enumerate(groups):
        name = group[0].name if len(group) == 1 else f"{group[0].name}..{group[-1].name}"
        # A Functional graph also holds operations that are not layers
        # (`x + y` on Keras tensors is a `keras.ops` Add): they cut the graph
        # like a layer, but hold no weights and cannot be made non-trainable.
        layers = tuple(layer for layer in group if isinstance(layer, keras.layers.Layer))
        result.append(
            Module(
                index=i,
                name=name,
                layers=layers,
                output_layer=group[-1],
                params=int(sum(int(keras.ops.size(w)) for layer in layers for w in layer.weights)),
                flops=None if flops is None else float(sum(flops[layer.name] for layer in group)),
            )
        )
    return result


def describe_modules(
    model: keras.Model,
    modules: Sequence[Sequence[str]] | None = None,
    *,
    sample_input=None,
    print_fn=print,
) -> list[Module]:
    """Prints each module's layers, parameter count and share of forward FLOPs.

    Example:
    >>> tf_hwopt.egeria.describe_modules(model)
    module  params  FLOPs%  layers
         0     544    12.1  conv1d, batch_normalization, re_lu
    ...
    """
    mods = partition_modules(model, modules, sample_input=sample_input)
    total = sum(m.flops or 0.0 for m in mods)
    print_fn(f"{'module':>6}  {'params':>9}  {'FLOPs%':>6}  layers")
    for m in mods:
        share = f"{100.0 * m.flops / total:6.1f}" if total and m.flops is not None else "   n/a"
        head = "  (head, never frozen)" if m.index == len(mods) - 1 else ""
        print_fn(f"{m.index:>6}  {m.params:>9}  {share}  {', '.join(m.layer_names)}{head}")
    return mods


from tf_hwopt.flops import forward_flops_by_layer
