"""The freezing engine: the one place that freezes and re-opens modules.

Every freezing policy (Egeria's plasticity policy, a fixed schedule, a
gradient-norm rule) decides *which* modules to freeze; this engine does it.

Freezing a module sets its layers' `trainable` to False and rebuilds the
model's train function. The rebuild is not optional: Keras 3 traces the list
of trainable variables into the compiled train step, so flipping `trainable`
alone leaves the "frozen" weights updating. After the rebuild the frozen
variables get no gradient, no optimizer update and, for BatchNormalization,
no statistics update (a non-trainable BatchNormalization runs in inference
mode), so they stay bit-identical. The optimizer's slots (momentum, Adam
moments) are keyed by variable, so those of the other variables are
untouched by the rebuild.

Layers the user had already made non-trainable are never touched, and
re-opening a module gives every layer inside it (the layers of a nested
base model included) the `trainable` it had before, not `True` throughout:
Keras's setter sets a layer's sublayers alike. While a module is frozen, its
layers' `get_config` still report the user's `trainable`, so that a model
saved meanwhile (`keras.callbacks.ModelCheckpoint`, `model.save`) loads as
the user built it, not with our transient freezes baked in.
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

from tf_hwopt import _internals
from tf_hwopt.freezing.modules import Module

# Marks a layer frozen by tf_hwopt, so that a later engine (after an
# interrupted fit) knows the layer was trainable before.
_MARK = "_tf_hwopt_frozen"

# The `trainable` of each layer inside a frozen layer before the freeze, by
# frozen layer (not kept on the layer: Keras would track a list of layers
# assigned to it as its sublayers).
_INNER_TRAINABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _freeze_layer(layer) -> None:
    """`layer.trainable = False`, remembering what its sublayers were; its and their configs unchanged."""
    inner = [(sub, sub.trainable) for sub in _internals.all_layers(layer)]
    layer.trainable = False
    setattr(layer, _MARK, True)
    _INNER_TRAINABLE[layer] = inner
    for sub, trainable in [(layer, True)] + inner:
        if trainable:
            _report_trainable(sub)


def _unfreeze_layer(layer) -> None:
    """Gives `layer` and its sublayers back the `trainable` they had before `_freeze_layer`."""
    layer.trainable = True
    for sub, trainable in [(layer, True)] + _INNER_TRAINABLE.pop(layer, []):
        # Outermost first: each setter also sets the layers inside, which come after.
        sub.trainable = trainable
        if getattr(sub.__dict__.get("get_config"), _MARK, False):
            del sub.__dict__["get_config"]
    setattr(layer, _MARK, False)


def _report_trainable(layer) -> None:
    """Shadows `layer.get_config` so that saving reports it trainable (as the user left it)."""
    cls_get_config = type(layer).get_config

    def get_config():
        config = cls_get_config(layer)
        if isinstance(config, dict) and "trainable" in config:
            config["trainable"] = True
        return config

    setattr(get_config, _MARK, True)  # ours to remove at the unfreeze, and no one else's
    layer.get_config = get_config


class FreezingEngine:
    """Freezes and re-opens modules of a compiled Keras model.

    Args:
        model: the compiled Keras model.
        modules: its modules, front to back.

    Attributes:
        listeners: callables `fn(kind, indices)` told after each change, with
            `kind` in `{"freeze", "unfreeze"}` (e.g. an output cache).

    Example:
    >>> engine = FreezingEngine(model, partition_modules(model))
    >>> engine.freeze([0])        # module 0 stops training from the next step
    >>> engine.num_frozen
    1
    """

    def __init__(self, model, modules: Sequence[Module]):
        self.model = model
        self.modules = list(modules)
        self.frozen = [False] * len(self.modules)
        self.listeners: list[Callable[[str, tuple], None]] = []
        self.rebuilds = 0
        # Whether each layer was trainable before tf_hwopt touched it.
        self._was_trainable = {
            id(layer): bool(layer.trainable or getattr(layer, _MARK, False))
            for module in self.modules
            for layer in module.layers
        }
        # A fit that ended in an exception (no `on_train_end`) left its
        # freezes in place: this engine starts from the user's model.
        left = [layer for module in self.modules for layer in module.layers if getattr(layer, _MARK, False)]
        for layer in left:
            _unfreeze_layer(layer)
        if left:
            self.rebuild()

    @property
    def num_frozen(self) -> int:
        return sum(self.frozen)

    @property
    def frozen_prefix(self) -> int:
        """Number of consecutive frozen modules from the front."""
        k = 0
        while k < len(self.frozen) and self.frozen[k]:
            k += 1
        return k

    def _set(self, indices: Sequence[int], frozen: bool) -> tuple:
        changed = []
        for i in indices:
            if i == len(self.modules) - 1 and frozen:
                raise ValueError("The head (last module) is never frozen.")
            if self.frozen[i] == frozen:
                continue
            for layer in self.modules[i].layers:
                if not self._was_trainable[id(layer)]:
                    continue
                if frozen:
                    _freeze_layer(layer)
                else:
                    _unfreeze_layer(layer)
            self.frozen[i] = frozen
            changed.append(i)
        if changed:
            self.rebuild()
            for listener in self.listeners:
                listener("freeze" if frozen else "unfreeze", tuple(changed))
        return tuple(changed)

    def freeze(self, indices: Sequence[int]) -> tuple:
        """Freezes the given modules; returns those that changed."""
        return self._set(indices, True)

    def unfreeze(self, indices: Sequence[int]) -> tuple:
        """Re-opens the given modules; returns those that changed."""
        return self._set(indices, False)

    def freeze_prefix(self, k: int) -> None:
        """Makes exactly modules `0..k-1` frozen."""
        self.unfreeze([i for i in range(k, len(self.modules)) if self.frozen[i]])
        self.freeze([i for i in range(k) if not self.frozen[i]])

    def rebuild(self) -> None:
        """Re-creates the train function so that `trainable` changes take effect.

        The replaced function is kept as long as the model
        (`_internals.retire_train_function`: releasing it stalled training).
        """
        _internals.retire_train_function(self.model)
        self.model.make_train_function(force=True)
        self.rebuilds += 1

    def restore(self) -> None:
        """Re-opens every module this engine froze (end of training)."""
        self.unfreeze([i for i, f in enumerate(self.frozen) if f])

    def frozen_flops_fraction(self) -> float | None:
        """Share of the model's forward FLOPs in frozen modules.

        Backward cost per layer is about twice its forward cost, so this is
        also the share of backward FLOPs a freeze saves.
        """
        if any(m.flops is None for m in self.modules):
            return None
        total = sum(m.flops for m in self.modules)
        if total <= 0:
            return None
        return sum(m.flops for m, f in zip(self.modules, self.frozen) if f) / total
