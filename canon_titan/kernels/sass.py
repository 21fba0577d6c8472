"""The SASS a Triton kernel launch runs on a GPU that need not be here, counted by instruction
class.

A launch is recorded, not run (``record_launches``: meta tensors serve as arguments); Triton
compiles it for the target (sm_90 by default: H100/H200) at each configuration it may run with
(``Launch.configs``: every autotuning candidate its own pruning keeps, heuristics applied), its
bundled ptxas reports registers and spills, and its bundled nvdisasm gives the SASS. ``analyse``
counts the program's instructions by class (``CLASSES``) in its straight code and in each loop's
body; ``execute`` turns them into what the launch executes from its grid and its loops' trip
counts, which come from the kernel's TTGIR (``trips``: the loop bounds' integer arithmetic on the
launch's arguments and every program's ids), matched through the PTX's loops to those ptxas made.
The programs an early ``return`` ends come from the TTGIR the same way.

    from canon_titan.kernels import sass

    run = lambda: canon.swiglu_backward(dy, gate, up, weight, None, True, False)
    for launch in sass.record_launches(run):
        for config in launch.configs():
            counted = sass.count(launch, config)
            counted.registers, counted.spill_store_bytes
            counted.loop_instructions()  # per loop: class -> instructions of one iteration
            counted.executed             # class -> warp instructions of the whole launch
            counted.per_element(n)       # class -> thread instructions per element of n

What it assumes: every instruction of a loop's body runs on each iteration, and every instruction
of the straight code in each program that reaches it (both sides of a branch there are counted; a
masked-off lane still issues). Loops the compilers reshaped past matching (versions of one loop,
unrolled on top) are counted by their memory instructions (``Executed.matched`` is then False). A
trip count that depends on loaded data (variable-length sequences) is not known: ``execute`` raises
``trips.UnknownTrips``.

It runs the real Triton, so not under ``TRITON_INTERPRET=1`` (``KernelInterface`` there is Triton's
interpreter's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import re
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

import torch
import triton
from torch._library.triton import set_wrap_triton_enabled
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.jit import JITFunction, KernelInterface, create_function_from_signature

from canon_titan.kernels.trips import (
    EXIT_REACH,
    UnknownTrips,
    align,
    evaluate,
    nest,
    ptx_loops,
    skeleton,
)
from canon_titan.kernels.trips import iterations as loop_iterations

SM90 = GPUTarget("cuda", 90, 32)

CLASSES = (
    "int",
    "fp32",
    "fp16",
    "mufu",
    "convert",
    "mma",
    "load",
    "store",
    "shared",
    "local",
    "uniform",
    "barrier",
    "control",
    "other",
)
"""Instruction classes: integer and logic (with moves, selects and predicates), fp32 arithmetic and
comparisons, packed fp16/bf16, the special-function unit (exp2, reciprocal, ...), conversions,
tensor-core MMA/WGMMA, global loads (async copies and TMA included) and stores (atomics included),
shared memory, local memory (spills), the uniform datapath (one per warp: scalar arithmetic,
constant loads), barriers and fences, branches and exits, the rest."""

_CLASS_OF = {
    **dict.fromkeys(
        (
            "IMAD",
            "IADD3",
            "IADD",
            "IADD32I",
            "LEA",
            "LOP3",
            "LOP",
            "LOP32I",
            "SHF",
            "SHL",
            "SHR",
            "ISETP",
            "IMNMX",
            "IABS",
            "POPC",
            "FLO",
            "BREV",
            "SEL",
            "PRMT",
            "BMSK",
            "SGXT",
            "ICMP",
            "IDP",
            "IDP4A",
            "VIADD",
            "VIMNMX",
            "VIMNMX3",
            "VIADDMNMX",
            "ISCADD",
            "IMUL",
            "MOV",
            "MOV32I",
            "PLOP3",
            "P2R",
            "R2P",
            "CS2R",
            "S2R",
            "CSET",
            "CSETP",
            "PSETP",
            "IMAD32I",
            "BFE",
            "BFI",
            "VABSDIFF",
            "VABSDIFF4",
            "LEPC",
            "FSWZADD",
        ),
        "int",
    ),
    **dict.fromkeys(
        (
            "FFMA",
            "FADD",
            "FMUL",
            "FFMA32I",
            "FADD32I",
            "FMUL32I",
            "FMNMX",
            "FSET",
            "FSETP",
            "FSEL",
            "FCHK",
            "FCMP",
            "FMNMX3",
            "FADD2",
            "FFMA2",
            "FMUL2",
        ),
        "fp32",
    ),
    **dict.fromkeys(
        ("HADD2", "HMUL2", "HFMA2", "HMNMX2", "HSETP2", "HSET2", "HADD2_F32", "HFMA2_MMA"), "fp16"
    ),
    "MUFU": "mufu",
    **dict.fromkeys(("F2F", "F2I", "I2F", "I2I", "F2FP", "FRND", "I2FP", "F2IP"), "convert"),
    **dict.fromkeys(("HMMA", "HGMMA", "IMMA", "IGMMA", "QGMMA", "DMMA", "BMMA", "BGMMA"), "mma"),
    **dict.fromkeys(
        ("LDG", "LD", "LDGSTS", "LDGDEPBAR", "UTMALDG", "UBLKCP", "UTMAPF", "UBLKPF", "CCTL"),
        "load",
    ),
    **dict.fromkeys(
        ("STG", "ST", "RED", "REDG", "ATOM", "ATOMG", "UTMASTG", "UTMAREDG", "REDAS"), "store"
    ),
    **dict.fromkeys(("LDS", "STS", "LDSM", "STSM", "ATOMS", "LDSLK", "STSCUL"), "shared"),
    **dict.fromkeys(("LDL", "STL"), "local"),
    **dict.fromkeys(
        (
            "BAR",
            "WARPSYNC",
            "SYNCS",
            "MEMBAR",
            "DEPBAR",
            "ERRBAR",
            "FENCE",
            "WARPGROUP",
            "ARRIVES",
            "ELECT",
        ),
        "barrier",
    ),
    **dict.fromkeys(
        (
            "BRA",
            "BRX",
            "JMP",
            "JMX",
            "EXIT",
            "BSSY",
            "BSYNC",
            "CALL",
            "RET",
            "BREAK",
            "YIELD",
            "NOP",
            "KILL",
            "BPT",
        ),
        "control",
    ),
}


def instruction_class(opcode: str) -> str:
    """The class (``CLASSES``) of a SASS opcode (its name before the first dot)."""
    base = opcode.split(".")[0]
    if base in _CLASS_OF:
        return _CLASS_OF[base]
    if base == "LDC":  # a constant load into a register
        return "int"
    if base.startswith("U") or base in ("R2UR", "S2UR"):  # the uniform datapath
        return "uniform"
    if base in ("SHFL", "VOTE", "VOTEU", "MATCH", "REDUX"):
        return "int"
    return "other"


# ---------------------------------------------------------------------------------------------
# launches


@dataclass
class Config:
    """One configuration a launch may run with: the keyword arguments its kernel gets (the launch's
    own, the autotuning candidate's meta-parameters and options, the heuristics' values)."""

    kwargs: dict
    label: str
    """The candidate's part of it, e.g. ``BLOCK_T=16, BLOCK_C=32, 4 warps, 3 stages``."""


