"""Out-of-memory messages as torch printed them, transcribed from public GitHub issues, with the
figures each one states. Sizes are written as the message prints them and converted here with powers of
1024 (torch's allocators print binary units, also where MPS and the old CPU allocator write "GB").

Each entry: source (the issue the text is from), kind (what `oom_kind` must say), backend, device,
text, and `fields`: the expected parsed figures; a figure not listed must parse as None.
"""


def KiB(x):
    return round(x * 1024)


def MiB(x):
    return round(x * 1024**2)


def GiB(x):
    return round(x * 1024**3)


MESSAGES = [
    # -- CUDA, torch 1.0/1.1: "cached" meant reserved but unallocated -------------------------------
    dict(source="https://github.com/pytorch/pytorch/issues/16417 (title)", kind="oom",
         backend="cuda", device="cuda:0",
         text="RuntimeError: CUDA out of memory. Tried to allocate 12.50 MiB (GPU 0; 10.92 GiB total "
              "capacity; 8.57 MiB already allocated; 9.28 GiB free; 4.68 MiB cached)",
         fields=dict(requested=MiB(12.50), capacity=GiB(10.92), allocated_by_torch=MiB(8.57),
                     free=GiB(9.28), reserved_unallocated=MiB(4.68),
                     reserved_total=MiB(8.57) + MiB(4.68))),
    dict(source="https://github.com/shllln/GenerativeGraph/issues/5", kind="oom",
         backend="cuda", device="cuda:0",
         text="RuntimeError: CUDA out of memory. Tried to allocate 1024.00 KiB (GPU 0; 11.17 GiB total "
              "capacity; 10.90 GiB already allocated; 576.00 KiB free; 30.96 MiB cached)",
         fields=dict(requested=KiB(1024), capacity=GiB(11.17), allocated_by_torch=GiB(10.90),
                     free=KiB(576), reserved_unallocated=MiB(30.96),
                     reserved_total=GiB(10.90) + MiB(30.96))),
    # -- CUDA, torch 1.4 - 2.0: "reserved in total by PyTorch" ---------------------------------------
    dict(source="https://github.com/pytorch/pytorch/issues/59778", kind="oom",
         backend="cuda", device="cuda:0",
         text="CUDA out of memory. Tried to allocate 2.26 GiB (GPU 0; 6.00 GiB total capacity; 781.59 MiB "
              "already allocated; 3.03 GiB free; 1.24 GiB reserved in total by PyTorch)",
         fields=dict(requested=GiB(2.26), capacity=GiB(6.00), allocated_by_torch=MiB(781.59),
                     free=GiB(3.03), reserved_total=GiB(1.24),
                     reserved_unallocated=GiB(1.24) - MiB(781.59))),
    dict(source="https://github.com/JDAI-CV/centerX/issues/51", kind="oom",
         backend="cuda", device="cuda:1",
         text="CUDA out of memory. Tried to allocate 130.00 MiB (GPU 1; 7.80 GiB total capacity; 5.91 GiB "
              "already allocated; 33.56 MiB free; 6.09 GiB reserved in total by PyTorch)",
         fields=dict(requested=MiB(130), capacity=GiB(7.80), allocated_by_torch=GiB(5.91),
                     free=MiB(33.56), reserved_total=GiB(6.09),
                     reserved_unallocated=GiB(6.09) - GiB(5.91))),
    dict(source="https://github.com/gjy3035/NWPU-Crowd-Sample-Code/issues/27", kind="oom",
         backend="cuda", device="cuda:0",
         text="torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 38.00 MiB (GPU 0; "
              "4.00 GiB total capacity; 3.41 GiB already allocated; 0 bytes free; 3.44 GiB reserved in "
              "total by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb "
              "to avoid fragmentation.  See documentation for Memory Management and "
              "PYTORCH_CUDA_ALLOC_CONF",
         fields=dict(requested=MiB(38), capacity=GiB(4.00), allocated_by_torch=GiB(3.41), free=0,
                     reserved_total=GiB(3.44), reserved_unallocated=GiB(3.44) - GiB(3.41))),
    dict(source="https://github.com/YingqianWang/iPASSR/issues/9", kind="oom",
         backend="cuda", device="cuda:0",
         # more allocated than the capacity: Windows lets the driver spill into shared system memory
         text="torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 10.73 GiB (GPU 0; "
              "8.00 GiB total capacity; 17.20 GiB already allocated; 0 bytes free; 19.15 GiB reserved in "
              "total by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb "
              "to avoid fragmentation.  See documentation for Memory Management and "
              "PYTORCH_CUDA_ALLOC_CONF",
         fields=dict(requested=GiB(10.73), capacity=GiB(8.00), allocated_by_torch=GiB(17.20), free=0,
                     reserved_total=GiB(19.15), reserved_unallocated=GiB(19.15) - GiB(17.20))),
    # -- CUDA, torch 2.1 - 2.3: "total capacty" (sic), NVML process lines ------------------------------
    dict(source="https://github.com/pytorch/pytorch/pull/99699 (the PR that added this form; wrapped)",
         kind="oom", backend="cuda", device="cuda:0",
         text="torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 138.00 MiB.\n"
              "GPU 0 has a total capacty of 15.90 GiB of which 8.44 MiB is free.\n"
              "Process 1246069 has 577.00 MiB memory in use. Including non-PyTorch memory,\n"
              "this process has 15.32 GiB memory in use. Of the allocated memory\n"
              "14.12 GiB is allocated by PyTorch, and 410.41 MiB is reserved\n"
              "by PyTorch but unallocated. If reserved but unallocated memory is large\n"
              "try setting max_split_size_mb to avoid fragmentation.  See documentation\n"
              " for Memory Management and PYTORCH_CUDA_ALLOC_CONF",
         fields=dict(requested=MiB(138), capacity=GiB(15.90), free=MiB(8.44), this_process=GiB(15.32),
                     other_processes=GiB(15.90) - MiB(8.44) - GiB(15.32),
                     allocated_by_torch=GiB(14.12), reserved_unallocated=MiB(410.41),
                     reserved_total=GiB(14.12) + MiB(410.41))),
    dict(source="https://github.com/carolchenyx/MGFN./issues/35", kind="oom",
         backend="cuda", device="cuda:0",
         text="torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.70 GiB. GPU 0 has a "
              "total capacty of 6.00 GiB of which 0 bytes is free. Of the allocated memory 2.93 GiB is "
              "allocated by PyTorch, and 2.30 GiB is reserved by PyTorch but unallocated. If reserved but "
              "unallocated memory is large try setting max_split_size_mb to avoid fragmentation.  See "
              "documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF",
         fields=dict(requested=GiB(1.70), capacity=GiB(6.00), free=0, allocated_by_torch=GiB(2.93),
                     reserved_unallocated=GiB(2.30), reserved_total=GiB(2.93) + GiB(2.30))),
    dict(source="https://github.com/FoundationVision/GenerateU/issues/10", kind="oom",
         backend="cuda", device="cuda:0",
         # in a container NVML lists this very process as "Process 20398": not another process
         text="torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 496.00 MiB. GPU 0 has a "
              "total capacty of 14.75 GiB of which 235.06 MiB is free. Process 20398 has 14.52 GiB memory "
              "in use. Of the allocated memory 14.06 GiB is allocated by PyTorch, and 330.42 MiB is "
              "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
              "setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management "
              "and PYTORCH_CUDA_ALLOC_CONF",
         fields=dict(requested=MiB(496), capacity=GiB(14.75), free=MiB(235.06),
                     allocated_by_torch=GiB(14.06), reserved_unallocated=MiB(330.42),
                     reserved_total=GiB(14.06) + MiB(330.42))),
    dict(source="https://github.com/Synthintel0/MyGirlGPT/issues/11", kind="oom",
         backend="cuda", device="cuda:0",
         text="torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 32.00 MiB. GPU 0 has a "
              "total capacty of 4.00 GiB of which 41.56 MiB is free. Including non-PyTorch memory, this "
              "process has 3.44 GiB memory in use. Of the allocated memory 2.58 GiB is allocated by "
              "PyTorch, and 1.90 MiB is reserved by PyTorch but unallocated. If reserved but unallocated "
              "memory is large try setting max_split_size_mb to avoid fragmentation.  See documentation "
              "for Memory Management and PYTORCH_CUDA_ALLOC_CONF.",
         fields=dict(requested=MiB(32), capacity=GiB(4.00), free=MiB(41.56), this_process=GiB(3.44),
                     other_processes=GiB(4.00) - MiB(41.56) - GiB(3.44), allocated_by_torch=GiB(2.58),
                     reserved_unallocated=MiB(1.90), reserved_total=GiB(2.58) + MiB(1.90))),
    # -- CUDA, torch 2.4+: "total capacity", expandable_segments hint ---------------------------------
    dict(source="https://github.com/murong-xu/CADS/issues/4", kind="oom",
         backend="cuda", device="cuda:0",
         text="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.78 GiB. GPU 0 has a total "
              "capacity of 31.47 GiB of which 12.73 GiB is free. Including non-PyTorch memory, this "
              "process has 18.73 GiB memory in use. Of the allocated memory 9.08 GiB is allocated by "
              "PyTorch, and 9.35 GiB is reserved by PyTorch but unallocated. If reserved but unallocated "
              "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
              "fragmentation.  See documentation for Memory Management  "
              "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
         fields=dict(requested=GiB(22.78), capacity=GiB(31.47), free=GiB(12.73), this_process=GiB(18.73),
                     other_processes=GiB(31.47) - GiB(12.73) - GiB(18.73), allocated_by_torch=GiB(9.08),
                     reserved_unallocated=GiB(9.35), reserved_total=GiB(9.08) + GiB(9.35))),
    dict(source="https://github.com/pytorch/pytorch/issues/16417 (comment, 2024)", kind="oom",
         backend="cuda", device="cuda:0",
         text="torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.00 MiB. GPU 0 has a "
              "total capacity of 23.65 GiB of which 11.06 MiB is free. Including non-PyTorch memory, this "
              "process has 23.60 GiB memory in use. Of the allocated memory 22.90 GiB is allocated by "
              "PyTorch, and 194.87 MiB is reserved by PyTorch but unallocated. If reserved but "
              "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
              "to avoid fragmentation.  See documentation for Memory Management  "
              "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
         fields=dict(requested=MiB(22), capacity=GiB(23.65), free=MiB(11.06), this_process=GiB(23.60),
                     other_processes=GiB(23.65) - MiB(11.06) - GiB(23.60), allocated_by_torch=GiB(22.90),
                     reserved_unallocated=MiB(194.87), reserved_total=GiB(22.90) + MiB(194.87))),
    dict(source="https://github.com/awslabs/keys_values/issues/92", kind="oom",
         backend="cuda", device="cuda:0",
         text="[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 572.00 MiB. GPU 0 has "
              "a total capacity of 39.49 GiB of which 321.31 MiB is free. Process 3721648 has 414.00 MiB "
              "memory in use. Including non-PyTorch memory, this process has 37.46 GiB memory in use. "
              "Process 1374765 has 414.00 MiB memory in use. Process 1374763 has 414.00 MiB memory in use. "
              "Process 1374764 has 414.00 MiB memory in use. Of the allocated memory 36.04 GiB is "
              "allocated by PyTorch, and 321.37 MiB is reserved by PyTorch but unallocated. If reserved "
              "but unallocated memory is large try setting PYTORCH_ALLOC_CONF=expandable_segments:True to "
              "avoid fragmentation.  See documentation for Memory Management  "
              "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
         fields=dict(requested=MiB(572), capacity=GiB(39.49), free=MiB(321.31), this_process=GiB(37.46),
                     other_processes=GiB(39.49) - MiB(321.31) - GiB(37.46), allocated_by_torch=GiB(36.04),
                     reserved_unallocated=MiB(321.37), reserved_total=GiB(36.04) + MiB(321.37))),
    dict(source="https://github.com/huggingface/meshgen/issues/7", kind="oom",
         backend="cuda", device="cuda:0",
         text="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1002.00 MiB. GPU 0 has a total "
              "capacity of 8.00 GiB of which 0 bytes is free. Of the allocated memory 13.98 GiB is "
              "allocated by PyTorch, and 129.48 MiB is reserved by PyTorch but unallocated. If reserved but "
              "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
              "avoid fragmentation.  See documentation for Memory Management  "
              "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
         fields=dict(requested=MiB(1002), capacity=GiB(8.00), free=0, allocated_by_torch=GiB(13.98),
                     reserved_unallocated=MiB(129.48), reserved_total=GiB(13.98) + MiB(129.48))),
    dict(source="https://github.com/taohan10200/IIM/issues/28", kind="oom",
         backend="cuda", device=None,
         text="RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported "
              "at some other API call,so the stacktrace below might be incorrect.\nFor debugging consider "
              "passing CUDA_LAUNCH_BLOCKING=1.",
         fields=dict()),
    # -- ROCm ------------------------------------------------------------------------------------------
    dict(source="https://github.com/Comfy-Org/ComfyUI/issues/9529", kind="oom",
         backend="hip", device="cuda:0",
         text="HIP out of memory. Tried to allocate 432.00 MiB. GPU 0 has a total capacity of 15.92 GiB of "
              "which 7.12 GiB is free. Of the allocated memory 8.08 GiB is allocated by PyTorch, and "
              "321.96 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is "
              "large try setting PYTORCH_HIP_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
              "See documentation for Memory Management  "
              "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
         fields=dict(requested=MiB(432), capacity=GiB(15.92), free=GiB(7.12), allocated_by_torch=GiB(8.08),
                     reserved_unallocated=MiB(321.96), reserved_total=GiB(8.08) + MiB(321.96))),
    dict(source="https://github.com/ROCm/TheRock/issues/1054", kind="oom",
         backend="hip", device="cuda:0",
         text="torch.OutOfMemoryError: HIP out of memory. Tried to allocate 16.00 GiB. GPU 0 has a total "
              "capacity of 15.24 GiB of which 15.09 GiB is free. Of the allocated memory 0 bytes is "
              "allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If reserved but "
              "unallocated memory is large try setting PYTORCH_HIP_ALLOC_CONF=expandable_segments:True to "
              "avoid fragmentation.  See documentation for Memory Management  "
              "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
         fields=dict(requested=GiB(16), capacity=GiB(15.24), free=GiB(15.09), allocated_by_torch=0,
                     reserved_unallocated=0, reserved_total=0)),
    # -- Apple MPS: "other allocations" are this process's other Metal memory ------------------------
    dict(source="https://github.com/Comfy-Org/ComfyUI/issues/7372", kind="oom",
         backend="mps", device="mps",
         text="MPS backend out of memory (MPS allocated: 17.68 GB, other allocations: 3.95 MB, max allowed: "
              "18.13 GB). Tried to allocate 1024.00 MB on private pool. Use "
              "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations (may "
              "cause system failure).",
         fields=dict(requested=MiB(1024), capacity=GiB(18.13), allocated_by_torch=GiB(17.68),
                     this_process=GiB(17.68) + MiB(3.95))),
    dict(source="https://github.com/Comfy-Org/ComfyUI/issues/7440", kind="oom",
         backend="mps", device="mps",
         text="MPS backend out of memory (MPS allocated: 9.57 GiB, other allocations: 17.35 GiB, max "
              "allowed: 27.20 GiB). Tried to allocate 292.50 MiB on private pool. Use "
              "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations (may "
              "cause system failure).",
         fields=dict(requested=MiB(292.50), capacity=GiB(27.20), allocated_by_torch=GiB(9.57),
                     this_process=GiB(9.57) + GiB(17.35))),
    dict(source="https://github.com/pinokiocomputer/pinokio/issues/941", kind="oom",
         backend="mps", device="mps",
         text="MPS backend out of memory (MPS allocated: 16.00 GB, other allocations: 3.31 GB, max allowed: "
              "18.13 GB). Tried to allocate 256 bytes on shared pool. Use "
              "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations (may "
              "cause system failure).",
         fields=dict(requested=256, capacity=GiB(18.13), allocated_by_torch=GiB(16.00),
                     this_process=GiB(16.00) + GiB(3.31))),
    # -- Intel XPU ---------------------------------------------------------------------------------------
    dict(source="https://github.com/intel/torch-xpu-ops/issues/3011", kind="oom",
         backend="xpu", device="xpu:0",
         text="torch.OutOfMemoryError: XPU out of memory. Tried to allocate 4.66 GiB. GPU 0 has a total "
              "capacity of 5.65 GiB of which 5.65 GiB is free. Of the allocated memory 195.50 KiB is "
              "allocated by PyTorch, and 1.81 MiB is reserved by PyTorch but unallocated. Please use "
              "`empty_cache` to release all unoccupied cached memory.",
         fields=dict(requested=GiB(4.66), capacity=GiB(5.65), free=GiB(5.65), allocated_by_torch=KiB(195.50),
                     reserved_unallocated=MiB(1.81), reserved_total=KiB(195.50) + MiB(1.81))),
    # -- cuBLAS, cuDNN ---------------------------------------------------------------------------------
    dict(source="https://github.com/QwenLM/Qwen3/issues/873", kind="oom",
         backend="cublas", device=None,
         text="RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
         fields=dict()),
    dict(source="https://github.com/pytorch/pytorch/issues/11065", kind="possible",
         backend="cudnn", device=None,
         text="RuntimeError: CuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed "
              "in a non-contiguous input.",
         fields=dict()),
    # -- CPU -------------------------------------------------------------------------------------------
    dict(source="https://github.com/JingyunLiang/VRT/issues/49", kind="oom",
         backend="cpu", device="cpu",
         text="RuntimeError: [enforce fail at alloc_cpu.cpp:73] . DefaultCPUAllocator: can't allocate "
              "memory: you tried to allocate 116813856768 bytes. Error code 12 (Cannot allocate memory)",
         fields=dict(requested=116813856768)),
    dict(source="https://github.com/MaximeVandegar/Papers-in-100-Lines-of-Code/issues/10", kind="oom",
         backend="cpu", device="cpu",
         text="RuntimeError: [enforce fail at C:\\b\\abs_bao0hdcrdh\\croot\\pytorch_1675190257512\\work\\c10"
              "\\core\\impl\\alloc_cpu.cpp:81] data. DefaultCPUAllocator: not enough memory: you tried to "
              "allocate 1981808640 bytes.",
         fields=dict(requested=1981808640)),
    dict(source="https://github.com/pytorch/pytorch/issues/5434 (torch 0.3)", kind="oom",
         backend="cpu", device="cpu",
         text="RuntimeError: $ Torch: not enough memory: you tried to allocate 72GB. Buy new RAM!",
         fields=dict(requested=GiB(72))),
    # -- quoted in cuda_magic's issue 36 from public reports: the cause sentence left out what held the device
    dict(source="cuda_magic issue 36 (a torch 1.1 message from a public report: 5.73 GiB outside PyTorch)",
         kind="oom", backend="cuda", device="cuda:0",
         text="RuntimeError: CUDA out of memory. Tried to allocate 1.12 MiB (GPU 0; 22.37 GiB total capacity; "
              "15.87 GiB already allocated; 3.56 MiB free; 787.74 MiB cached)",
         fields=dict(requested=MiB(1.12), capacity=GiB(22.37), allocated_by_torch=GiB(15.87), free=MiB(3.56),
                     reserved_unallocated=MiB(787.74), reserved_total=GiB(15.87) + MiB(787.74))),
    dict(source="cuda_magic issue 36 (a torch 2.4+ message from a public report, quoted with its device "
                "figures left out: 3.85 GiB of this process outside PyTorch)",
         kind="oom", backend="cuda", device=None,
         text="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 132.00 MiB. ... Including "
              "non-PyTorch memory, this process has 22.90 GiB memory in use. Of the allocated memory 18.70 GiB "
              "is allocated by PyTorch, and 353.02 MiB is reserved by PyTorch but unallocated.",
         fields=dict(requested=MiB(132), this_process=GiB(22.90), allocated_by_torch=GiB(18.70),
                     reserved_unallocated=MiB(353.02), reserved_total=GiB(18.70) + MiB(353.02))),
]

# Messages that are not out of memory: the CUDA context is gone and the kernel must restart.
FATAL = [
    # https://github.com/karpathy/nanoGPT/issues/470
    "RuntimeError: CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously "
    "reported at some other API call, so the stacktrace below might be incorrect.\nFor debugging consider "
    "passing CUDA_LAUNCH_BLOCKING=1.\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
    # https://github.com/3dlg-hcvc/multi3drefer/issues/14
    "RuntimeError: CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
    "asynchronously reported at some other API call, so the stacktrace below might be incorrect.\nFor "
    "debugging consider passing CUDA_LAUNCH_BLOCKING=1.",
]

# Errors that mention memory but are neither.
NOT_OOM = [
    "RuntimeError: Expected all tensors to be on the same device, but found at least two devices, "
    "cuda:0 and cpu!",
    "RuntimeError: CUDA error: no kernel image is available for execution on the device",
    "ValueError: memory_format must be torch.contiguous_format",
    "",
]
