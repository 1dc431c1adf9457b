"""The CPU kernels: ``cpu_attention.c`` specialized per store layout, compiled with the system C compiler.

Triton's CPU path here is an interpreter, so on the CPU kvcompile generates C instead: the template is
compiled once per layout (``-D`` definitions spell the layout out: formats, axes, groups, head_dim, regions;
the head counts are arguments), with ``-O3 -march=native -fopenmp``, cached on disk in the ``cpu`` folder of
kvcompile's cache folder (``~/.cache/kvcompile/cpu``; ``KVCOMPILE_CACHE_DIR`` moves it: ``kvcompile.cachedir``)
keyed by the source, the flags, the compiler and
the CPU's features, and called through ctypes. Building one layout's decode kernel takes a few seconds (the
store kernel, under one); a process that finds it on disk loads it at once.

``attention`` is the decode path (a few query rows per kv head); many query rows (prefill) take
``templates.prefill``'s path, the store dequantized transiently and PyTorch's fused SDPA over it.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import Tensor

from kvcompile import cachedir
from kvcompile import quant as Q
from kvcompile.errors import ArgumentError, CacheDirError, CompilerError, UnsupportedError
from kvcompile.store import (FlatRecent, KVState, LayerSpec, Rope, check_rope_tables, describe,
                             hadamard, own_rings, row_rings, row_widths, stored_chunk)

from .common import check_groups, inf_to_nan, scale_code
from .prefill import _memo, _version

SOURCE = Path(__file__).with_name("cpu_attention.c")
ROWS_MAX = 16  # query rows per kv head the decode kernel takes (passed to it as -DROWS_MAX)
# -ffp-contract=off: every product and sum rounds as the reference's fp32 ops do (no fused multiply-add), so
# the kernel dequantizes to exactly the reference's values and the error bound of the tests applies as derived.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared",
         "-std=gnu11"]
TILE = 32  # positions per tile (passed to the kernel as -DTILE)
_MODEL_T = {"float32": 0, "bfloat16": 1, "float16": 2}




def compiler() -> str | None:
    """The C compiler kvcompile uses: ``$CC``, else ``cc``/``gcc``/``clang`` on the PATH, else None."""
    for c in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def _fmt(q) -> int:
    if not q.quantized:
        return 0
    if q.is_fp8:
        return 4 if q.format == "fp8_e5m2" else 3
    return 2 if q.symmetric else 1


def defines(spec: LayerSpec) -> dict[str, int]:
    """The compile-time constants of one specialization (the kernel's name spells them out): the layout
    alone, never the batch, a length or the head counts (the attention kernel takes those as arguments), so one
    build serves every store of the layout, and every model whose heads have it."""
    pol = spec.policy
    out = dict(D=spec.head_dim, S=spec.sink, W=max(spec.ring, 1),
               R=pol.residual, FL=spec.flush, BS=spec.block, MODEL_T=_MODEL_T[spec.dtype])
    for p, q in (("K", pol.key), ("V", pol.value)):
        out[f"{p}_FMT"] = _fmt(q)
        out[f"{p}_BITS"] = q.bits if q.quantized else 8
        out[f"{p}_AXIS"] = 1 if q.axis == "channel" else 0
        out[f"{p}_GROUP"] = q.group_for(spec.head_dim) if q.quantized else 1
        out[f"{p}_SFMT"] = scale_code(q)
    return out




def cache_dir() -> Path:
    """Where compiled kernels are kept: the ``cpu`` folder of kvcompile's cache folder (``kvcompile.cachedir``:
    ``$KVCOMPILE_CACHE_DIR/cpu``, else ``$XDG_CACHE_HOME/kvcompile/cpu``, else ``~/.cache/kvcompile/cpu``)."""
    return cachedir.root() / "cpu"


def private_cache_dir() -> Path:
    """``cache_dir()``, created private to this user (mode 0700, with any missing parent) and checked before
    anything in it is loaded: it must be a directory owned by this user and writable by no one else.

    Whoever can write into the directory can plant a library there that kvcompile would load, which runs its
    code in this process: that is what the ownership and mode checks refuse. (The digests ``compile_template``
    records beside each library live in the same directory, so a planter could write those too; they defend
    against corruption and truncation, not against planting.) Raises ``CacheDirError`` saying what was found
    and what to do."""
    d = cache_dir()
    named = cachedir.named()
    redirect = "set KVCOMPILE_CACHE_DIR to a directory of your own (it is created, private to you, if missing)"
    try:
        for p in reversed([d, *d.parents]):
            if not os.path.isdir(p):
                try:
                    p.mkdir(mode=0o700)
                except FileExistsError:  # a concurrent process created it (or a file is there: stat says)
                    pass
        st = d.stat()
    except OSError as e:
        found = next((p for p in reversed([d, *d.parents]) if os.path.lexists(p) and not os.path.isdir(p)), None)
        what = (f"{found} is a {'regular file' if os.path.isfile(found) else 'non-directory'}, not a directory"
                if found is not None else f"{e.strerror or e} ({e.filename})")
        raise CacheDirError(f"kvcompile cannot create its kernel cache directory {d} ({named}): {what}. "
                            f"Remove what is in the way, or {redirect}.") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CacheDirError(f"kvcompile's kernel cache path {d} ({named}) is not a directory. Remove it, "
                            f"or {redirect}.")
    if st.st_uid != os.geteuid():
        raise CacheDirError(
            f"kvcompile's kernel cache directory {d} ({named}) belongs to user id {st.st_uid}, not to you "
            f"(user id {os.geteuid()}): its owner could place code there that kvcompile would load and run. "
            f"kvcompile refuses to load from it: {redirect}, or remove {d} (kvcompile rebuilds its kernels, "
            f"about a second each).")
    if st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("its group", 0o020), ("all users", 0o002)) if st.st_mode & bit)
        raise CacheDirError(
            f"kvcompile's kernel cache directory {d} ({named}) is writable by {who} (mode "
            f"{stat.S_IMODE(st.st_mode):o}): anyone who can write there could plant code that kvcompile would "
            f"load and run, so it refuses to load from it. Remove {d} (kvcompile rebuilds its kernels in a new "
            f"private directory, about a second each), or {redirect}; `chmod 700 {d}` keeps the kernels, but "
            f"only if you are sure no one else has written there.")
    return d


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def digest_path(path: Path) -> Path:
    """Where the sha256 of the library ``path``, recorded when it was built, is kept: ``<name>.so.sha256``."""
    return path.with_name(path.name + ".sha256")


def _verified(path: Path) -> bool:
    """Whether ``path`` holds exactly the bytes its build recorded (False when either file is missing)."""
    try:
        want = digest_path(path).read_text().strip()
        return bool(want) and _sha256(path) == want
    except OSError:  # missing, unreadable, not a file: rebuilt (os.replace puts a new file in its place)
        return False


@functools.lru_cache(maxsize=None)
def _compiler_id(cc: str) -> str:
    """The compiler's version and the CPU's features: -march=native code must never be loaded on another CPU
    (a cache directory shared between machines), so both key the disk cache."""
    try:
        r = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CompilerError(f"the C compiler {cc} could not be run ({e}); set CC to a working gcc or clang") from None
    lines = r.stdout.splitlines()
    if r.returncode or not lines:
        raise CompilerError(f"`{cc} --version` failed (exit status {r.returncode}, output {r.stdout[-300:]!r}, "
                            f"{r.stderr[-300:]!r}); set CC to a working gcc or clang")
    features = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            features += next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        features += platform.processor()
    return lines[0] + "\n" + features


BUILD_ATTEMPTS = 3  # builds of one kernel before its digest is declared unreachable


@functools.lru_cache(maxsize=None)
def compile_template(source: str | Path, key: tuple) -> ctypes.CDLL:
    """Compile the C template ``templates/<source>`` (a file name; a ``Path`` is taken as it is: the benchmarks
    build modified copies) or load it from the disk cache, with ``-D`` definitions from ``key`` (a tuple of
    ``(name, value)``); the library is named after the definitions it was built with.

    The cache is not trusted blindly. Its directory is ``private_cache_dir()``: created 0700, and refused
    when it belongs to someone else or others can write to it (the defence against planted code). Each build
    records the sha256 of the library in ``<name>.so.sha256`` beside it, and a library is loaded only when
    its bytes match that record; anything else -- a missing or different digest, a zero-byte or truncated
    file, another kernel copied over it -- is rebuilt, never loaded. (The record sits in the same directory,
    so it defends against corruption and truncation, not against someone who can write there.) Builds write
    into a temporary directory and ``os.replace`` the library, then its digest, into place, so processes
    building the same kernel at once never see a partial file: at worst one sees a library beside another
    build's digest, and builds again."""
    cc = compiler()
    if cc is None:
        raise CompilerError(
            "kvcompile's CPU kernels need a C compiler (gcc or clang; set CC to choose one), and none was found "
            "on the PATH. Install one, or run the pure-torch reference instead: kvcompile.ops.set_kernels('reference')."
        )
    path_src = source if isinstance(source, Path) else Path(__file__).with_name(source)
    src = path_src.read_text()
    dflags = [f"-D{k}={v}" for k, v in key]
    digest = hashlib.sha256("\n".join([src, _compiler_id(cc), *FLAGS, *dflags]).encode()).hexdigest()[:24]
    name = path_src.stem + "_" + "_".join(f"{k}{v}" for k, v in key).lower() + "_" + digest[:8]
    path = private_cache_dir() / f"{name}.so"
    for _ in range(BUILD_ATTEMPTS):
        if _verified(path):
            try:
                return ctypes.CDLL(str(path))
            except OSError as e:
                raise CompilerError(
                    f"loading the CPU kernel {path} failed although it matches the digest recorded when it was "
                    f"built: {e}. Delete it and {digest_path(path).name} to have it rebuilt.") from None
        _build(cc, path_src, dflags, path)
    raise CompilerError(f"the CPU kernel {path} was built {BUILD_ATTEMPTS} times and never matched its recorded "
                        f"digest afterwards: another process keeps replacing it. Set KVCOMPILE_CACHE_DIR to a "
                        f"directory of this process's own.")


