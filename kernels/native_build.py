"""Building and loading our C kernels for the CPU (kernels/csrc), for kernels/native.py.

The library is built with the machine's C compiler (`$CC`, else `cc`) into Outrider's cache
folder (`$OUTRIDER_CACHE_DIR/kernels`, else `~/.cache/outrider/kernels`), named by a hash of the
sources and flags, so each machine builds it once (in about a second) and processes share it.
It comes in several builds (`VARIANTS`; `build_variant()`, native.py's `variant()`, picks the
best this CPU runs: `PREFERENCE`). The kernels' arithmetic is written once, kernels/csrc/simd.h,
and the builds differ in the instructions that do it:
- x86-64: "avx512_bf16", with the bf16 dot-product instructions and AMX, for CPUs that have
  them (Sapphire Rapids on; AMD Zen 4 lacks only AMX), and "avx512f", where each bf16 dot
  product is two fp32 FMAs, for AVX512 CPUs without them (Skylake to Ice Lake servers);
- AArch64: "sve256_bf16_i8mm" (the next one's instructions on 256-bit SVE vectors: Neoverse
  V1), "neon_bf16_i8mm" (Armv8.6's BFDOT and USDOT: NVIDIA Grace, whose SVE2 vectors are
  NEON's 128 bits, Neoverse V2) and "neon", any AArch64 CPU, with the avx512f build's
  arithmetic and bits.
`OUTRIDER_NATIVE_KERNELS=avx512f` (or `=neon`) takes the baseline build on any CPU of its
architecture (to test it), `=0` none. `python -m kernels.native` builds the library ahead and
says which runs. Where none can be had (another CPU, no compiler, a failed build), native.py's
`available()` is False and callers keep torch's kernels; its `unavailable_reason()` says why.
tests/arm64 cross-builds the AArch64 builds and runs them under qemu-user (`variant_flags`,
`compiled`).

It is compiled with OpenMP and loaded after torch, so its parallel regions run on the OpenMP
runtime torch already loaded (one thread pool, sized by `torch.get_num_threads()`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(CSRC.glob("*.c")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))
LIBRARY_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mf16c")
# Each build: its architecture (platform.machine()) and its instruction-set flags. Every
# AVX512-BF16 CPU has VNNI too; every Armv8.6 CPU with BF16 and I8MM has the dot-product
# instructions. The SVE build is for 256-bit vectors alone (fixed-length code).
VARIANTS = {
    "avx512_bf16": (
        "x86_64",
        (*AVX512_FLAGS, "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"),
    ),
    "avx512f": ("x86_64", AVX512_FLAGS),
    "sve256_bf16_i8mm": ("aarch64", ("-march=armv8.6-a+sve+bf16+i8mm", "-msve-vector-bits=256")),
    "neon_bf16_i8mm": ("aarch64", ("-march=armv8.6-a+bf16+i8mm",)),
    "neon": ("aarch64", ("-march=armv8-a",)),
}
# Per architecture, its builds in order of preference with what each needs of the CPU
# (/proc/cpuinfo's flags on x86, Features on AArch64); the last is the baseline. Grace's SVE2
# vectors are 128 bits, NEON's width, so it takes neon_bf16_i8mm.
PREFERENCE = {
    "x86_64": (("avx512_bf16", ("avx512_bf16", "avx512_vnni")), ("avx512f", ())),
    "aarch64": (
        ("sve256_bf16_i8mm", ("sve", "svebf16", "svei8mm", "bf16", "i8mm")),
        ("neon_bf16_i8mm", ("bf16", "i8mm")),
        ("neon", ()),
    ),
}
BASELINE = {machine: builds[-1][0] for machine, builds in PREFERENCE.items()}
SVE_BITS = {"sve256_bf16_i8mm": 256}  # the vector length a build's code is fixed to
ENABLE_ENV = "OUTRIDER_NATIVE_KERNELS"
REQUIRED_CPU_FLAGS = {"x86_64": ("avx512f", "avx512bw", "avx512vl"), "aarch64": ("asimd",)}
AMX_CPU_FLAGS = ("amx_tile", "amx_bf16")


class Unavailable(Exception):
    pass


@functools.cache
def load_library() -> tuple[ctypes.CDLL | None, str | None]:
    try:
        lib = ctypes.CDLL(str(build()))
    except Unavailable as e:
        reason = str(e)
    except OSError as e:
        reason = f"building or loading the kernel library failed: {e}"
    else:
        ptr, int_, float_ = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        projections = ("outrider_linear_bf16", "outrider_linear_f32")
        for name in (*projections, "outrider_linear_amx", "outrider_linear_packed"):
            fn = getattr(lib, name)
            fn.restype = None
            fn.argtypes = [ptr, ptr, ptr, ptr, int_, int_, int_, int_]
        lib.outrider_pack_bf16.restype = None
        lib.outrider_pack_bf16.argtypes = [ptr, ptr, int_, int_]
        lib.outrider_amx_init.restype = int_
        lib.outrider_amx_init.argtypes = []
        norm = lib.outrider_rms_norm_bf16
        norm.restype = None
        norm.argtypes = [ptr, ptr, ptr, float_, ptr, ptr, int_, int_, int_]
        for name in ("outrider_paged_attention_bf16", "outrider_paged_attention_f32"):
            attention = getattr(lib, name)
            attention.restype = None
            attention.argtypes = [ptr, int_, ptr, ptr, ptr, int_, ptr, ptr, ptr, int_, int_]
            attention.argtypes += [int_, int_, int_, float_, ptr, int_, int_]
        rotary = lib.outrider_rotary_kv_bf16
        rotary.restype = int_
        long_ = ctypes.c_int64
        rotary.argtypes = [ptr, int_, int_, int_, int_, int_, ptr, ptr, ptr, long_, ptr, long_]
        rotary.argtypes += [ptr, ptr, int_]
        quant = lib.outrider_linear_quant
        quant.restype = int_
        quant.argtypes = [ptr, int_, ptr, ptr, ptr, int_, int_, ptr, ptr, int_, int_, int_, int_]
        after = lib.outrider_linear_quant_after
        after.restype = int_
        after.argtypes = [int_, ptr, ptr, ptr, float_, ptr, ptr, ptr, ptr, int_, int_, ptr, ptr]
        after.argtypes += [int_, int_, int_, int_]
        lib.outrider_quantize_rows.restype = None
        lib.outrider_quantize_rows.argtypes = [ptr, int_, int_, int_, ptr, ptr, ptr]
        lookup = lib.outrider_quant_rows
        lookup.restype = None
        lookup.argtypes = [ptr, ptr, ptr, int_, int_, int_, ptr, int_, ptr]
        silu = lib.outrider_silu_mul_bf16
        silu.restype = None
        silu.argtypes = [ptr, int_, int_, int_, ptr, int_]
        layer = lib.outrider_decoder_layer
        layer.restype = int_
        layer.argtypes = [ptr] * 7
        return lib, None
    log.warning("native CPU kernels unavailable (%s); using torch's kernels", reason)
    return None, reason


@functools.cache
def amx_ready() -> bool:
    lib = load_library()[0]
    if lib is None or build_variant() != "avx512_bf16":
        return False
    if any(f not in cpu_flags() for f in AMX_CPU_FLAGS):
        return False
    if lib.outrider_amx_init() != 0:
        log.warning("Linux refused AMX tiles to this process; using AVX512 kernels")
        return False
    return True


def build() -> Path:
    """The compiled library, built now if this machine has none yet."""
    setting = os.environ.get(ENABLE_ENV, "1")
    if setting == "0":
        raise Unavailable(f"{ENABLE_ENV}=0")
    if setting not in ("1", *BASELINE.values()):
        raise Unavailable(
            f"{ENABLE_ENV} takes 0, 1, {' or '.join(BASELINE.values())}, not {setting!r}"
        )
    machine = platform.machine()
    if platform.system() != "Linux" or machine not in BASELINE:
        raise Unavailable(f"needs Linux on x86_64 or aarch64, not {platform.system()} {machine}")
    missing = [f for f in REQUIRED_CPU_FLAGS[machine] if f not in cpu_flags()]
    if missing:
        raise Unavailable(f"this CPU lacks {', '.join(missing)}")
    if setting not in ("1", BASELINE[machine]):
        raise Unavailable(f"{ENABLE_ENV}={setting} is not a build for {machine}")
    return compile_variant(build_variant())


def prebuild() -> list[Path]:
    """Every build of this machine's architecture, so that an image made on one CPU (or under
    emulation) holds the build whichever CPU of its architecture later runs it."""
    machine = platform.machine()
    return [compile_variant(v, timeout=900) for v, (arch, _) in VARIANTS.items() if arch == machine]


def compile_variant(variant: str, timeout: float = 120) -> Path:
    """The library's `variant` build for this machine's architecture, compiled now unless the
    cache holds it."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise Unavailable("no C compiler (set CC)")
    flags = variant_flags(variant)
    return compiled(
        compiler, flags, SOURCES, _cache_root() / "kernels", "outrider-cpu", ".so", timeout
    )


