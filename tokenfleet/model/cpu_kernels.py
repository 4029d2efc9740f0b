"""The C++ paged decode-attention kernel for CPUs, compiled once per environment on first use.

The build lives in a folder of its own per environment (sys.prefix), Python, PyTorch version, CPU (it is compiled
with -march=native) and kernel source, under $TOKENFLEET_KERNEL_CACHE (default ~/.cache/tokenfleet/kernels): two
environments never share one, nor overwrite each other's, and a new PyTorch gets a fresh build. A file lock there
makes processes that start together build it once; the others wait for it, saying so.

Set TOKENFLEET_CPU_KERNELS=0 to use the pure-PyTorch path instead; if compiling fails (no compiler, no ninja)
the engine logs why and falls back to that path too.

A server need not wait for the compiler: after build_in_background(), decode_kernel_build() compiles in a builder
process of its own while the engine serves on the PyTorch path, and the engine switches once the op is loaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import hashlib
import logging
import mmap
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
LIBRARY_NAME = "tokenfleet_cpu_kernels"
# fast-math lets GCC use vectorized expf in the softmax; the kernel only sees finite values
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math")
EXPECTED_BUILD = "usually 10-30 s"
DONE_MARK = "built"  # written after a build succeeded: the library next to it is complete
BUILD_LOG = "build.log"  # what background builds said
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14+
PAGE = mmap.PAGESIZE
DecodeOp = Callable[..., torch.Tensor]
_background = threading.Event()  # set by build_in_background(): this process's engines do not wait for a build


@cache
def paged_decode_attention_op() -> DecodeOp | None:
    """The compiled op (loaded once per process, built once per environment), or None when disabled or
    unavailable."""
    if os.environ.get("TOKENFLEET_CPU_KERNELS", "1") == "0":
        return None
    try:
        load_kernel(kernel_dir())
    except Exception as e:  # a missing compiler must not stop the engine
        log.warning("CPU attention kernel unavailable, using the PyTorch path: %s", e)
        return None
    return torch.ops.tokenfleet.paged_decode_attention


def build_in_background() -> None:
    """From now on in this process, an engine that finds the kernel unbuilt serves on the PyTorch path while it
    compiles (what a server wants: its first answer need not wait for a compiler). Otherwise an engine waits for
    the build, so that it starts on the kernel."""
    _background.set()


def decode_kernel_build() -> Future[DecodeOp | None]:
    """The op as a future: resolved at once when the kernel is disabled, already built for this environment (then
    loaded here) or when builds are not in the background; otherwise resolved once a builder process has compiled
    it (None if that fails)."""
    build: Future[DecodeOp | None] = Future()
    if not (_background.is_set() and needs_build()):
        build.set_result(paged_decode_attention_op())
        return build
    folder = kernel_dir()
    log.info(
        "compiling the CPU attention kernel for this environment in the background (once; %s; cached in %s): "
        "decoding on the PyTorch path until it is ready",
        EXPECTED_BUILD,
        folder,
    )
    builder = start_builder(folder)
    threading.Thread(
        target=_resolve_when_built, args=(build, builder, folder), name="tokenfleet-kernel-build", daemon=True
    ).start()
    return build


def start_builder(folder: Path) -> subprocess.Popen[bytes]:
    """`python -m tokenfleet.model.cpu_kernels FOLDER` in a session of its own, logging to FOLDER/build.log: a
    build outlives the server that started it (a Ctrl-C a few seconds after the first answer does not throw the
    compile away), and it holds the folder's lock, so a later start waits for it rather than compiling beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / BUILD_LOG, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", __name__, str(folder)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _resolve_when_built(build: Future[DecodeOp | None], builder: subprocess.Popen[bytes], folder: Path) -> None:
    started = time.monotonic()
    if builder.wait() != 0 or not (folder / DONE_MARK).is_file():
        log.warning(
            "CPU attention kernel unavailable, using the PyTorch path: %s (see %s)",
            last_line(folder / BUILD_LOG),
            folder / BUILD_LOG,
        )
        build.set_result(None)
        return
    log.info("CPU attention kernel compiled in %.0f s, in the background", time.monotonic() - started)
    build.set_result(paged_decode_attention_op())  # loads the library; never raises (a failure is None, logged)