def _build(cc: str, path_src: Path, dflags: list, path: Path) -> None:
    """Build the library ``path`` and record its digest, both through ``os.replace`` (atomic)."""
    try:
        tmp_dir = tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-")
    except OSError as e:
        raise CacheDirError(f"kvcompile cannot write to its kernel cache directory {path.parent} ({cachedir.named()}): "
                            f"{e.strerror or e}. Make it writable, or set KVCOMPILE_CACHE_DIR to a directory of "
                            f"your own.") from None
    with tmp_dir as tmp:
        tmp_so = Path(tmp) / path.name
        r = subprocess.run([cc, *FLAGS, *dflags, str(path_src), "-o", str(tmp_so), "-lm"],
                           capture_output=True, text=True)
        if r.returncode:
            raise CompilerError(f"building the CPU kernel {path.stem} failed:\n{' '.join(r.args)}\n{r.stderr[-4000:]}")
        tmp_digest = digest_path(tmp_so)
        tmp_digest.write_text(_sha256(tmp_so) + "\n")
        # the library first: a reader between the two sees a stale digest, and rebuilds
        for src, dst in ((tmp_so, path), (tmp_digest, digest_path(path))):
            try:
                os.replace(src, dst)
            except OSError as e:  # something that is not a file is at that name (a directory): said, not raw
                what = "a directory is there" if os.path.isdir(dst) else (e.strerror or str(e))
                raise CacheDirError(f"kvcompile cannot write the CPU kernel {dst} into its cache directory "
                                    f"({cachedir.named()}): {what}. Remove {dst}, or set KVCOMPILE_CACHE_DIR to a "
                                    f"directory of your own.") from None


