import warnings

import keras
import numpy as np
import pytest

from tf_hwopt.freezing import describe_modules, partition_modules
from tf_hwopt.models import char_transformer, resnet1d
from conftest import SmallSubclassed


def test_resnet_blocks_are_modules():
    model = resnet1d(widths=(8, 8, 16), strides=(1, 2, 1), stem_width=8)
    mods = partition_modules(model)
    assert [m.layer_names[0] for m in mods] == ["stem_conv", "block1_conv1", "block2_conv1", "block3_conv1", "head"]
    # Each residual block is one module (the skip keeps two tensors live inside it).
    assert set(mods[2].layer_names) >= {"block2_conv1", "block2_proj", "block2_add", "block2_out"}
    # Weightless and normalization layers join the module in front of them.
    assert mods[0].layer_names == ["stem_conv", "stem_bn", "stem_relu"]
    assert mods[3].layer_names[-1] == "pool"
    assert mods[-1].layer_names == ["head"]
    # Every layer is in exactly one module.
    names = [n for m in mods for n in m.layer_names]
    assert sorted(names) == sorted(layer.name for layer in model.layers[1:])
    assert sum(m.params for m in mods) == model.count_params()
    shares = np.array([m.flops for m in mods]) / sum(m.flops for m in mods)
    assert shares[1] > 0.1 and shares[-1] < 0.01


def test_a_dict_input_model_is_profiled_with_its_own_input_structure():
    # Called with a list, a dict-input model warns "The structure of `inputs`
    # doesn't match" (Keras 3.15, inputs of equal shapes) in the user's fit.
    a, b = keras.Input((32, 1), name="a"), keras.Input((32, 1), name="b")
    h = keras.layers.Concatenate(name="join")([a, b])
    h = keras.layers.Conv1D(8, 3, padding="same", name="conv")(h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(3, name="head")(h))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mods = partition_modules(model)
    assert not [w for w in caught if "structure" in str(w.message).lower()]
    assert mods[0].flops >= 2 * 32 * 3 * 2 * 8  # the convolution was counted


def test_flops_of_a_dense_stack_are_exact():
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, name="a"), keras.layers.ReLU(), keras.layers.Dense(4, name="b")]
    )
    mods = partition_modules(model)
    assert [m.layer_names for m in mods] == [["a", "re_lu"], ["b"]] or mods[0].layer_names[0] == "a"
    # Dense: 2*in*out multiply-adds + out bias adds.
    assert mods[1].flops == 2 * 16 * 4 + 4
    assert mods[0].flops >= 2 * 8 * 16 + 16


def _transformer_like():
    inputs = keras.Input((12, 16))
    x = keras.layers.Dense(16, name="embed")(inputs)
    for i in range(2):
        h = keras.layers.LayerNormalization(name=f"ln{i}")(x)
        h = keras.layers.MultiHeadAttention(2, 8, name=f"attn{i}")(h, h)
        x = keras.layers.Add(name=f"res{i}")([x, h])
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(x))


def test_transformer_blocks_are_modules():
    mods = partition_modules(_transformer_like())
    assert [m.layer_names for m in mods] == [
        ["embed"],
        ["ln0", "attn0", "res0"],
        ["ln1", "attn1", "res1", "pool"],
        ["out"],
    ]


def test_embeddings_join_the_first_block_they_feed():
    # An embedding lookup has next to no FLOPs: frozen alone it saves nothing.
    mods = partition_modules(char_transformer(seq_len=16, num_blocks=2, d_model=16))
    assert mods[0].layer_names[:2] == ["embed", "position"]
    assert mods[0].output_layer.name.startswith("block1_")
    assert [m.layer_names[0] for m in mods[1:]] == ["block2_ln1", "head"]
    shares = np.array([m.flops for m in mods]) / sum(m.flops for m in mods)
    assert shares[:-1].min() > 0.001
    # An explicit partition is taken as given.
    names = [m.layer_names for m in mods]
    explicit = partition_modules(char_transformer(seq_len=16, num_blocks=2, d_model=16),
                                 [names[0][:1], names[0][1:]] + names[1:])
    assert explicit[0].layer_names == ["embed"]


def test_negligible_modules_never_leave_fewer_than_two():
    from tf_hwopt.freezing.modules import _join_negligible

    a, b, c = (keras.layers.Dense(1, name=n) for n in "abc")
    flops = {"a": 0.0, "b": 100.0, "c": 0.0}
    assert _join_negligible([[a], [b], [c]], flops) == [[a, b], [c]]  # the head stays, however small
    assert _join_negligible([[a], [c]], {"a": 0.0, "c": 5.0}) == [[a], [c]]


def test_explicit_modules_override():
    model = resnet1d(widths=(8, 8), strides=(1, 1), stem_width=8)
    names = [layer.name for layer in model.layers[1:]]
    first = names[: names.index("block1_out") + 1]
    mods = partition_modules(model, [first, names[len(first):]])
    assert len(mods) == 2 and mods[0].output_layer.name == "block1_out"


def test_subclassed_model_needs_groups():
    model = SmallSubclassed()
    x = np.zeros((2, 10, 1), np.float32)
    model(x)
    with pytest.raises(ValueError, match="subclassed"):
        partition_modules(model)
    mods = partition_modules(model, [["conv"], ["flat", "out"]], sample_input=x)
    assert [m.output_layer.name for m in mods] == ["conv", "out"]
    assert mods[0].flops > 0


@pytest.mark.parametrize(
    "modules,match",
    [
        ([["stem_conv"], ["nope"]], "does not have"),
        ([["stem_conv", "stem_bn"], ["stem_bn", "head"]], "both"),
        ([["head"], ["stem_conv"]], "out of order"),
        ([["stem_conv", "stem_bn", "stem_relu", "block1_conv1"]], "at least 2"),
        ("stem_conv", "list of lists"),
        ([[], ["head"]], "non-empty"),
    ],
)
def test_bad_explicit_modules(modules, match):
    model = resnet1d(widths=(8,), strides=(1,), stem_width=8)
    with pytest.raises(ValueError, match=match):
        partition_modules(model, modules)


def test_single_module_model_is_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="at least 2"):
        partition_modules(model)


def test_describe_prints_each_module():
    lines = []
    model = resnet1d(widths=(8,), strides=(1,), stem_width=8)
    mods = describe_modules(model, print_fn=lines.append)
    assert len(lines) == len(mods) + 1
    assert "head, never frozen" in lines[-1]
    assert "stem_conv" in lines[1] and str(mods[1].params) in lines[2]