def compiled(
    compiler: str,
    flags: Sequence[str],
    sources: Sequence[Path],
    folder: Path,
    stem: str,
    suffix: str = "",
    timeout: float = 120,
) -> Path:
    """`sources` compiled and linked with `flags` into `folder`, named `stem`, a hash of the
    flags, the sources and kernels/csrc's headers, and `suffix`; built now unless that file is
    there. Raises Unavailable with the compiler's complaint when it fails."""
    digest = hashlib.sha256(" ".join(flags).encode())
    for source in (*sources, *HEADERS):
        digest.update(source.read_bytes())
    target = folder / f"{stem}-{digest.hexdigest()[:16]}{suffix}"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together never load half a file.
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=suffix)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, *map(str, sources), "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise Unavailable(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def build_variant() -> str:
    """The build this CPU (and OUTRIDER_NATIVE_KERNELS) calls for."""
    machine = platform.machine() if platform.machine() in PREFERENCE else "x86_64"
    if os.environ.get(ENABLE_ENV) == BASELINE[machine]:
        return BASELINE[machine]
    return next(v for v, _ in PREFERENCE[machine] if runnable(v))


def runnable(variant: str) -> bool:
    """Whether this CPU runs `variant`'s instructions (its architecture, the CPU flags it
    needs, and the SVE vector length its code is fixed to)."""
    arch = VARIANTS[variant][0]
    if platform.machine() != arch:
        return False
    needs = dict(PREFERENCE[arch])[variant]
    if any(f not in cpu_flags() for f in (*REQUIRED_CPU_FLAGS[arch], *needs)):
        return False
    return variant not in SVE_BITS or sve_vector_bits() == SVE_BITS[variant]


def sve_vector_bits() -> int:
    """This process's SVE vector length in bits (prctl PR_SVE_GET_VL), 0 without SVE."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        answer = libc.prctl(51, 0, 0, 0, 0)  # PR_SVE_GET_VL: bytes in the low 16 bits
    except (OSError, AttributeError):
        return 0
    return 8 * (answer & 0xFFFF) if answer > 0 else 0


def variant_flags(variant: str) -> tuple[str, ...]:
    """The compiler flags of a build of the library (`VARIANTS`), for its architecture's gcc."""
    return LIBRARY_FLAGS + VARIANTS[variant][1]


def _cache_root() -> Path:
    """workers.model.gguf_loader.cache_root, which this lower layer may not import."""
    if root := os.environ.get("OUTRIDER_CACHE_DIR"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "outrider"


def cpu_flags() -> set[str]:
    try:
        return cpu_flags_of(Path("/proc/cpuinfo").read_text())
    except OSError:
        return set()


def cpu_flags_of(cpuinfo: str) -> set[str]:
    """The first CPU's flags in the text of /proc/cpuinfo."""
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):  # x86, AArch64
            return set(line.split(":", 1)[1].split())
    return set()