@functools.lru_cache(maxsize=None)
def build(key: tuple, source: Path = SOURCE) -> ctypes.CDLL:
    """The decode attention kernel for one tuple of ``defines`` items (from ``source``: the template, unless a
    benchmark passes a modified copy)."""
    lib = compile_template(source, key + (("ROWS_MAX", ROWS_MAX), ("TILE", TILE)))
    fn = lib.kvc_attention
    P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    compact = hasattr(lib, "kvc_rope_compact")  # older copies (benchmarks' "before") lack the compact table
    lib.row_strides = hasattr(lib, "kvc_row_strides")  # and the rows' widths (older copies take whole rows)
    lib.res_map = hasattr(lib, "kvc_res_map")  # full-precision positions read from a flat tensor by a map
    fn.argtypes = ([P] * 12 + [P, I, I] + [I, I] * lib.row_strides + [P, I, I, I, I, P, I, I, I, I, F, I, I, P, P]
                   + [P, P, I, P, P] + [P, I] * compact + [ctypes.POINTER(I)]  # (older copies ignore the pool strides)
                   + [P, I] * lib.res_map)
    fn.restype = I
    if compact:
        lib.kvc_rope_width.argtypes = [P]
        lib.kvc_rope_width.restype = I
        lib.kvc_rope_compact.argtypes = [P, P, I, P, P]
        lib.kvc_rope_compact.restype = I
    lib.rows_mask = hasattr(lib, "kvc_rows_mask")  # the rows' kernel takes a mask (older copies: causal only)
    if hasattr(lib, "kvc_attention_rows"):  # a prompt's rows sharing their tiles (older copies lack it)
        lib.kvc_attention_rows.argtypes = ([P] * 12 + [P, I, I, I, I, P, I, I, I, F, I, I, ctypes.POINTER(I), P, I, P]
                                           + [P, I, I, I, I] * lib.rows_mask + [P, I] * lib.res_map)
        lib.kvc_attention_rows.restype = I
    if hasattr(lib, "kvc_fp8_decode"):  # the decode the kernel uses (tests); older copies lack it
        lib.kvc_fp8_decode.argtypes = [P, P, I, I]
        lib.kvc_fp8_decode.restype = None
    if hasattr(lib, "kvc_rope_rows"):  # the kernel's rotation and dequantization of pre-RoPE keys (tests)
        lib.kvc_rope_rows.argtypes = [P, P, I, I, I, P, P, I, P] + [P, I] * compact
        lib.kvc_rope_rows.restype = None
        lib.kvc_dequant_keys.argtypes = [P, P, P, I, I, I, P]
        lib.kvc_dequant_keys.restype = None
    if hasattr(lib, "kvc_rope_keys"):
        lib.kvc_rope_keys.argtypes = [P, P, P, I, I, I, I, P, P, I, P, P, I, P]
        lib.kvc_rope_keys.restype = I
    return lib


@functools.lru_cache(maxsize=None)
def _kernel_for(spec: LayerSpec, source: Path = SOURCE) -> ctypes.CDLL:
    return build(tuple(sorted(defines(spec).items())), source)


def _ptr(t: Tensor) -> int | None:
    return t.data_ptr() if t.numel() else None


def pool_strides(state: KVState, what: str = "the CPU kernels") -> ctypes.Array:
    """The kernels' ``pool_sb``: bytes from one block to the next in each pool field (``k_codes .. v_zero``), after
    checking the layout they read. A field is ``[NB, H, rows, X]`` whose blocks may lie any distance apart (a pool
    of its own, ``LayerSpec.pool``, or one field of a serving engine's pages, ``kvcompile.pages``) but whose every
    block is dense (``[H, rows, X]`` contiguous); the per-sequence tensors (rings, sinks, lengths, table) are
    contiguous. A ``ValueError`` naming the field otherwise."""
    out = (ctypes.c_int64 * 6)()
    for i, (name, t) in enumerate(zip(KVState._fields[:6], state[:6])):
        if not t.numel():
            continue
        if t.dim() != 4 or t.stride()[1:] != (t.shape[2] * t.shape[3], t.shape[3], 1):
            raise ArgumentError(f"{what} read {name} as [blocks, heads, rows, X] with each block dense; got shape "
                             f"{list(t.shape)} with strides {list(t.stride())} (as LayerSpec.pool or "
                             f"kvcompile.pages.PageLayout.views make it)")
        out[i] = t.stride(0) * t.element_size()
    for name, t in zip(KVState._fields[6:], state[6:]):
        if not t.is_contiguous():
            raise ArgumentError(f"{what} need a contiguous {name} (as KVStore or LayerSpec.allocate makes it)")
    return out


