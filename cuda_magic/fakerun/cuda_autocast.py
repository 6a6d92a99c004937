"""CUDA's autocast for a prediction on a device that stands in for a GPU (the simulated device, whose
tensors are CPU tensors and would otherwise get the CPU's cast lists), and the cuBLAS workspace a GPU
keeps per thread that multiplies matrices.

The cast lists are CUDA's (`AutocastCUDA`), read from torch 2.13's `ATen/autocast_mode.h` (installed
wheel): AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE,
AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE (norm: fp32 appended dtype) and AT_FORALL_PROMOTE, registered for
CUDA in `autocast_mode.cpp`; the 2.4-era `autocast_mode.cpp` (pytorch/pytorch 008ec6b) registers the
same macros for CUDA (plus cudnn_convolution, not reachable from Python). Entries for ops a torch version
does not have never match there (rms_norm is 2.4+); the 2.2-2.3 lists were not compared entry by entry.
The policies (autocast_mode.h, the same from 2.2 to 2.13):
lower_precision_fp casts every eligible floating tensor argument (not float64) to the autocast dtype,
caching the casts of leaf fp32 tensors that require grad (weights) until the autocast region ends
(`cached_cast`); fp32 casts them to float32; fp32_set_opt_dtype passes dtype=float32 where the first
argument is eligible and no dtype is given; promote casts to the widest floating type among them. Casts
happen above autograd, as torch's do (a TorchFunctionMode), so the lower-precision copies are what
backward saves.

Python functions reach these ops under their own names; `F.cross_entropy` (CompositeImplicit in ATen) is
what autocast sees as log_softmax (fp32_set_opt_dtype) then nll_loss (fp32), and is run so.

The cuBLAS workspace: `parseChosenWorkspaceSize` in aten/src/ATen/cuda/CublasHandlePool.cpp: the sum of
SIZE KiB x COUNT over each `:SIZE:COUNT` of CUBLAS_WORKSPACE_CONFIG, else 4096 KiB x 2 + 16 KiB x 8
(8.125 MiB), or 4096 KiB x 8 (32 MiB) on compute capability 9.0 (torch 2.2 to 2.6; the newest file: majors
9, 10 and 12, taken here from 2.7, the first with Blackwell builds). It is allocated through the caching
allocator at a thread's first cuBLAS call (`getCurrentCUDABlasHandle`: one handle and workspace per
thread and stream) and kept: the forward's thread and autograd's device thread, two in a training step.
On CUDA the cell's thread's workspace is counted even where an earlier cell made it already (nothing
tells it from a tensor of the same size): the prediction can be one workspace high there.
Not modelled: cuBLASLt's workspace, cuDNN's workspaces, kernels' own temporaries (reduction staging).
"""
from __future__ import annotations

import os
import re

LOWER_PRECISION_FP = frozenset((
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
    "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention"))
FP32 = frozenset((
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
    "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
    "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa"))
FP32_SET_OPT_DTYPE = frozenset((
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm",
    "sum", "norm"))
PROMOTE = frozenset(("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
                     "index_put", "tensordot", "scatter_add"))
#: Python names of the same ops
ALIASES = {"__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow", "__rpow__": "pow",
           "__ipow__": None}

KiB = 1024


def policy(name: str) -> str | None:
    """The cast policy of CUDA's autocast for the op a Python function `name` reaches (None: none)."""
    name = ALIASES.get(name, name)
    if name is None:
        return None
    if name in LOWER_PRECISION_FP:
        return "lower"
    if name in FP32:
        return "fp32"
    if name in FP32_SET_OPT_DTYPE:
        return "set_opt_dtype"
    if name in PROMOTE:
        return "promote"
    return None


def cublas_workspace_size(capability: tuple[int, int] | None, torch_version: tuple[int, int] = (2, 13),
                          config: str | None = ...) -> int:
    """Bytes of one cuBLAS workspace on a GPU of compute `capability` (CublasHandlePool.cpp,
    parseChosenWorkspaceSize). config: CUBLAS_WORKSPACE_CONFIG (default: the environment's)."""
    if config is ...:
        config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    major, minor = capability or (0, 0)
    big = (major, minor) == (9, 0) if torch_version < (2, 7) else major in (9, 10, 12)
    default = 4096 * KiB * 8 if big else 4096 * KiB * 2 + 16 * KiB * 8
    if config:
        parts = re.findall(r":([0-9]+):([0-9]+)", config)
        if not parts:
            return default            # torch warns "Could not parse CUBLAS_WORKSPACE_CONFIG" and uses it
        return sum(int(size) * KiB * int(count) for size, count in parts)
    return default


def cuda_autocast(amp: str):
    """A context that applies CUDA's autocast lists at `amp` ('bf16', 'fp16') to every tensor, whatever
    its device (the simulated device's are CPU tensors)."""
    import torch
    from torch.overrides import TorchFunctionMode

    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    fp32 = torch.float32

    def eligible(t) -> bool:
        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64

    class CudaAutocast(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.cache: dict = {}       # id(weight) -> (weight, its cast): torch's autocast cache

        def _cast(self, value, dtype):
            if isinstance(value, (list, tuple)):
                return type(value)(self._cast(v, dtype) for v in value)
            if not eligible(value) or value.dtype == dtype:
                return value
            if (dtype == low and value.dtype == fp32 and value.requires_grad and value.is_leaf
                    and value._base is None):
                hit = self.cache.get(id(value))
                if hit is not None and hit[0] is value:
                    return hit[1]
                cast = value.to(dtype)
                self.cache[id(value)] = (value, cast)
                return cast
            return value.to(dtype)

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            if name == "cross_entropy" and len(args) >= 2 and eligible(args[0]) and args[0].dtype != fp32 \
                    and not args[1].is_floating_point() and not kwargs.get("label_smoothing"):
                import torch.nn.functional as F

                extra = {k: v for k, v in kwargs.items() if k in ("weight", "ignore_index", "reduction")}
                return F.nll_loss(F.log_softmax(args[0], 1, dtype=fp32), args[1], **extra)
            rule = policy(name)
            if rule == "lower":
                args, kwargs = self._cast(args, low), {k: self._cast(v, low) for k, v in kwargs.items()}
            elif rule == "fp32":
                args, kwargs = self._cast(args, fp32), {k: self._cast(v, fp32) for k, v in kwargs.items()}
            elif rule == "set_opt_dtype":
                # (norm's fp32_append_dtype gives the overloads without a dtype one: the same here)
                if args and eligible(args[0]) and kwargs.get("dtype") is None:
                    kwargs = dict(kwargs, dtype=fp32)
            elif rule == "promote":
                floats = [a for a in list(args) + list(kwargs.values()) if eligible(a)]
                if floats:
                    widest = fp32 if any(a.dtype == fp32 for a in floats) else floats[0].dtype
                    args = self._cast(args, widest)
            return func(*args, **kwargs)

        def __exit__(self, *exc):
            self.cache.clear()
            return super().__exit__(*exc)

    return CudaAutocast()


def prediction_autocast(amp: str | None, meter):
    """The context of `--amp` for a fake run on `meter`'s device: CUDA's cast lists on the simulated
    device (it stands in for a GPU), torch.autocast for the device elsewhere (on CUDA its own lists)."""
    from cuda_magic.devices.meter import autocast

    if amp is not None and meter.key.startswith("sim"):
        return cuda_autocast(amp)
    return autocast(amp, meter)