@dataclass
class Launch:
    """``kernel[grid](*args, **kwargs)`` as a program made it (``record_launches``)."""

    kernel: KernelInterface
    """The object launched: a ``JITFunction``, or the autotuner or heuristics around one."""
    grid: object
    args: tuple
    kwargs: dict

    @property
    def function(self) -> JITFunction:
        return jit_function(self.kernel)

    @property
    def name(self) -> str:
        return self.function.__name__

    def configs(self) -> list[Config]:
        """Every configuration the launch may run with: each candidate its autotuner keeps after its
        own pruning (``early_config_prune``; a performance model, which needs a GPU, is not asked),
        with the heuristics around and inside it applied; the launch's own arguments for a plain
        kernel."""
        return _expand(self.kernel, self.args, dict(self.kwargs), {})

    def bound_args(self, config: Config) -> dict:
        """Every parameter of the kernel by name, defaults included, as the configuration calls
        it."""
        bound = self.function.signature.bind(
            *self.args,
            **{k: v for k, v in config.kwargs.items() if k in self.function.signature.parameters},
        )
        bound.apply_defaults()
        return dict(bound.arguments)

    def programs(self, config: Config) -> tuple[int, int, int]:
        """The grid (x, y, z) the launch runs with ``config``."""
        grid = self.grid
        if callable(grid):
            grid = grid({**self.bound_args(config), **config.kwargs})
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(tuple(grid)))
        return grid[:3]

    def bytes(self) -> int:
        """What its tensor arguments hold, each distinct tensor (storage, offset, shape, strides)
        once: the bytes the kernel reads and writes if it touches each element of each argument
        once."""
        views = {}
        for a in (*self.args, *self.kwargs.values()):
            if isinstance(a, torch.Tensor):
                views[(id(a.untyped_storage()), a.storage_offset(), tuple(a.shape), a.stride())] = a
        return sum(t.numel() * t.element_size() for t in views.values())