# ---- how many threads the kernels may use now
#
# A kernel's OpenMP team finishes when its slowest thread does. When other processes keep the cores busy, a
# thread of the team waits for its next time slice (milliseconds) while the others spin at the barrier
# (libgomp's default wait policy, fixed when torch loads it), so a decode made of hundreds of short parallel
# regions per token collapses instead of slowing down in proportion to the CPU it gets (docs/contention.md).
# So the kernels use no more threads than the cores this process may run on (its affinity) that other
# processes leave free.

LOAD_WINDOW_S = 0.25  # other processes' CPU use is averaged over at least this long (/proc/stat counts 10 ms ticks)
PROC_STAT = "/proc/stat"


def _threads_from_env() -> int | None:
    env = os.environ.get("KVCOMPILE_THREADS", "auto").strip()
    if env in ("", "auto"):
        return None
    if not env.isdigit() or int(env) < 1:
        raise ArgumentError(f"KVCOMPILE_THREADS={env!r}: expected a whole number of threads >= 1, or 'auto' (the "
                         f"default: as many as the cores other processes leave free); unset it or set one of those")
    return int(env)


FIXED_THREADS = _threads_from_env()  # KVCOMPILE_THREADS=<n> (read at import); tests may set it directly
_load_lock = threading.Lock()
_load: dict = {"t": None, "busy": 0.0, "own": 0.0, "cpus": (), "free": None, "cap": None}


def cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, cpusets), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy_seconds(cpus) -> float | None:
    """CPU time the cores ``cpus`` spent busy since boot, summed, from /proc/stat (None without it): user +
    system + irq + softirq + steal (a hypervisor's steal is time the core was not ours). Idle and iowait are
    free, and so is "nice": time of processes at a positive nice value, which yield the core to ours."""
    try:
        with open(PROC_STAT) as f:
            text = f.read()
    except OSError:
        return None
    want = {f"cpu{c}" for c in cpus}
    ticks = 0
    for ln in text.splitlines():
        parts = ln.split()
        if parts and parts[0] in want:
            v = [int(x) for x in parts[1:9]] + [0] * (9 - len(parts))
            ticks += v[0] + v[2] + v[5] + v[6] + v[7]  # user, system, irq, softirq, steal
    return ticks / os.sysconf("SC_CLK_TCK")


def free_cores() -> float | None:
    """Cores of this process's affinity that other processes left free, averaged over the last
    ``LOAD_WINDOW_S`` or more: the cores, less the busy time /proc/stat counts on them, less this process's
    own CPU time (its threads, spinning ones included), over the wall time. None until two samples exist
    (the first call takes one) or where /proc/stat is missing.

    Why /proc/stat: ``os.getloadavg`` averages over a minute (a competitor is seen a minute late and
    forgotten a minute after it stops), counts this process's own threads, and covers every core of the
    machine rather than the ones this process may use; /proc/stat's per-core counters give the others' use
    of our cores over a window of our choosing, for one small read every ``LOAD_WINDOW_S``."""
    _refresh()
    return _load["free"]


def _refresh() -> None:
    now = time.monotonic()
    if _load["t"] is not None and now - _load["t"] < LOAD_WINDOW_S:
        return
    with _load_lock:
        if _load["t"] is not None and now - _load["t"] < LOAD_WINDOW_S:
            return
        try:
            cpus = tuple(sorted(os.sched_getaffinity(0)))
        except (AttributeError, OSError):
            cpus = tuple(range(os.cpu_count() or 1))
        busy, own = busy_seconds(cpus), time.process_time()
        free = _load["free"]
        if busy is None:
            free = None
        elif _load["t"] is not None and cpus == _load["cpus"]:
            others = max(0.0, (busy - _load["busy"]) - (own - _load["own"])) / (now - _load["t"])
            free = max(0.0, len(cpus) - others)
        cap = len(cpus) if free is None else max(1, min(len(cpus), int(free + 0.5)))
        _load.update(busy=busy or 0.0, own=own, cpus=cpus, free=free, cap=cap)
        _load["t"] = now  # last: the unlocked check above reads it


def available_threads() -> int:
    """Threads the CPU kernels may use now: ``torch.get_num_threads()``, at most ``cores()``, and at most the
    cores other processes leave free (``free_cores()`` rounded to the nearest whole core; at least one).
    About half a microsecond (the free cores are measured at most every ``LOAD_WINDOW_S``).

    ``FIXED_THREADS`` (``KVCOMPILE_THREADS=<n>`` in the environment at import) fixes it to ``n`` whatever the
    load and torch's count: tests of the parallel paths, benchmarks."""
    if FIXED_THREADS is not None:
        return FIXED_THREADS
    _refresh()
    return max(1, min(torch.get_num_threads(), _load["cap"]))


MIN_TILES_PER_THREAD = 32  # ~1K positions of one kv head: less than that is not worth waking a thread for


