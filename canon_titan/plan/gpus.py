"""The GPUs a run can be planned for: memory, peak dense FLOP/s, HBM and link bandwidths.

Every figure is the vendor's datasheet number for the SXM part (dense, no sparsity), named beside
it. Bandwidths are per GPU and per direction: NVLink inside a node, the GPU's own InfiniBand NIC
between nodes (DGX/HGX systems give every GPU one). A GPU missing here is described in a TOML file
with the same keys (``canon-titan plan --gpu FILE.toml``).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

GIB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    """What ``torch.cuda.get_device_properties().total_memory`` reports (a little under the
    label)."""
    bf16_tflops: float
    """Peak dense bf16 tensor-core FLOP/s, in 10^12."""
    fp8_tflops: float
    """Peak dense fp8 tensor-core FLOP/s, in 10^12 (0: no fp8 tensor cores)."""
    hbm_tb_s: float
    """HBM bandwidth, 10^12 bytes/s."""
    nvlink_gb_s: float
    """NVLink bandwidth per GPU and direction, 10^9 bytes/s."""
    network_gb_s: float
    """Inter-node bandwidth per GPU and direction (its InfiniBand NIC), 10^9 bytes/s."""
    capability: tuple[int, int] = (9, 0)
    """CUDA compute capability: which kernels canon-titan's ``auto`` backends pick there."""
    fp32_tflops: float = field(kw_only=True)
    """Peak fp32 FLOP/s without tensor cores, in 10^12: fp32 matmuls run at it unless the run
    allows TF32 (PyTorch's default does not, nor do TorchTitan and canon-titan)."""
    matmul_efficiency: float = field(default=0.803, kw_only=True)
    """The share of the bf16 peak that the best-shaped large GEMM sustains on this part (the
    "maximum achievable matmul FLOPS", measured): the clock the part holds at its power limit
    under tensor-core load, against the boost clock its datasheet peak assumes. Default: the
    H100 SXM's."""
    fp8_matmul_efficiency: float = field(default=0.709, kw_only=True)
    """The same for float8 GEMMs against the fp8 peak. Default: the H100 SXM's."""
    sm_count: int | None = field(default=None, kw_only=True)
    """Streaming multiprocessors (None: not known; ``kernel_cost`` then does not price its
    kernels)."""
    sm_clock_ghz: float | None = field(default=None, kw_only=True)
    """The SM clock of the datasheet's fp32 peak (``fp32_tflops`` = SMs x 128 lanes x 2 x clock on
    these parts), 10^9 cycles/s: what ``kernel_cost`` issues instructions at."""
    nccl_nvlink_gb_s: float | None = field(default=None, kw_only=True)
    """The NVLink bandwidth NCCL's collectives reach per GPU and direction, 10^9 bytes/s: its
    per-link rate for the architecture times the links (NCCL's ``src/graph/topo.h``; torch's
    ``_inductor.comm_analysis`` carries the same table: 240 on Ampere, 370 on Hopper, 720 on
    Blackwell), about 0.8 of the datasheet's ``nvlink_gb_s``. Default: ``NCCL_NVLINK_SHARE`` of
    it."""

    @property
    def collective_nvlink_gb_s(self) -> float:
        return self.nccl_nvlink_gb_s or NCCL_NVLINK_SHARE * self.nvlink_gb_s

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    @property
    def tf32_tflops(self) -> float:
        """fp32 matmuls where TF32 is allowed (the run's
        ``torch.backends.cuda.matmul.fp32_precision`` is "tf32", or a Triton kernel's ``tl.dot``):
        half the bf16 rate on these parts."""
        return self.bf16_tflops / 2


NCCL_NVLINK_SHARE = 370.0 / 450.0
"""NCCL's NVLink bandwidth over the datasheet's on Hopper (``GPU.nccl_nvlink_gb_s``), for parts
described without their own figure."""

