"""The machine's rates, measured in the same run as the benchmark that divides by them.

Every benchmark that states a floor or a share of the hardware imports these: matmul rate (fp32, or
the dtype a benchmark computes in), memory read rate, peak resident memory and the load average. On a
shared machine the rates move with other jobs, so measure them in the run, before, beside and after the
timed work, and divide by the highest (`MachineRates.best`): a measured-rate floor.

    python benchmarks/machine.py [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

MATMUL_SIZE = 1024
GPU_MATMUL_SIZE = 8192  # large enough for a GPU's tensor cores to reach their sustained rate
DRAM_BUFFER_BYTES = 512 * 2**20  # beyond the last-level cache a VM gets here: the DRAM read rate
GPU_BUFFER_BYTES = 2**30  # larger than an H100/H200 L2 cache: the HBM read rate
CPU = torch.device("cpu")
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so wall-clock times cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device = CPU) -> float:
    """Seconds fn() takes, its device work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def matmul_rate(size: int = MATMUL_SIZE, device: torch.device = CPU, repeats: int = 20,
                dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a [size, size] x [size, size] product in dtype (median of repeats): through BLAS and, on a
    CPU where oneDNN can run them (`aligner.runtime.cpu_products`, the native engine's products), through oneDNN too;
    the faster of the two, so a floor never sits below what the project's own products reach."""
    from aligner.runtime import cpu_products

    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    products = [lambda: a @ b]
    if cpu_products.available(a.device, a.dtype):
        products.append(lambda: cpu_products.linear(a, b))
    best = 0.0
    for product in products:
        for _ in range(3):
            product()
        best = max(best, 2 * size**3 / statistics.median(timed(product, device) for _ in range(repeats)))
    return best


def read_rate(nbytes: Optional[float] = None, device: torch.device = CPU, repeats: int = 20) -> float:
    """Bytes/s of a summing pass over a float32 buffer of nbytes (median of repeats).

    None: a buffer larger than the last-level cache (DRAM or HBM). A given size measures the rate
    at which a working set of that size is read when it is all there is (hot in cache if it fits),
    e.g. one decode step's weights and KV cache. On a GPU the buffer is never below its L2 size.
    """
    floor = GPU_BUFFER_BYTES if device.type == "cuda" else 0
    nbytes = max(DRAM_BUFFER_BYTES if nbytes is None else nbytes, floor)
    buffer = torch.randn(max(int(nbytes) // 4, 1 << 16), device=device)
    for _ in range(3):
        buffer.sum()
    return buffer.numel() * 4 / statistics.median(timed(buffer.sum, device) for _ in range(repeats))


def peak_rss_mb() -> tuple[float, float]:
    """Peak resident memory in MB of this process and of its largest waited-for child (Linux ru_maxrss is KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return own / 1024, children / 1024


def cpu_model() -> str:
    """The CPU's model name as lscpu gives it ("Model name"), or "unknown CPU" where lscpu says nothing."""
    try:
        listing = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "unknown CPU"
    for line in listing.splitlines():
        if line.strip().startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


# The CPU flags that decide which kernels torch and oneDNN can use for the products measured here.
MATTERING_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def torch_libraries() -> str:
    """torch's BLAS (BLAS_INFO of its build) and oneDNN version, and the CPU capability it dispatches to."""
    import re

    shown = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", shown)
    onednn = re.search(r"MKL-DNN (v[\d.]+)|oneDNN (v[\d.]+)", shown)
    capability = re.search(r"CPU capability usage: (\w+)", shown)
    return (f"torch {torch.__version__.split('+')[0]}: BLAS {blas.group(1) if blas else 'unknown'}, "
            f"oneDNN {next(filter(None, onednn.groups())) if onednn else 'absent'}, "
            f"kernels {capability.group(1) if capability else 'unknown'}")


def cpu_header() -> str:
    """The `cpu:` line every benchmark on a CPU prints first: the model, logical CPUs, the flags that matter
    (`MATTERING_FLAGS`: present ones named, absent ones after "no"), torch's BLAS and oneDNN, and which library
    the project's fp32 products take (`cpu_products`). Ratios move with all of these (the two machine types
    here differ by up to 2x)."""
    from aligner.runtime import cpu_products

    flags = set(cpu_products.cpu_info("flags").split())
    has = [flag for flag in MATTERING_FLAGS if flag in flags]
    lacks = [flag for flag in MATTERING_FLAGS if flag not in flags]
    return (f"cpu: {cpu_model()} ({os.cpu_count()} logical CPUs, {cpu_products.cpu_info('vendor_id') or 'vendor?'}); "
            f"flags {' '.join(has) or 'none of ' + '/'.join(MATTERING_FLAGS)}"
            + (f", no {' '.join(lacks)}" if lacks and has else "")
            + f"; {torch_libraries()}; training products: {cpu_products.preferred_library()} "
            f"({cpu_products.PREFERENCE_VARIABLE}={os.environ.get(cpu_products.PREFERENCE_VARIABLE, 'auto')})")


def load_average() -> float:
    """The 1-minute load average: timings on a shared machine move with it, so print it beside them."""
    return os.getloadavg()[0]


@dataclass(frozen=True)
class MachineRates:
    matmul_flops: float  # FLOP/s of the matmul_size^3 product in matmul_dtype
    read_bytes: float  # bytes/s of a summing pass over a buffer larger than the last-level cache
    load: float  # 1-minute load average when measured
    matmul_dtype: torch.dtype = torch.float32
    matmul_size: int = MATMUL_SIZE

    @staticmethod
    def measure(device: torch.device = CPU, dtype: torch.dtype = torch.float32) -> "MachineRates":
        """The rates on device; the matmul in dtype, GPU_MATMUL_SIZE^3 on a GPU, MATMUL_SIZE^3 on a CPU."""
        size = GPU_MATMUL_SIZE if device.type == "cuda" else MATMUL_SIZE
        return MachineRates(matmul_rate(size, device, dtype=dtype), read_rate(device=device), load_average(),
                            dtype, size)

    @staticmethod
    def best(samples: list["MachineRates"]) -> "MachineRates":
        """Per field maximum of several measurements (before, beside and after the timed work): on a shared
        machine a rate measured low is the machine busy, not the hardware, so a floor from the highest rate
        seen is the strictest this run supports (a measured-rate floor, not a physical one). load: the highest."""
        fields = ("matmul_flops", "read_bytes", "load")
        return MachineRates(*(max(getattr(s, name) for s in samples) for name in fields),
                            samples[0].matmul_dtype, samples[0].matmul_size)

    @staticmethod
    def describe_samples(samples: list["MachineRates"]) -> str:
        """Every rate measurement of a run, in order, so a reader sees how far they spread."""
        return (f"rate samples ({len(samples)}, each the median of its repeats): matmul "
                + ", ".join(f"{s.matmul_flops / 1e9:.0f}" for s in samples) + " GFLOP/s; read "
                + ", ".join(f"{s.read_bytes / 1e9:.1f}" for s in samples) + " GB/s; load "
                + ", ".join(f"{s.load:.2f}" for s in samples))

    def describe(self) -> str:
        """The `machine:` line every benchmark prints (run_bench.py reads it back)."""
        return (f"machine: matmul {self.matmul_flops / 1e9:.0f} GFLOP/s "
                f"({DTYPE_NAMES[self.matmul_dtype]} {self.matmul_size}^3, median), "
                f"read {self.read_bytes / 1e9:.1f} GB/s (sum over {DRAM_BUFFER_BYTES >> 20} MB), "
                f"load {self.load:.2f}")


def describe_peak_rss() -> str:
    own, children = peak_rss_mb()
    return f"peak RSS: {own:.0f} MB (this process), {children:.0f} MB (largest child)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(cpu_header())
    print(MachineRates.measure().describe() + f", {torch.get_num_threads()} threads")
    print(describe_peak_rss())


if __name__ == "__main__":
    main()