def jit_function(kernel) -> JITFunction:
    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


def _label(kwargs: dict) -> str:
    options = {
        "num_warps": "warps",
        "num_stages": "stages",
        "num_ctas": "CTAs",
        "maxnreg": "max registers",
    }
    parts = [f"{k}={v}" for k, v in kwargs.items() if k not in options and v is not None]
    parts += [
        f"{kwargs[k]} {name}"
        for k, name in options.items()
        if kwargs.get(k) is not None and not (k == "num_ctas" and kwargs[k] == 1)
    ]
    return ", ".join(parts)


def _expand(obj, args: tuple, kwargs: dict, chosen: dict) -> list[Config]:
    if isinstance(obj, JITFunction):
        return [Config(kwargs, _label(chosen))]
    if isinstance(obj, Heuristics):
        kwargs = dict(kwargs)
        for name, heuristic in obj.values.items():
            kwargs[name] = heuristic({**dict(zip(obj.arg_names, args)), **kwargs})
        return _expand(obj.fn, args, kwargs, chosen)
    if isinstance(obj, Autotuner):
        configs = obj.configs
        if len(configs) > 1 and obj.early_config_prune:
            configs = obj.early_config_prune(configs, dict(zip(obj.arg_names, args)), **kwargs)
        out = []
        for config in configs:
            meta = config.all_kwargs()
            out += _expand(obj.fn, args, {**kwargs, **meta}, {**chosen, **meta})
        return out
    return _expand(obj.fn, args, kwargs, chosen)


def record_launches(run) -> list[Launch]:
    """Every Triton kernel launch ``run()`` makes (``kernel[grid](...)``, directly or through
    ``torch.library.wrap_triton`` outside tracing), none of them run: the kernel launches return
    None. Host code that reads an autotuner's choice after a launch (mamba-ssm sizes a buffer by it)
    finds its first candidate."""
    launches: list[Launch] = []
    chose: list[Autotuner] = []
    original = KernelInterface.__getitem__

    def getitem(kernel, grid):
        def launch(*args, **kwargs):
            launches.append(Launch(kernel, grid, args, kwargs))
            tuner = kernel
            while not isinstance(tuner, JITFunction):
                if isinstance(tuner, Autotuner) and getattr(tuner, "best_config", None) is None:
                    tuner.best_config = tuner.configs[0]
                    chose.append(tuner)
                tuner = tuner.fn

        return launch

    KernelInterface.__getitem__ = getitem
    try:
        with set_wrap_triton_enabled(False):  # a triton_op's body then calls kernel[grid] itself
            run()
    finally:
        KernelInterface.__getitem__ = original
        for tuner in chose:
            tuner.best_config = None
    return launches


# ---------------------------------------------------------------------------------------------
# compiling


