"""Our C kernels built for another architecture and run here: a script of kernel calls written
on x86 (`Script`), run by tests/arm64/harness.c built with the kernels for a build of
kernels/native_build.py's VARIANTS (`Machine`): natively for the x86 builds, under qemu-user
for the AArch64 ones (Debian's gcc-aarch64-linux-gnu and qemu-user; `make cross-tools`
installs them). The calls' outputs come back as tensors, to compare between machines and with
the plain-torch references.

A machine is a build and the CPU it runs on: "neon" on a Cortex-A72 (Armv8.0: no dot-product,
BF16 or int8 matrix instructions, so the build cannot have used one), "neon_bf16_i8mm" on
qemu's `max` CPU with a 128-bit and a 256-bit SVE vector length (what Grace and Graviton 3
report; the build's NEON code must not care), "sve256_bf16_i8mm" on `max` with 256-bit
vectors (Neoverse V1's).
"""

from __future__ import annotations

import functools
import os
import shutil
import struct
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels import native_build

HARNESS = Path(__file__).parent / "harness.c"
CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"


@dataclass(frozen=True)
class Machine:
    name: str  # what a test id shows
    variant: str  # a build of native_build.VARIANTS
    qemu_cpu: str | None = None  # None: this machine runs it

    def run(self, script: Script, outputs: list[Buffer]) -> tuple[list[int], list[torch.Tensor]]:
        """Each call's result and the `outputs` buffers after the calls, as tensors."""
        program = harness(self.variant)
        with tempfile.TemporaryDirectory(prefix="outrider-cross-") as tmp:
            script_path, out_path = Path(tmp) / "script", Path(tmp) / "out"
            script_path.write_bytes(script.encode(outputs))
            command = [str(program), str(script_path), str(out_path)]
            if self.qemu_cpu is not None:
                command = [QEMU, "-cpu", self.qemu_cpu, *command]
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=600, env=_omp_env()
            )
            if done.returncode != 0:
                raise RuntimeError(f"{self.name}: harness failed: {done.stderr.strip()[-2000:]}")
            raw = out_path.read_bytes()
        results = list(struct.unpack_from(f"<{len(script.calls)}q", raw))
        at, tensors = 8 * len(script.calls), []
        for buffer in outputs:
            chunk = bytearray(raw[at : at + buffer.nbytes])
            at += buffer.nbytes
            flat = torch.frombuffer(chunk, dtype=buffer.dtype) if chunk else torch.empty(0)
            tensors.append(flat.reshape(buffer.shape).clone())
        return results, tensors


@dataclass(frozen=True)
class Buffer:
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class Script:
    """Buffers (copied from tensors, or zeros) and the kernel calls that read and write them."""

    contents: list[bytes | None] = field(default_factory=list)
    buffers: list[Buffer] = field(default_factory=list)
    calls: list[tuple[str, tuple[object, ...]]] = field(default_factory=list)

    def tensor(self, t: torch.Tensor) -> Buffer:
        t = t.detach().contiguous().cpu()
        data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return self._add(t.dtype, tuple(t.shape), data)

    def zeros(self, *shape: int, dtype: torch.dtype) -> Buffer:
        return self._add(dtype, shape, None)

    def call(self, kernel: str, *args: object) -> None:
        """A call of `kernel` (a function of kernels/csrc, by its C name) with buffers (their
        first byte), None (NULL), ints and floats, in the C signature's order."""
        self.calls.append((kernel, args))

    def _add(self, dtype: torch.dtype, shape: tuple[int, ...], data: bytes | None) -> Buffer:
        nbytes = dtype.itemsize * int(torch.tensor(shape).prod().item()) if shape else 0
        buffer = Buffer(len(self.buffers), dtype, shape, nbytes)
        self.buffers.append(buffer)
        self.contents.append(data)
        return buffer

    def encode(self, outputs: list[Buffer]) -> bytes:
        parts = [struct.pack("<I", len(self.buffers))]
        for buffer, data in zip(self.buffers, self.contents, strict=True):
            parts.append(struct.pack("<QB", buffer.nbytes, data is not None))
            parts.append(data or b"")
        parts.append(struct.pack("<I", len(self.calls)))
        for name, args in self.calls:
            parts.append(
                struct.pack("<H", len(name)) + name.encode() + struct.pack("<B", len(args))
            )
            for arg in args:
                parts.append(_encode_arg(arg))
        parts.append(
            struct.pack("<I", len(outputs)) + b"".join(struct.pack("<I", b.index) for b in outputs)
        )
        return b"".join(parts)


def _encode_arg(arg: object) -> bytes:
    if isinstance(arg, Buffer):  # a pointer to its first byte
        return b"p" + struct.pack("<IQ", arg.index, 0)
    if arg is None:
        return b"n"
    if isinstance(arg, bool) or not isinstance(arg, int | float):
        raise TypeError(f"a kernel argument cannot be {arg!r}")
    if isinstance(arg, int):
        return b"i" + struct.pack("<q", arg)
    return b"f" + struct.pack("<f", arg)


def missing_tools() -> str | None:
    """Why the AArch64 builds cannot run here, or None when they can."""
    absent = [tool for tool in (CROSS_CC, QEMU) if shutil.which(tool) is None]
    if absent:
        return f"{' and '.join(absent)} not installed (make cross-tools)"
    return None


def prepare(variants: list[str]) -> None:
    """Build the harnesses of `variants` side by side (a build is one compiler process; the
    AArch64 ones take half a minute each)."""
    with ThreadPoolExecutor(max_workers=len(variants) or 1) as pool:
        list(pool.map(harness, variants))


@functools.cache
def harness(variant: str) -> Path:
    """The harness and the kernels built for `variant`, once per sources and flags."""
    arch = native_build.VARIANTS[variant][0]
    compiler = CROSS_CC if arch == "aarch64" else os.environ.get("CC", "cc")
    flags = [f for f in native_build.variant_flags(variant) if f not in ("-shared", "-fPIC")]
    if arch == "aarch64":
        flags.append("-static")  # qemu-user then needs no AArch64 loader or libraries
    sources = [*native_build.SOURCES, HARNESS]
    folder = native_build._cache_root() / "cross"
    return native_build.compiled(
        compiler, flags, sources, folder, f"harness-{variant}", timeout=600
    )


def _omp_env() -> dict[str, str]:
    """Two OpenMP threads, so the kernels' work sharing runs as it does on a real host."""
    return {**os.environ, "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "passive"}