def threads_for(lengths: Tensor, heads: int) -> int:
    """Threads for one decode call: ``available_threads()``, but no more than the work keeps busy. On a loaded
    machine a parallel region waits for its slowest thread's next time slice (milliseconds), so short contexts
    run on one thread."""
    tiles = lengths.numel() * heads * -(-int(lengths.max()) // TILE) if lengths.numel() else 0
    return max(1, min(available_threads(), tiles // MIN_TILES_PER_THREAD))


DECODE_SPLITS = 2  # pieces each (sequence, kv head)'s positions are cut into, whatever the batch or the threads


def splits(lengths: Tensor, heads: int, threads: int) -> int:
    """How many pieces each (sequence, kv head)'s positions are cut into (flash-decoding): ``DECODE_SPLITS``,
    always. The kernel cuts a sequence's tiles into that many pieces and merges them in order, so a row's output
    depends on its own length alone -- not on the other rows of the batch nor on the threads the machine's load
    leaves (a count chosen per call, enough tasks for every thread, gave a request other bits alone than batched,
    and other bits under load). Two pieces cost within 1 % of one on one thread (SmolLM2's layer, 1 to 32
    sequences of 256 to 4K tokens; four cost up to 19 % at 32 sequences) and give two threads work for a single
    sequence. ``lengths``, ``heads``, ``threads``: the call's, which the count no longer depends on."""
    return DECODE_SPLITS


GROUP_ROWS = 32  # a prompt's rows that share their packed tiles: the kernel's tasks are such groups x kv heads


def _capped(groups: Tensor, most: int = GROUP_ROWS) -> Tensor:
    """``groups`` (run offsets) with every run cut into pieces of at most ``most`` rows."""
    g = groups.tolist()
    cuts = [torch.arange(a, b, most) for a, b in zip(g[:-1], g[1:])]
    return torch.cat(cuts + [torch.tensor(g[-1:])]).to(torch.int32)


def _flat_args(flat: FlatRecent, state: KVState, spec: LayerSpec) -> tuple:
    """The C kernels' ``res_map, res_n`` for ``flat`` (``kvcompile.store.FlatRecent``), checked: keys and values
    ``[N, H, D]`` of the model dtype, contiguous, on the CPU, and an int64 map ``[B, 3]``. Returns the map
    (contiguous: the caller holds it while the kernel reads it) and the arguments."""
    k, v, fmap = flat
    B, H, D = state.lengths.shape[0], spec.heads, spec.head_dim
    for name, t in (("keys", k), ("values", v)):
        if not isinstance(t, Tensor) or t.device.type != "cpu" or t.dtype != getattr(torch, spec.dtype) \
                or t.dim() != 3 or tuple(t.shape[1:]) != (H, D) or t.shape[0] != k.shape[0] or not t.is_contiguous():
            raise ArgumentError(f"the full-precision {name} must be {spec.dtype} [N, {H}, {D}], contiguous, on the "
                                f"CPU, keys and values alike; got {_show_t(t)}")
    if not isinstance(fmap, Tensor) or fmap.dtype != torch.int64 or tuple(fmap.shape) != (B, 3) \
            or fmap.device.type != "cpu":
        raise ArgumentError(f"the full-precision rows' map must be int64 [{B}, 3] on the CPU; got {_show_t(fmap)}")
    fmap = fmap.contiguous()
    return fmap, (fmap.data_ptr(), k.shape[0])


def _show_t(t) -> str:
    return f"{describe(t)} on {t.device}" if isinstance(t, Tensor) else describe(t)


def check_decode(q: Tensor, spec: LayerSpec) -> str | None:
    """Why the decode kernel cannot take this call (None when it can)."""
    B, Hq, n, D = q.shape
    if q.device.type != "cpu":
        return f"tensors on {q.device}"
    if Hq % spec.heads:
        return f"query heads {Hq} are not a multiple of the cache's kv heads {spec.heads}"
    if D % 8:
        return f"head_dim {D} is not a multiple of 8 (the kernel's vector width)"
    if (Hq // spec.heads) * n > ROWS_MAX:
        return f"{(Hq // spec.heads) * n} query rows per kv head (more than {ROWS_MAX}: prefill)"
    return None


def attention(q: Tensor, state: KVState, spec: LayerSpec, mask: Tensor | None, scale: float | None,
              nsplit: int | None = None, k_new: Tensor | None = None, v_new: Tensor | None = None,
              source: Path = SOURCE, rope: Rope | None = None, groups: Tensor | None = None,
              rings: Tensor | None = None, flat: FlatRecent | None = None) -> Tensor:
    """Same contract as ``kvcompile.store.attention_reference``, for at most ``ROWS_MAX`` query rows per kv head.

    nsplit: pieces each (sequence, kv head)'s positions are cut into (default: ``splits``; tests vary it).
    source: the C template (a benchmark passes edited copies of it).
    groups: int32 ``[g + 1]`` offsets: rows ``groups[i] .. groups[i + 1] - 1`` are positions of one sequence in
    ascending order with the same block table (one query a row, no rotary tables: a prompt's queries,
    ``kvcompile.pages``; causal, or each row as its row of ``mask`` says: a sliding window's). The kernel then
    dequantizes a packed tile once for up to ``GROUP_ROWS`` of a group's rows (``kvc_attention_rows``) -- the
    same bits as without ``groups``.
    rings: int32 ``[B]``: row ``b`` reads ring ``rings[b]`` of the state's ``k_res, v_res`` (with ``groups``:
    rows whose full-precision positions begin at the same position share one); None: its own.
    flat (``kvcompile.store.FlatRecent``): each row's full-precision positions are read where ``flat`` holds them
    (its map's row ``b``), not from rings -- the same bits as over ``store.flat_rings``."""
    why = check_decode(q, spec)
    if why:
        raise ArgumentError(f"the CPU decode kernel cannot take this call: {why}")
    B, Hq, n, D = q.shape
    G = Hq // spec.heads
    lib = _kernel_for(spec, source)
    if groups is not None and not (hasattr(lib, "kvc_attention_rows") and (mask is None or lib.rows_mask)):
        groups = None  # a benchmark's older copy of the kernel: each row alone (the same bits)
    if flat is not None and (rings is not None or not lib.res_map):  # (a benchmark's older copy: gathered rings)
        state, flat, rings = row_rings(state, spec, rings, flat), None, None
    if rings is not None and groups is None:
        state, rings = own_rings(state, rings), None
    fmap, res = (None, (None, 0) if lib.res_map else ()) if flat is None else _flat_args(flat, state, spec)
    qf = q.float()
    if spec.policy.rotates_keys:
        qf = qf @ hadamard(D, q.device)
    qf = qf.contiguous()
    sb = pool_strides(state)
    table = state.table
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != B:
        raise ArgumentError(f"the store's block table must be int32 [{B}, blocks]; got {table.dtype} {list(table.shape)}")
    m = None
    msb = msh = msi = mw = 0
    if mask is not None:
        def additive():
            mk = mask
            if mk.dtype == torch.bool:
                mk = torch.zeros(mk.shape, dtype=torch.float32).masked_fill_(~mk, float("-inf"))
            return mk.float()
        mk = _memo(mask, "additive", additive)
        while mk.dim() < 4:
            mk = mk.unsqueeze(0)
        if mk.shape[-2] not in (1, n):
            raise ArgumentError(f"mask of shape {tuple(mask.shape)} does not match {n} query tokens")
        m = mk.expand(B, Hq, n, mk.shape[-1])
        msb, msh, msi = (m.stride(0), m.stride(1), m.stride(2))
        if m.stride(3) != 1:
            m = m.contiguous()
            msb, msh, msi = m.stride(0), m.stride(1), m.stride(2)
        mw = m.shape[-1]
    out = torch.empty(B, Hq, n, D, dtype=torch.float32)
    kn, vn = stored_chunk(spec, k_new, v_new, n) or (None, None)
    threads = threads_for(state.lengths, spec.heads)
    pol = spec.policy
    ra = None if rope is None else _rope_args(rope, B, D)
    widths = row_widths(state, spec, rings=flat is None)
    if not lib.row_strides and widths != (spec.ring, spec.sink):
        raise UnsupportedError(f"this copy of the CPU decode kernel ({source}) takes rings and sinks allocated "
                               f"whole; the store's have grown to {widths} of {(spec.ring, spec.sink)}")
    ns = nsplit or splits(state.lengths, 1 if rope is not None else spec.heads, threads)
    sm = float(scale if scale is not None else D ** -0.5)
    ptrs = [_ptr(t) for t in state[:10]]
    if flat is not None:  # the flat keys and values where the rings would be
        ptrs[6:8] = flat.k.data_ptr(), flat.v.data_ptr()
    if groups is not None:
        check_groups(groups, state, n, kn, rope, rings)
        groups = _capped(groups)
        bad = lib.kvc_attention_rows(
            qf.data_ptr(), *ptrs, state.lengths.data_ptr(), _ptr(table), table.shape[1],
            state.k_codes.shape[0], *widths, out.data_ptr(), B, spec.heads, G, sm, ns, threads, sb,
            groups.data_ptr(), len(groups) - 1, None if rings is None else rings.data_ptr(),
            *((None if m is None else m.data_ptr(), msb, msh, msi, mw) if lib.rows_mask else ()), *res)
    else:
        bad = lib.kvc_attention(
            qf.data_ptr(), *ptrs, state.lengths.data_ptr(),
            _ptr(table), table.shape[1], state.k_codes.shape[0], *(widths if lib.row_strides else ()),
            None if m is None else m.data_ptr(), msb, msh, msi, mw,
            out.data_ptr(), B, spec.heads, G, n, sm, ns, threads,
            None if kn is None else kn.data_ptr(), None if vn is None else vn.data_ptr(),
            *_rope_ptrs(lib, ra), sb, *res)
    if bad > B:
        b = bad - 1 - B
        raise ArgumentError(f"the full-precision rows ({flat.k.shape[0]}) hold no row for a position row {b} "
                            f"({int(state.lengths[b])} positions) reads, by its map {fmap[b].tolist()}")
    if bad:
        b = bad - 1
        raise ArgumentError(f"the block table of sequence {b} ({int(state.lengths[b])} tokens) does not name a block of "
                         f"the pool ({state.k_codes.shape[0]} blocks) for each of its "
                         f"{spec.blocks_for(int(state.lengths[b]))} packed blocks: {table[b].tolist()}")
    if pol.rotate:
        out = out @ hadamard(D, q.device)
    return Q.saturate(inf_to_nan(out), q.dtype)  # as the reference


class _RopeArgs:
    """One rope's tables as the C kernel takes them, checked (``_rope_args``), and its compact table (``_compact``).
    Holds the caller's tensors: a freed table's address is never taken for another's."""
    __slots__ = ("src", "ver", "tables", "ptrs", "compact")

    def __init__(self, src: tuple, ver: tuple, tables: tuple):
        self.src, self.ver, self.tables = src, ver, tables
        cos, sin, perm, off = tables
        self.ptrs = (cos.data_ptr(), sin.data_ptr(), cos.shape[0], perm.data_ptr(), off.data_ptr())
        self.compact: tuple | None = None  # (buffer [T, rd], Tc), made by the first kernel that reads it


_ROPE_MEMO: list = []  # _RopeArgs of the few most recent ropes (a cache's layers pass one, every step)


def _rope_args(rope: Rope, B: int, D: int) -> _RopeArgs:
    """The C kernel's pre-RoPE tables (``kvc_attention``), checked: cos, sin [T, D] fp32, perm [D] and offsets [B]
    int32, contiguous (converted copies where the caller's are not). Memoised per tensors and versions (every layer
    of every step passes its cache's tables; a capture writes them in place, which bumps their versions): a call
    that finds them costs a few attribute reads."""
    src = (rope.cos, rope.sin, rope.perm, rope.offset)
    ver = (_version(src[0]), _version(src[1]), _version(src[2]), _version(src[3]))
    versioned = None not in ver  # else made under torch.inference_mode: checked and converted at every call
    for e in _ROPE_MEMO if versioned else ():
        s = e.src
        if s[0] is src[0] and s[1] is src[1] and s[2] is src[2] and s[3] is src[3] and e.ver == ver:
            check_rope_tables(*e.tables, B, D, partners=False)  # checked before, but not for this call's B and D
            break
    else:  # new tensors, or written since (a decode step's capture): checked, and the compact table made again
        i, prev = next(((i, o) for i, o in enumerate(_ROPE_MEMO) if versioned
                        and o.src[0] is src[0] and o.src[1] is src[1] and o.src[2] is src[2]), (None, None))
        cos, sin = rope.cos.float().contiguous(), rope.sin.float().contiguous()
        perm, off = rope.perm.to(torch.int32).contiguous(), rope.offset.to(torch.int32).contiguous()
        checked = prev is not None and prev.ver[2] == ver[2]  # these partners, unchanged since they were checked
        check_rope_tables(cos, sin, perm, off, B, D, partners=not checked)
        e = _RopeArgs(src, ver, (cos, sin, perm, off))
        if prev is not None and prev.compact:
            if prev.ver[:3] == ver[:3]:
                e.compact = prev.compact  # only the offsets are new
            else:  # the same tensors written since: checked again, into the same buffer
                e.compact = (_ROPE_MEMO.pop(i).compact[0], None)
        if versioned:
            _ROPE_MEMO.insert(0, e)
            del _ROPE_MEMO[4:]
    return e


def _compact(lib: ctypes.CDLL, e: _RopeArgs) -> tuple:
    """``e``'s compact table, made once (``rope_compact``): (buffer, Tc), (None, 0) for none."""
    if e.compact is None or e.compact[1] is None:
        buf = e.compact[0] if e.compact else None
        cos, sin, perm, _ = e.tables
        rd, tc = lib.kvc_rope_width(perm.data_ptr()), 0
        if rd:
            if buf is None or buf.shape != (cos.shape[0], rd):
                buf = torch.empty(cos.shape[0], rd)
            tc = lib.kvc_rope_compact(cos.data_ptr(), sin.data_ptr(), cos.shape[0], perm.data_ptr(), buf.data_ptr())
        e.compact = (buf, tc) if tc else (None, 0)
    return e.compact


def _rope_ptrs(lib: ctypes.CDLL, e: _RopeArgs | None, compact: bool = True) -> tuple:
    """``kvc_attention``'s pre-RoPE arguments: cos, sin, T, perm, offsets, then the compact table and its rows (NULLs
    and zeros for none; no compact arguments to an older copy of the kernel that lacks them: a benchmark's
    "before"). ``e`` (``_rope_args``, memoised) keeps the tensors alive past the call."""
    new = hasattr(lib, "kvc_rope_compact")
    if e is None:
        return (None, None, 0, None, None) + (None, 0) * new
    if not new:
        return e.ptrs
    cc, tc = _compact(lib, e) if compact else (None, 0)
    return e.ptrs + ((None, 0) if cc is None else (cc.data_ptr(), tc))


def rope_compact(rope: Rope, spec: LayerSpec, source: Path = SOURCE) -> tuple[Tensor | None, int]:
    """The compact cos/sin table the decode kernel reads pre-RoPE rotations from, and how many of its rows hold
    (``Tc``: rows from ``Tc`` on are read from the full table); ``(None, 0)`` when there is none.

    For the "half" and "pairs" forms (rotary channels a multiple of 8 per half / in all) a model's table repeats
    itself: each pair's second cos equals its first, and its second sine is its first negated; past the rotary
    channels cos is 1 and sin +0. For the rows 0 .. ``Tc - 1`` that are so bit for bit (checked, not assumed) the
    kernel reads a contiguous ``[T, rd]`` copy instead that holds only the first of each pair's cos and sin: half
    the bytes, and the same products and sums (the second of a pair takes ``-sin``, exactly its table entry). The
    check and the copy are one pass over the table in C, once per table and version of its tensors (memoised): a
    store's table is written in place as positions are captured, which bumps the versions, and grows into new
    tensors, so every layer of a decode step shares one copy and a changed table is never read stale."""
    lib = _kernel_for(spec, source)
    cc, tc = _compact(lib, _rope_args(rope, rope.offset.numel(), spec.head_dim))
    return (None, 0) if cc is None else (cc[:tc], tc)


def rope_rows(k: Tensor, spec: LayerSpec, rope: Rope, p0: int = 0, b: int = 0, source: Path = SOURCE,
              compact: bool = True) -> Tensor:
    """Key rows ``k [N, D]`` (fp32, natural order) of sequence ``b`` at cache positions ``p0 .. p0 + N - 1`` rotated
    as the decode kernel rotates pre-RoPE keys (for the tests: ``store.apply_rope`` bit for bit): from the compact
    table where ``rope_compact`` makes one (``compact=False``: from the full table only)."""
    D = spec.head_dim
    lib = _kernel_for(spec, source)
    kf = k.float().contiguous()
    if kf.dim() != 2 or kf.shape[1] != D:
        raise ArgumentError(f"rope_rows: expected key rows [N, {D}], got {list(k.shape)}")
    ra = _rope_args(rope, rope.offset.numel(), D)
    cos, sin, T, perm, _, *cc = _rope_ptrs(lib, ra, compact)
    out = torch.empty_like(kf)
    lib.kvc_rope_rows(kf.data_ptr(), out.data_ptr(), kf.shape[0], p0, int(ra.tables[3][b]), cos, sin, T, perm, *cc)
    return out


def dequant_keys(state: KVState, spec: LayerSpec, block: int, head: int, natural: bool,
                 source: Path = SOURCE) -> Tensor:
    """The packed keys of one (block, head), all its rows, dequantized as the decode kernel does: ``[BS, D]`` fp32
    in natural order (``natural``: what it rotates pre-RoPE keys in) or in its plane order (``plane_order``)."""
    D, BS = spec.head_dim, spec.block
    lib = _kernel_for(spec, source)
    pool = [t[block, head] if t.numel() else t for t in (state.k_codes, state.k_scale, state.k_zero)]
    if not all(t.is_contiguous() for t in pool):
        raise ArgumentError("dequant_keys: the store's keys must be contiguous")
    out = torch.empty(BS, D)
    lib.kvc_dequant_keys(*[_ptr(t) for t in pool], 0, BS, int(natural), out.data_ptr())
    return out


def rope_keys(state: KVState, spec: LayerSpec, block: int, head: int, rope: Rope, p0: int, b: int = 0,
              compact: bool = True, source: Path = SOURCE) -> tuple[Tensor, bool]:
    """The packed pre-RoPE keys of one (block, head), all its rows, taken as sequence ``b``'s positions ``p0 ..``:
    dequantized and rotated as the decode kernel does a packed tile (for the tests: ``apply_rope`` of the reference's
    dequantized keys, bit for bit). Returns them ``[BS, D]`` and whether the kernel rotated each row as it
    dequantized it (int2/int4 keys of a "half" or "pairs" form) rather than in a pass of its own."""
    D, BS = spec.head_dim, spec.block
    lib = _kernel_for(spec, source)
    pool = [t[block, head] if t.numel() else t for t in (state.k_codes, state.k_scale, state.k_zero)]
    if not all(t.is_contiguous() for t in pool):
        raise ArgumentError("rope_keys: the store's keys must be contiguous")
    ra = _rope_args(rope, rope.offset.numel(), D)
    cos, sin, T, perm, _, *cc = _rope_ptrs(lib, ra, compact)
    out = torch.empty(BS, D)
    fused = lib.kvc_rope_keys(*[_ptr(t) for t in pool], 0, BS, p0, int(ra.tables[3][b]), cos, sin, T, perm, *cc,
                              out.data_ptr())
    return out, bool(fused)


def plane_order(spec: LayerSpec) -> Tensor:
    """The channel at each index of a packed key row as the decode kernel unpacks it (its "plane" order): with
    ``per`` codes per packed unit, channel ``j * per + i`` sits at ``i * (D / per) + j`` (natural for 8-bit,
    fp8 and unquantized keys)."""
    D, q = spec.head_dim, spec.policy.key
    per = 1 if q.format == "none" or q.bits == 8 else (8 if q.bits == 3 else 8 // q.bits)
    idx = torch.arange(D)
    return (idx % (D // per)) * per + idx // (D // per)


@contextlib.contextmanager
def capped_torch_threads(n: int | None = None):
    """Within the block, torch's own thread count (its intra-op pool: the model's matmuls, SDPA) is at most
    ``n`` (default ``available_threads()``), and is put back after; never raised. torch's OpenMP workers spin
    while they wait, so on a loaded machine a team larger than the free cores stalls every parallel region for
    a time slice (docs/contention.md: a SmolLM2 decode step 10x slower beside two busy processes). kvcompile's
    forward runs under it on the CPU; on an idle machine nothing changes. (torch's thread count is part of
    Dynamo's guards: a compiled call passes the same ``n`` every time, ``kvcompile.hf_model._threads``.)"""
    before = torch.get_num_threads()
    n = available_threads() if n is None else n
    if n < before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n < before:
            torch.set_num_threads(before)