def last_line(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = path.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no output"
    return "no output"


def needs_build() -> bool:
    """Whether the kernel is enabled and not yet built in this environment's folder."""
    return os.environ.get("TOKENFLEET_CPU_KERNELS", "1") != "0" and not (kernel_dir() / DONE_MARK).is_file()


def kernel_cache_root() -> Path:
    configured = os.environ.get("TOKENFLEET_KERNEL_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenfleet" / "kernels"


def kernel_dir() -> Path:
    """This environment's build folder: named by Python and PyTorch version, keyed by everything a build depends
    on."""
    parts = (sys.prefix, sys.version, torch.__version__, cpu_signature(), SOURCE.read_text(), *CFLAGS)
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return kernel_cache_root() / f"{python}-torch{torch.__version__}-{key}"


def cpu_signature() -> str:
    """What -march=native compiles for: the machine and its CPU's feature flags."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                return platform.machine() + " " + line.strip()
    return platform.machine()


def load_kernel(folder: Path) -> None:
    """Loads the library built in `folder`, building it first (once, under the folder's lock) when missing."""
    library = folder / f"{LIBRARY_NAME}.so"
    if (folder / DONE_MARK).is_file():
        torch.ops.load_library(str(library))
        return
    folder.mkdir(parents=True, exist_ok=True)
    with build_lock(folder):
        if (folder / DONE_MARK).is_file():  # built by the process we waited for
            torch.ops.load_library(str(library))
        else:
            compile_kernel(folder)


@contextlib.contextmanager
def build_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on the build folder; the kernel released it if its holder dies, unlike torch's own lock
    file."""
    with open(folder / "build.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process compiling the CPU attention kernel in %s", folder)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def compile_kernel(folder: Path) -> None:
    """Compiles and loads the library (torch.ops.tokenfleet); call with the folder's lock held."""
    from torch.utils.cpp_extension import load

    log.info("compiling the CPU attention kernel for this environment (once; %s; cached in %s)", EXPECTED_BUILD, folder)
    (folder / "lock").unlink(missing_ok=True)  # torch's own lock file, left behind by a build that was killed
    started = time.monotonic()
    load(
        name=LIBRARY_NAME,
        sources=[str(SOURCE)],
        extra_cflags=list(CFLAGS),
        build_directory=str(folder),
        is_python_module=False,
        verbose=False,
    )
    (folder / DONE_MARK).write_text(f"{torch.__version__}\n")
    log.info("CPU attention kernel compiled in %.0f s", time.monotonic() - started)


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Asks Linux to back a large CPU tensor with transparent huge pages (fewer TLB misses when attention walks
    block tables scattered over a multi-GiB KV cache). Call before the memory is first written."""
    if tensor.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = _libc()
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        aligned = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
        if end - aligned < HUGE_PAGE:
            return False
        return libc.madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(end - aligned), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def populate_for_write(address: int, length: int) -> bool:
    """Faults in [address, address + length) of anonymous memory as if written, without changing a byte: the kernel
    allocates and zeroes the pages now instead of at the first store (safe while other threads use the memory).
    The GIL is released meanwhile. False where Linux cannot (before 5.14) or the range is not mapped."""
    if not sys.platform.startswith("linux"):
        return False
    start = address & ~(PAGE - 1)
    try:
        libc = _libc()
    except OSError:
        return False
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + length - start), MADV_POPULATE_WRITE) == 0


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def build_main(folder: str) -> int:
    """The builder process: compiles into FOLDER (waiting for another builder there, if any); 0 once it is built."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        load_kernel(Path(folder))
    except Exception as e:
        log.exception("the build failed")
        print(f"build failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(build_main(sys.argv[1]))