GPUS: dict[str, GPU] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM column: 989 TFLOPS bf16 and 1,979 fp8 (dense: half
    # the "with sparsity" figures), 67 TFLOPS fp32, 3.35 TB/s HBM3, NVLink 900 GB/s (both
    # directions); nvidia-smi shows 81,559 MiB. DGX H100: one 400 Gb/s ConnectX-7 per GPU (50 GB/s).
    # Best-shape GEMMs: 794.5 of 989 bf16 (80.3%), 1,402.6 of 1,979 fp8 (70.9%): the maximum
    # achievable matmul FLOPS table of Stas Bekman's "Machine Learning Engineering"
    # (compute/accelerator), which the efficiencies of every part below come from too.
    # 132 SMs at 1.98 GHz (67 TFLOPS fp32 = 132 x 128 x 2 x 1.98e9).
    "h100": GPU(
        "H100 SXM 80GB",
        79.6,
        989.0,
        1979.0,
        3.35,
        450.0,
        50.0,
        (9, 0),
        fp32_tflops=67.0,
        matmul_efficiency=0.803,
        fp8_matmul_efficiency=0.709,
        nccl_nvlink_gb_s=370.0,
        sm_count=132,
        sm_clock_ghz=1.98,
    ),
    # The H100 of TorchTitan's published runs (benchmarks/llama3_h100_202412_torchtitan.md, Meta's
    # Grand Teton): 96 GB HBM2e at 2.4 TB/s, a 500 W power limit, NVLink with NVSwitch and 400 Gb/s
    # RDMA per GPU. Its peak is "between SXM and NVL" (that file's footnote 2), which no datasheet
    # gives: the midpoint of the H100 SXM datasheet's 989 bf16 / 1,979 fp8 / 67 fp32 and the H100
    # NVL datasheet's 835 / 1,671 / 60 (dense). Memory: 96 GiB of HBM, of which the driver shows
    # the same share as the 80 GB part's 81,559 of 81,920 MiB.
    "h100-hbm2e": GPU(
        "H100 96GB HBM2e 500W",
        95.5,
        912.0,
        1825.0,
        2.4,
        450.0,
        50.0,
        (9, 0),
        fp32_tflops=63.5,
        matmul_efficiency=0.803,
        fp8_matmul_efficiency=0.709,
        nccl_nvlink_gb_s=370.0,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM column: the H100's compute, 4.8 TB/s HBM3e, 141 GB
    # (nvidia-smi: 143,771 MiB), NVLink 900 GB/s; HGX H200 with 400 Gb/s NDR per GPU.
    # Best-shape GEMMs: bf16 as the H100 ("H200 is the same"), 1,453.4 of 1,979 fp8 (73.4%).
    # The H100's 132 SMs at 1.98 GHz.
    "h200": GPU(
        "H200 SXM 141GB",
        140.4,
        989.0,
        1979.0,
        4.8,
        450.0,
        50.0,
        (9, 0),
        fp32_tflops=67.0,
        matmul_efficiency=0.803,
        fp8_matmul_efficiency=0.734,
        nccl_nvlink_gb_s=370.0,
        sm_count=132,
        sm_clock_ghz=1.98,
    ),
    # NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column: 312 TFLOPS bf16, no fp8, 19.5 fp32,
    # 2,039 GB/s HBM2e, NVLink 600 GB/s; DGX A100: one 200 Gb/s HDR per GPU (25 GB/s).
    # Best-shape GEMMs: 271.2 of 312 bf16 (86.9%): the A100 holds its 1,410 MHz boost clock.
    "a100": GPU(
        "A100 SXM 80GB",
        80.0,
        312.0,
        0.0,
        2.039,
        300.0,
        25.0,
        (8, 0),
        fp32_tflops=19.5,
        matmul_efficiency=0.869,
        nccl_nvlink_gb_s=240.0,
    ),
    # NVIDIA DGX B200 / HGX B200 datasheet, per GPU: 2.25 PFLOPS bf16 and 4.5 fp8 dense, 75 TFLOPS
    # fp32, 180 GB HBM3e at 8 TB/s, fifth-generation NVLink 1.8 TB/s; 400 Gb/s ConnectX-7 per GPU.
    # Best-shape GEMMs: 1,745 of 2,250 bf16 (77.6%), 3,432.5 of 4,500 fp8 (76.3%).
    "b200": GPU(
        "B200 180GB",
        180.0,
        2250.0,
        4500.0,
        8.0,
        900.0,
        50.0,
        (10, 0),
        fp32_tflops=75.0,
        matmul_efficiency=0.776,
        fp8_matmul_efficiency=0.763,
        nccl_nvlink_gb_s=720.0,
    ),
}

_FIELDS = {f.name: f.type for f in dataclasses.fields(GPU)}
_OPTIONAL = {
    "capability",
    "matmul_efficiency",
    "fp8_matmul_efficiency",
    "nccl_nvlink_gb_s",
    "sm_count",
    "sm_clock_ghz",
}
BOUNDS: dict[str, tuple[float, float, str]] = {
    "memory_gib": (1, 4096, "GiB"),
    "bf16_tflops": (1, 100_000, "TFLOP/s"),
    "fp8_tflops": (1, 200_000, "TFLOP/s"),
    "fp32_tflops": (0.1, 100_000, "TFLOP/s"),
    "hbm_tb_s": (0.1, 1000, "TB/s"),
    "nvlink_gb_s": (1, 100_000, "GB/s"),
    "nccl_nvlink_gb_s": (1, 100_000, "GB/s"),
    "network_gb_s": (0.1, 100_000, "GB/s"),
    "matmul_efficiency": (0.05, 1, "of the peak"),
    "sm_count": (1, 10_000, "SMs"),
    "sm_clock_ghz": (0.1, 10, "GHz"),
    "fp8_matmul_efficiency": (0.05, 1, "of the peak"),
}
"""What a GPU file's figure may be: tens to hundreds of times beyond the parts of the table either
way. A figure outside is a typo or another unit (TB/s for GB/s), and the plan's arithmetic would
overflow or give an MFU far above 100%."""
MAX_GPUS = 16_384
"""The most GPUs a plan is made for (Llama 3 405B trained on this many). The plan sets up torch's
FSDP and process groups for a world of that size on this CPU, in time that grows with it
(docs/planning.md)."""


def gpu_count_problem(gpus: int, gpus_per_node: int) -> str | None:
    """Why ``--gpus`` / ``--gpus-per-node`` cannot be planned, or None."""
    for flag, value in (("--gpus", gpus), ("--gpus-per-node", gpus_per_node)):
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
        if value > MAX_GPUS:
            return (
                f"{flag} is {value:,}; a plan is made for at most {MAX_GPUS:,} GPUs (it "
                "builds the run's FSDP and "
                "process groups for every rank on this CPU, in time that grows with the "
                "count: minutes past this)"
            )
    return None


class UnknownGPU(ValueError):
    pass


def gpu_from_file(path: Path) -> GPU:
    """A GPU described in TOML: every field of ``GPU`` (``capability`` as [major, minor]; it and the
    matmul efficiencies optional)."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UnknownGPU(f"--gpu {path}: cannot read it as TOML: {e}") from None
    unknown = sorted(set(raw) - set(_FIELDS))
    missing = sorted(set(_FIELDS) - set(raw) - _OPTIONAL)
    if unknown or missing:
        raise UnknownGPU(
            f"--gpu {path}: "
            + "; ".join(
                ([f"unknown keys {', '.join(unknown)}"] if unknown else [])
                + ([f"missing keys {', '.join(missing)}"] if missing else [])
            )
            + f" (keys: {', '.join(_FIELDS)})"
        )
    values = dict(raw)
    for key, value in values.items():
        if key == "name":
            if not isinstance(value, str):
                raise UnknownGPU(f"--gpu {path}: name must be a string")
        elif key == "capability":
            if not (
                isinstance(value, list)
                and len(value) == 2
                and all(isinstance(v, int) for v in value)
                and value[0] >= 1
                and value[1] >= 0
            ):
                raise UnknownGPU(
                    f"--gpu {path}: capability must be [major, minor] with major >= 1 and "
                    "minor >= 0, "
                    f"got {value!r}"
                )
            values[key] = tuple(value)
        elif (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not math.isfinite(value)
            or value < 0
            or (value == 0 and key != "fp8_tflops")
        ):
            raise UnknownGPU(
                f"--gpu {path}: {key} must be a finite positive number"
                f"{' (0 for none)' if key == 'fp8_tflops' else ''}, got {value!r}"
            )
        elif (
            not (key == "fp8_tflops" and value == 0)
            and not BOUNDS[key][0] <= value <= BOUNDS[key][1]
        ):
            low, high, unit = BOUNDS[key]
            raise UnknownGPU(
                f"--gpu {path}: {key} = {value!r} is outside {low:g} to {high:,g} {unit}"
                f"{' (0 for none)' if key == 'fp8_tflops' else ''}, far beyond any GPU (the "
                f"{GPUS['h100'].name} has {getattr(GPUS['h100'], key)}): a typo, or another unit?"
            )
        elif key == "sm_count":
            if value != int(value):
                raise UnknownGPU(f"--gpu {path}: sm_count must be a whole number, got {value!r}")
            values[key] = int(value)
        else:
            values[key] = float(value)
    return GPU(**values)


def find_gpu(name: str) -> GPU:
    """A GPU of the table by its short name (or a device name containing it), or one described in
    a TOML file."""
    key = name.lower()
    if key in GPUS:
        return GPUS[key]
    if key.endswith(".toml"):
        return gpu_from_file(Path(name))
    named = [gpu for short, gpu in GPUS.items() if short in key.replace(" ", "").replace("-", "")]
    if len(named) == 1:  # a device name as torch reports it, e.g. "NVIDIA H100 80GB HBM3"
        return named[0]
    raise UnknownGPU(
        f"--gpu: unknown GPU {name!r}; known: {', '.join(GPUS)}, or a TOML file describing one "
        f"(keys: {', '.join(_FIELDS)})"
    )
