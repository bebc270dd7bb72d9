"""Measure on one GPU what vLLM's sleep mode costs: the hardware anchor of the emulator's
sleep/wake timing (the `sleep` section of tandem/emulator/profiles/h200-llama-3.1-8b.yaml).

vLLM 0.32's sleep level 1 (device_allocator/cumem.py) allocates, per weight allocation, a fresh
pinned CPU tensor, copies the weights into it and unmaps all GPU memory; waking maps new physical
memory (cuMemCreate + cuMemMap + cuMemSetAccess) and copies the weights back; the KV cache comes
back as fresh, empty memory. This times, for Llama-3.1-8B's bf16 weight tensors (fused qkv and
gate_up, as vLLM holds them; 16.06 GB):

* pinning the host buffers (`pin_memory=True`, cudaHostAlloc), once;
* device-to-host and host-to-device copies of every tensor into pinned and into pageable memory
  (median of 4), the pageable ones the floor of reloading weights without a pinned copy;
* mapping and unmapping a 100 GiB KV pool through the CUDA driver's virtual-memory calls, in
  2 MiB chunks and in 3.2 GiB chunks (one per layer, as vLLM's KV tensors are), and `torch.empty`
  of 100 GiB after emptying the caching allocator (cudaMalloc), three times.

Usage (on the GPU machine, whose image has torch and cuda-bindings):
    python benchmarks/h200_wake.py > wake.json
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from cuda.bindings import driver as cu

HIDDEN, FFN, VOCAB, KV_DIM, LAYERS = 4096, 14336, 128256, 1024, 32
LAYER = [(HIDDEN + 2 * KV_DIM, HIDDEN), (HIDDEN, HIDDEN), (2 * FFN, HIDDEN), (HIDDEN, FFN)]
SHAPES = [(VOCAB, HIDDEN), *([*LAYER, (HIDDEN,), (HIDDEN,)] * LAYERS), (HIDDEN,), (VOCAB, HIDDEN)]
KV_BYTES = 100 * 2**30


def median_s(fn: Callable[[], object], repeats: int = 4) -> float:
    """Median wall seconds of fn between device synchronisations."""
    seconds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def copies(record: dict[str, Any]) -> None:
    """Pinning and copies of the weights; the GPU tensors are freed on return."""
    gpu = [torch.randn(s, dtype=torch.bfloat16, device="cuda") for s in SHAPES]
    record["bytes"] = sum(t.numel() * t.element_size() for t in gpu)
    start = time.perf_counter()
    pinned = [torch.empty(s, dtype=torch.bfloat16, pin_memory=True) for s in SHAPES]
    record["pin_alloc_s"] = time.perf_counter() - start
    pageable = [torch.zeros(s, dtype=torch.bfloat16) for s in SHAPES]  # pages touched
    for name, host in (("pinned", pinned), ("pageable", pageable)):
        record[f"d2h_{name}"] = median_s(lambda host=host: copy_all(host, gpu))
        record[f"h2d_{name}"] = median_s(lambda host=host: copy_all(gpu, host))
    record["ok"] = bool(torch.equal(gpu[5].cpu(), pinned[5]))
    torch.cuda.empty_cache()


def copy_all(into: list[torch.Tensor], source: list[torch.Tensor]) -> None:
    """Tensor by tensor, as the sleep allocator copies each allocation."""
    for dst, src in zip(into, source, strict=True):
        dst.copy_(src, non_blocking=True)


def check(ret: Any) -> Any:
    err = ret[0] if isinstance(ret, tuple) else ret
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver error {err}")
    return ret[1] if isinstance(ret, tuple) and len(ret) > 1 else None


def kv_mapping(record: dict[str, Any]) -> None:
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    access = cu.CUmemAccessDesc()
    access.location = prop.location
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    for chunk_mib in (2, 3200):
        chunk = chunk_mib * 2**20
        count = KV_BYTES // chunk
        base = int(check(cu.cuMemAddressReserve(chunk * count, 0, 0, 0)))
        torch.cuda.synchronize()
        start = time.perf_counter()
        handles = []
        for i in range(count):
            handle = check(cu.cuMemCreate(chunk, prop, 0))
            check(cu.cuMemMap(base + i * chunk, chunk, 0, handle, 0))
            check(cu.cuMemSetAccess(base + i * chunk, chunk, [access], 1))
            handles.append(handle)
        record[f"vmm_map_{chunk_mib}mib_s"] = time.perf_counter() - start
        start = time.perf_counter()
        for i, handle in enumerate(handles):
            check(cu.cuMemUnmap(base + i * chunk, chunk))
            check(cu.cuMemRelease(handle))
        record[f"vmm_unmap_{chunk_mib}mib_s"] = time.perf_counter() - start
        check(cu.cuMemAddressFree(base, chunk * count))
    seconds = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        kv = torch.empty(KV_BYTES, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        del kv
        torch.cuda.empty_cache()
    record["torch_empty_100gib_s"] = seconds


def main() -> None:
    record: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    copies(record)
    kv_mapping(record)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
