"""The output sizes of the layers still to run in a chain of layers, from the sizes of the layers alone.

For a model made only of `nn.Sequential` containers, the forward pass is exactly its leaf modules in
order: from the failing layer's input shape, each common layer's output shape follows from its own
settings (a convolution's channels, stride and padding, a pooling's window, a linear layer's width).
The retry adds up what the layers after the failing one will allocate, instead of extrapolating what the
layers before took (a CNN's first layers, at full resolution, are its largest). Any layer whose output
shape is not known here stops the walk (None): the retry then extrapolates.
"""
from __future__ import annotations

import math

_SAME_SHAPE = {
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LayerNorm", "GroupNorm", "InstanceNorm1d",
    "InstanceNorm2d", "InstanceNorm3d", "LocalResponseNorm", "RMSNorm",
    "ReLU", "ReLU6", "LeakyReLU", "PReLU", "RReLU", "ELU", "SELU", "CELU", "GELU", "SiLU", "Mish", "Sigmoid",
    "Tanh", "Hardtanh", "Hardswish", "Hardsigmoid", "Softplus", "Softsign", "Tanhshrink", "LogSigmoid",
    "Softmax", "LogSoftmax", "Softmax2d",
}
_DROPOUT = {"Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout"}
_VIEWS = {"Identity", "Flatten", "Unflatten"}          # no new memory


def sequential_only(root, torch) -> bool:
    """Whether every container in the model runs its children in order and nothing else."""
    forward = torch.nn.Sequential.forward
    for module in root.modules():
        if next(iter(module.children()), None) is not None and type(module).forward is not forward:
            return False
    return True


def rest_bytes(leaves, index: int, shape: tuple, element_size: int, torch) -> int | None:
    """Bytes the leaves after `leaves[index]` will allocate, the failing leaf's input shape given; None
    when a layer's output shape is not known here."""
    total = 0
    for i, leaf in enumerate(leaves[index:]):
        out, allocates = output_shape(leaf, shape, torch)
        if out is None:
            return None
        if i > 0 and allocates:
            total += math.prod(out) * element_size
        shape = out
    return total


def output_shape(module, shape: tuple, torch) -> tuple[tuple | None, bool]:
    """(the output shape, whether it is new memory) of a common layer for an input of `shape`."""
    name = type(module).__name__
    nn = torch.nn
    if name in _SAME_SHAPE:
        return shape, not getattr(module, "inplace", False)
    if name in _DROPOUT:         # the identity in eval mode
        return shape, module.training and module.p > 0 and not module.inplace
    if name in _VIEWS:
        if name == "Flatten":
            start, end = module.start_dim % len(shape), module.end_dim % len(shape)
            return shape[:start] + (math.prod(shape[start:end + 1]),) + shape[end + 1:], False
        if name == "Unflatten":
            dim = module.dim % len(shape) if isinstance(module.dim, int) else None
            if dim is None:
                return None, False
            return shape[:dim] + tuple(module.unflattened_size) + shape[dim + 1:], False
        return shape, False
    if isinstance(module, nn.Linear):
        return shape[:-1] + (module.out_features,), True
    if isinstance(module, nn.Embedding):
        return shape + (module.embedding_dim,), True
    if isinstance(module, nn.modules.conv._ConvNd) and not module.transposed:
        dims = len(module.kernel_size)
        if len(shape) < dims + 1:
            return None, False
        spatial = shape[-dims:]
        if module.padding == "same":
            size = spatial
        else:
            padding = (0,) * dims if module.padding == "valid" else module.padding
            size = tuple((n + 2 * p - d * (k - 1) - 1) // s + 1 for n, p, d, k, s in
                         zip(spatial, padding, module.dilation, module.kernel_size, module.stride))
        return shape[:-dims - 1] + (module.out_channels,) + size, True
    if isinstance(module, (nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd)):
        dims = int(name[-2]) if name[-2].isdigit() else None
        if dims is None or len(shape) < dims:
            return None, False
        kernel, stride, padding = (_tuple(module.kernel_size, dims), _tuple(module.stride or module.kernel_size, dims),
                                   _tuple(module.padding, dims))
        dilation = _tuple(getattr(module, "dilation", 1), dims)
        rounding = math.ceil if module.ceil_mode else math.floor
        size = tuple(rounding((n + 2 * p - d * (k - 1) - 1) / s) + 1 for n, p, d, k, s in
                     zip(shape[-dims:], padding, dilation, kernel, stride))
        return shape[:-dims] + size, True
    if isinstance(module, (nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd)):
        dims = int(name[-2]) if name[-2].isdigit() else None
        if dims is None or len(shape) < dims:
            return None, False
        wanted = _tuple(module.output_size, dims)
        size = tuple(n if w is None else w for n, w in zip(shape[-dims:], wanted))
        return shape[:-dims] + size, True
    return None, False


def _tuple(value, dims: int) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * dims
