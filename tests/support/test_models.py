"""Models: output shapes, parameter counts derived from the architecture, name lookup."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from manualdp.support.models import MODELS, get_model, lenet, mlp, resnet18


def conv(c_in, c_out, k):
    return c_out * c_in * k * k + c_out  # weight + bias


def linear(n_in, n_out):
    return n_out * n_in + n_out


def bn(c):
    return 2 * c  # weight and bias; running statistics are buffers, not parameters


def n_params(net):
    return sum(p.numel() for p in net.parameters())


def residual(c_in, c_out, projection):
    shortcut = conv(c_in, c_out, 1) if projection else 0
    return conv(c_in, c_out, 3) + bn(c_out) + conv(c_out, c_out, 3) + bn(c_out) + shortcut


def test_lenet_parameter_count_and_shape():
    net = lenet()
    # the flattened size follows from 28 -conv3-> 26 -pool-> 13 -conv5-> 9 -pool-> 4
    side = ((28 - 3 + 1) // 2 - 5 + 1) // 2
    expected = conv(1, 20, 3) + conv(20, 50, 5) + linear(50 * side * side, 128) + linear(128, 10)
    assert n_params(net) == expected
    assert net(torch.zeros(3, 1, 28, 28)).shape == (3, 10)


@pytest.mark.parametrize("num_classes,in_channels", [(10, 1), (7, 3)])
def test_resnet18_parameter_count(num_classes, in_channels):
    net = resnet18(num_classes, in_channels)
    expected = conv(in_channels, 64, 3) + bn(64)
    c = 64
    for i, width in enumerate([64, 128, 256, 512]):
        expected += residual(c, width, projection=i > 0) + residual(width, width, projection=False)
        c = width
    expected += linear(512, num_classes)
    assert n_params(net) == expected


def test_resnet18_shape_and_buffers():
    net = resnet18(num_classes=10, in_channels=1).eval()
    assert net(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert net(torch.zeros(1, 1, 8, 8)).shape == (1, 10)  # global average pooling: any size works
    # 1 stem BatchNorm + 2 per block * 8 blocks, each with running_mean/var/num_batches_tracked
    assert len(list(net.buffers())) == 3 * (1 + 2 * 8)


@settings(deadline=None, max_examples=10)
@given(st.integers(1, 50), st.integers(1, 40), st.integers(1, 12), st.integers(1, 4))
def test_mlp_parameter_count_and_shape(in_features, hidden, num_classes, batch):
    net = mlp(in_features, hidden, num_classes)
    assert n_params(net) == linear(in_features, hidden) + linear(hidden, num_classes)
    assert net(torch.zeros(batch, in_features)).shape == (batch, num_classes)


def test_mlp_flattens_images():
    assert mlp()(torch.zeros(5, 1, 28, 28)).shape == (5, 10)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_get_model_builds_each(name):
    net = get_model(name)
    assert net(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert isinstance(get_model(name, num_classes=4)(torch.zeros(2, 1, 28, 28)), torch.Tensor)


def test_get_model_errors():
    with pytest.raises(ValueError, match="unknown model 'vgg'.*lenet"):
        get_model("vgg")
    with pytest.raises(TypeError, match="name must be a str"):
        get_model(None)
    with pytest.raises(TypeError, match="'mlp'.*hidden_size"):
        get_model("mlp", hidden_size=3)


@pytest.mark.parametrize("build,kwargs,arg", [
    (lenet, {"num_classes": 0}, "num_classes"),
    (resnet18, {"in_channels": 1.5}, "in_channels"),
    (resnet18, {"num_classes": True}, "num_classes"),
    (mlp, {"hidden": -1}, "hidden"),
    (mlp, {"in_features": "784"}, "in_features"),
])
def test_bad_arguments(build, kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        build(**kwargs)