_PTXAS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def source(launch: Launch, config: Config, target: GPUTarget = SM90):
    """What Triton compiles for the launch with ``config``, specialised on its arguments as the JIT
    would (ints equal to 1 become constants; multiples of 16 and 16-byte-aligned pointers get
    divisibility hints): the ``ASTSource`` and its options."""
    fn = launch.function
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*launch.args, **config.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, config.kwargs, bound_args, specialization, options
    )
    return ASTSource(fn, signature, constexprs, attrs), options


def compile_key(launch: Launch, config: Config, target: GPUTarget = SM90) -> str:
    """What identifies the compiled code: the source's hash (the kernel's and its callees' source,
    the constants and specialisations), the options, the target and Triton's version."""
    src, options = source(launch, config, target)
    text = json.dumps(
        [src.hash(), str(sorted(options.__dict__.items())), target.arch, triton.__version__]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass
class Compiled:
    asm: dict
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int
    num_warps: int
    seconds: float
    """Triton's compile of it on this machine, ptxas included."""


def compile_launch(launch: Launch, config: Config, target: GPUTarget = SM90) -> Compiled:
    """The launch compiled with ``config``, in a cache of its own (so that ptxas runs and
    reports)."""
    src, options = source(launch, config, target)
    log = io.StringIO()
    with tempfile.TemporaryDirectory() as cache:
        previous, dumped = triton.knobs.cache.dir, triton.knobs.nvidia.dump_ptxas_log
        triton.knobs.cache.dir, triton.knobs.nvidia.dump_ptxas_log = cache, True
        try:
            started = time.perf_counter()
            with contextlib.redirect_stdout(log):
                compiled = triton.compile(src, target=target, options=options.__dict__)
            seconds = time.perf_counter() - started
        finally:
            triton.knobs.cache.dir, triton.knobs.nvidia.dump_ptxas_log = previous, dumped
    registers, spill = _PTXAS.search(log.getvalue()), _SPILL.search(log.getvalue())
    if registers is None or spill is None:
        raise RuntimeError(f"no ptxas report for {src.name}:\n{log.getvalue()}")
    return Compiled(
        dict(compiled.asm),
        int(registers.group(1)),
        int(spill.group(1)),
        int(spill.group(2)),
        int(spill.group(3)),
        int(compiled.metadata.shared),
        int(compiled.metadata.num_warps),
        seconds,
    )


def disassemble(cubin: bytes) -> str:
    """nvdisasm's SASS of a cubin (the nvdisasm Triton bundles)."""
    tool = triton.knobs.nvidia.nvdisasm.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run(
            [str(tool), "-c", f.name], capture_output=True, text=True, check=True
        ).stdout


# --------------------------------------------------------------------------------------------- SASS


_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)(.*?);")
_LABEL = re.compile(r"^(\.L_x_\d+|\$\S+?):")
_TARGET = re.compile(r"`\(([^)]+)\)")


@dataclass
class _Instruction:
    address: int
    opcode: str
    predicated: bool
    operands: str


def _parse_sass(text: str) -> tuple[list[_Instruction], dict[str, int]]:
    instructions, labels, pending = [], {}, []
    for line in text.splitlines():
        line = line.strip()
        if m := _LABEL.match(line):
            pending.append(m.group(1))
            continue
        if m := _INSTRUCTION.match(line):
            address = int(m.group(1), 16)
            for label in pending:
                labels[label] = address
            pending = []
            instructions.append(
                _Instruction(address, m.group(3), bool(m.group(2)), m.group(4).strip())
            )
    return instructions, labels


@dataclass
class Region:
    """Instructions counted together: the straight code between two early exits, or a loop's own
    body (its nested loops apart)."""

    loop: int | None
    """Index of the loop (in ``Code.loops``) whose body it is; None for straight code."""
    after_exits: int
    """For straight code: how many early exits precede it."""
    counts: dict[str, int]


@dataclass
class Code:
    """A compiled kernel's SASS counted, and what it needs to know its trip counts (JSON-able:
    cached)."""

    name: str
    config: str
    num_warps: int
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int
    compile_seconds: float
    static: dict[str, int]
    """Every instruction of the program (subroutines and padding left out), by class."""
    loops: list[dict]
    """Each SASS loop: ``parent`` (index or None), ``start``/``end`` addresses, ``counts`` (its own
    body by class), ``size`` and ``memory`` (its memory and MMA instructions, ``_MEMORY``)."""
    ptx_loops: list[dict]
    """The PTX's loops (``trips.ptx_loops``): between the TTGIR's and the SASS's."""
    regions: list[Region]
    exits_at: list[float]
    """Where each early exit (a predicated EXIT in the straight code, before its end) stands, 0 to
    1."""
    mma_flops: float
    """bf16-equivalent FLOPs of one pass over the program's MMA instructions (``_mma_flops``); an
    executed total follows as the MMA instruction counts do."""
    mma_per_warpgroup: bool
    skeleton: list
    """The TTGIR's control flow and scalar arithmetic (``trips.skeleton``)."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Code:
        data = dict(data)
        data["regions"] = [Region(**r) for r in data["regions"]]
        return cls(**data)


def _loops(instructions: list[_Instruction], labels: dict[str, int]) -> list[dict]:
    """Loops as backward branches (``trips.nest``)."""
    return nest(
        [
            (labels[m.group(1)], ins.address)
            for ins in instructions
            if ins.opcode.startswith("BRA")
            and (m := _TARGET.search(ins.operands))
            and labels.get(m.group(1), ins.address + 1) <= ins.address
        ]
    )


_MEMORY = {
    "LDG",
    "STG",
    "LDS",
    "STS",
    "LDSM",
    "STSM",
    "LDGSTS",
    "ATOM",
    "ATOMG",
    "ATOMS",
    "RED",
    "REDG",
    "HMMA",
    "HGMMA",
    "IMMA",
    "QGMMA",
    "IGMMA",
}
"""The SASS instructions that match PTX's memory and MMA instructions one to one
(``trips.ptx_loops``): the measure of how many times ptxas unrolled a loop."""


def _unrolled(ptx_loop: dict, sass_loop: dict) -> int:
    """How many iterations of the PTX loop one iteration of the SASS loop makes (ptxas's
    unrolling)."""
    if not ptx_loop["memory"] or sass_loop["memory"] < 1.5 * ptx_loop["memory"]:
        return 1
    return round(sass_loop["memory"] / ptx_loop["memory"])


def _body(instructions: list[_Instruction], labels: dict[str, int]) -> list[_Instruction]:
    """The kernel's own instructions: without the subroutines it calls (ptxas's slow paths of
    division and square roots, placed after its exits) and the padding after its end."""
    callees = {
        labels[m.group(1)]
        for ins in instructions
        if ins.opcode.startswith("CALL")
        and (m := _TARGET.search(ins.operands))
        and m.group(1) in labels
    }
    end = min(callees) if callees else None
    out = []
    for ins in instructions:
        if end is not None and ins.address >= end:
            break
        if (
            ins.opcode.startswith("BRA")
            and (m := _TARGET.search(ins.operands))
            and labels.get(m.group(1)) == ins.address
        ):
            break  # the branch to itself that ends the kernel's text
        out.append(ins)
    return out


_MMA_SHAPE = re.compile(r"^(HMMA|IMMA|DMMA)\.(\d)(\d)(\d+)")
_GMMA_SHAPE = re.compile(r"^(HGMMA|QGMMA|IGMMA|BGMMA)\.(\d+)x(\d+)x(\d+)")


_PEAK_SHARE = {"TF32": 0.5, "E4M3": 2.0, "E5M2": 2.0, "S8": 2.0, "F64": 1 / 16}
"""Tensor-core rate of an MMA's operand type against bf16's (Hopper: TF32 at half, 8-bit at
twice)."""


def _mma_flops(opcode: str) -> tuple[float, bool]:
    """bf16-equivalent FLOPs of one MMA instruction (the FLOPs over the operand type's rate against
    bf16's) of one warp (an HMMA.16816: m16 n8 k16), or of one warpgroup for Hopper's warpgroup MMAs
    (HGMMA.64x128x16: each of its 4 warps issues it), and whether it is the latter."""
    share = next((v for k, v in _PEAK_SHARE.items() if f".{k}" in opcode), 1.0)
    if m := _GMMA_SHAPE.match(opcode):
        return 2 * int(m.group(2)) * int(m.group(3)) * int(m.group(4)) / share, True
    if m := _MMA_SHAPE.match(opcode):
        digits = m.group(2) + m.group(3) + m.group(4)  # "16816" -> 16, 8, 16; "1688" -> 16, 8, 8
        shape = (int(digits[:2]), int(digits[2]), int(digits[3:]))
        return 2 * shape[0] * shape[1] * shape[2] / share, False
    return 0.0, False


def analyse(compiled: Compiled, name: str, config: str) -> Code:
    """``compiled``'s SASS counted by class: the whole program, each loop's own body, the straight
    code between early exits; and the TTGIR's control skeleton."""
    instructions, labels = _parse_sass(disassemble(compiled.asm["cubin"]))
    body = _body(instructions, labels)
    loops = _loops(body, labels)

    for loop in loops:
        loop["memory"] = 0

    def innermost(address: int) -> int | None:
        found = None
        for i, loop in enumerate(loops):
            if loop["start"] <= address <= loop["end"]:
                found = i  # later loops are nested deeper (outer first)
        return found

    static: Counter = Counter()
    straight: list[Counter] = [Counter()]
    loop_counts = [Counter() for _ in loops]
    flops, per_warpgroup = 0.0, False
    last_straight = max((ins.address for ins in body if innermost(ins.address) is None), default=0)
    exits_at = []
    for position, ins in enumerate(body):
        cls = instruction_class(ins.opcode)
        static[cls] += 1
        mma, grouped = _mma_flops(ins.opcode)
        flops += mma
        per_warpgroup |= grouped
        loop = innermost(ins.address)
        if loop is not None:
            loop_counts[loop][cls] += 1
            loops[loop]["memory"] += ins.opcode.split(".")[0] in _MEMORY
            continue
        straight[-1][cls] += 1
        early = ins.opcode == "EXIT" and ins.predicated and ins.address < last_straight
        if early:
            straight.append(Counter())
            exits_at.append(position / len(body))
    for loop, counts in zip(loops, loop_counts):
        loop["counts"], loop["size"] = dict(counts), sum(counts.values())
    regions = [Region(None, i, dict(c)) for i, c in enumerate(straight)]
    regions += [Region(i, 0, dict(c)) for i, c in enumerate(loop_counts)]
    return Code(
        name,
        config,
        compiled.num_warps,
        compiled.registers,
        compiled.stack_bytes,
        compiled.spill_store_bytes,
        compiled.spill_load_bytes,
        compiled.shared_bytes,
        compiled.seconds,
        dict(static),
        loops,
        ptx_loops(compiled.asm["ptx"]),
        regions,
        exits_at,
        flops,
        per_warpgroup,
        skeleton(compiled.asm["ttgir"]),
    )


# ---------------------------------------------------------------------------------------------
# executing


@dataclass
class Executed:
    """What one launch executes: every program, every warp."""

    programs: int
    num_warps: int
    executed: dict[str, float]
    """Class -> warp instructions of the whole launch."""
    per_program: dict[str, float]
    """Class -> instructions one warp of an average program issues."""
    loop_iterations: list[float]
    """Per SASS loop, its iterations summed over the programs (each warp runs them all)."""
    mma_flops: float
    """Tensor-core FLOPs of the launch, bf16-equivalent, as its MMA instructions count them."""
    matched: bool = True
    """Whether the SASS's loops were matched to the TTGIR's one by one (else ``_by_memory``)."""


def _by_memory(trips: list[dict], ptx: list[dict], sass: list[dict]) -> list[float]:
    """Iterations of the SASS's loops where the compilers reshaped them past matching (versions of
    one loop, unrolling on top): the innermost TTGIR loops' iterations, each making the memory
    instructions of an innermost PTX loop (the smallest, a version's), shared out over the innermost
    SASS loops by their memory instructions; an outer SASS loop once per program's pass."""
    leaves = [i for i in range(len(sass)) if not any(x["parent"] == i for x in sass)]
    tt_leaves = [i for i in range(len(trips)) if not any(x["parent"] == i for x in trips)]
    ptx_leaves = [x["memory"] for i, x in enumerate(ptx) if not any(y["parent"] == i for y in ptx)]
    per_iteration = min((m for m in ptx_leaves if m), default=0)
    total = sum(loop_iterations(trips[i]["histogram"]) for i in tt_leaves)
    memory = sum(sass[i]["memory"] for i in leaves)
    out = []
    for i, _loop in enumerate(sass):
        if i in leaves and memory and per_iteration:
            out.append(total * per_iteration / memory)
        else:
            out.append(total / max(len(leaves), 1) if i in leaves else 0.0)
    return out


def execute(code: Code, arguments: dict, grid: tuple[int, int, int]) -> Executed:
    """``code`` run as one launch with ``arguments`` (the kernel's, by name) on ``grid``."""
    trips = evaluate(code.skeleton, arguments, grid)
    programs = trips.programs
    matched = True
    try:
        machine = (
            align(align(trips.loops, code.ptx_loops), code.loops, _unrolled) if code.loops else []
        )
        iterations = [loop_iterations(m["histogram"]) for m in machine]
    except UnknownTrips:
        if not trips.loops:
            raise
        iterations, matched = _by_memory(trips.loops, code.ptx_loops, code.loops), False
    survivors = [float(programs)]
    returns = list(trips.survivors)
    for at in code.exits_at:
        # ptxas merges and moves early returns: an exit stands for the TTGIR's returns before its
        # own place in the program, or a little after it
        running = survivors[-1]
        while returns and returns[0][0] <= at + EXIT_REACH:
            running = returns.pop(0)[1]
        survivors.append(running)
    executed: Counter = Counter()
    for region in code.regions:
        runs = iterations[region.loop] if region.loop is not None else survivors[region.after_exits]
        for cls, n in region.counts.items():
            executed[cls] += n * runs * code.num_warps
    # MMA FLOPs scale as the MMA instructions do
    static_mma = code.static.get("mma", 0)
    flops = (
        code.mma_flops / static_mma * executed["mma"] / (4 if code.mma_per_warpgroup else 1)
        if static_mma
        else 0.0
    )
    per_program = (
        {cls: n / programs / code.num_warps for cls, n in executed.items()} if programs else {}
    )
    return Executed(
        programs, code.num_warps, dict(executed), per_program, iterations, flops, matched
    )


@dataclass
class Counted:
    """A launch at one configuration: its code and what the launch executes."""

    launch: Launch
    config: Config
    code: Code
    run: Executed

    @property
    def registers(self) -> int:
        return self.code.registers

    @property
    def spill_store_bytes(self) -> int:
        return self.code.spill_store_bytes

    @property
    def spill_load_bytes(self) -> int:
        return self.code.spill_load_bytes

    @property
    def executed(self) -> dict[str, float]:
        return self.run.executed

    @property
    def programs(self) -> int:
        return self.run.programs

    def loop_instructions(self) -> list[dict[str, int]]:
        """Each SASS loop's own body by class: the instructions of one iteration of one warp."""
        return [loop["counts"] for loop in self.code.loops]

    def per_element(self, elements: int) -> dict[str, float]:
        """Class -> thread instructions per element (warp instructions x 32 over ``elements``)."""
        return {cls: 32 * n / elements for cls, n in self.executed.items()}


def count(launch: Launch, config: Config, target: GPUTarget = SM90) -> Counted:
    """``launch`` with ``config`` compiled, counted and executed."""
    code = analyse(compile_launch(launch, config, target), launch.name, config.label)
    return Counted(
        launch, config, code, execute(code, launch.bound_args(config), launch.programs(config))
    )
