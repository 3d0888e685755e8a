"""Compiled programs kept on disk, so a restart loads the engine's executables instead of tracing, lowering and
compiling them again (JAX's own compilation cache skips only XLA's compile); and the outputs of a few
deterministic programs that take longer to run than to read (`stored_value`: the CPU's random weights).

Each entry is keyed by everything that can change the program without changing its name: its arguments'
shapes, dtypes and shardings, the model config, the engine settings, a digest of this package's and the
kernels' source (tiles included), the jax, jaxlib and flax versions, XLA flags, and the devices (platform,
kind, count). A missing, stale or unreadable entry is built again and rewritten, with a log line (on the CPU,
an executable is not rewritten while JAX's own compilation cache is on: see RESERIALIZE_LOSES_CODE). The folder
is kept under its size limit (`ExecutableDir.max_bytes`): each write removes the least recently used entries
(an entry's mtime is its last load or write) beyond it, and partial writes that dead processes left.

A serialized executable is code: loading one runs whatever it contains, as does unpickling a stored value.
`ExecutableStore` only reads a directory owned by the current user that neither group nor others can write, and
writes entries 0600.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import serialize_executable
from tqdm import tqdm

from hybrid_jax.compilation_cache import ExecutableDir, private_dir

log = logging.getLogger("hybrid_jax.engine")

FORMAT = 1  # bump when the entry layout changes
MAGIC = b"hybrid-jax executable\n"
# Platforms where an executable that JAX's compilation cache returned loses code when serialized again (XLA:CPU
# keeps no object files for a deserialized executable: its fusions are missing when the entry is loaded). A
# compile does not always say it was a cache hit (JAX's in-memory cache hands out the same executable), so
# there the store writes nothing while JAX's persistent cache is on.
RESERIALIZE_LOSES_CODE = frozenset({"cpu"})
SOURCE_PACKAGES = ("hybrid_jax", "pallas_kernels")
ENV_KEYS = ("XLA_FLAGS", "HYBRID_JAX_KERNELS", "LIBTPU_INIT_ARGS")
ENTRY_SUFFIX = ".xla"
PARTIAL_WRITE_S = 3600.0  # a partial write (``<entry>.tmp<pid>-<thread>``) older than this lost its writer
_LAPACK_LOCK = threading.Lock()


@cache
def source_digest() -> str:
    """sha256 over the Python source of the packages that build the programs (kernel tiles included)."""
    digest = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        root = Path(__import__(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def environment(devices: Sequence[jax.Device]) -> dict[str, Any]:
    """What, besides a program's own arguments, decides what it compiles to."""
    import flax
    import jaxlib

    first = devices[0]
    return {"format": FORMAT, "jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
            "platform": first.platform, "platform_version": first.client.platform_version,
            "device_kind": first.device_kind,
            "devices": [d.id for d in devices], "process_count": jax.process_count(),
            "x64": bool(jax.config.jax_enable_x64),
            "matmul_precision": str(jax.config.jax_default_matmul_precision),
            "env": {k: os.environ.get(k, "") for k in ENV_KEYS}, "source": source_digest()}


def signature(args: Any) -> str:
    """The arguments' tree structure and each leaf's shape, dtype and sharding (arrays or ShapeDtypeStructs)."""
    leaves, tree = jax.tree.flatten(args)

    def leaf(x) -> str:
        sharding = getattr(x, "sharding", None)
        weak = getattr(x, "weak_type", False)
        return f"{tuple(x.shape)}:{x.dtype}:{'w' if weak else ''}:{sharding if sharding is not None else ''}"

    return json.dumps([str(tree), [leaf(x) for x in leaves]])


class ExecutableStore:
    """Serialized executables in one directory of the current user's, one file per key, kept under a size."""

    def __init__(self, directory: ExecutableDir | str | Path, devices: Sequence[jax.Device]):
        """``directory``: a bare path has the default size limit."""
        location = directory if isinstance(directory, ExecutableDir) else ExecutableDir(Path(directory))
        self.directory = location.path.expanduser()
        self.max_bytes = location.max_bytes
        self.devices = list(devices)
        self._environment = environment(self.devices)
        self._lock = threading.Lock()
        self._trim_lock = threading.Lock()
        self._opened = time.time()  # entries with a later mtime were loaded or written since
        self._warned = self._warned_small = False  # the one-time warnings: not written; limit too small
        private_dir(self.directory)
        if self.devices[0].platform == "cpu":
            with _LAPACK_LOCK:  # once: the engine's store and the weights' are made on two threads at once
                _initialize_lapack()

    def key(self, name: str, context: dict[str, Any], args: Any) -> str:
        """The text that identifies one program: its name, its arguments, ``context`` and the environment."""
        return json.dumps({"name": name, "context": context, "args": signature(args), "env": self._environment},
                          sort_keys=True, default=str)

    def path(self, key: str) -> Path:
        return self.directory / (hashlib.sha256(key.encode()).hexdigest()[:40] + ENTRY_SUFFIX)

    def load(self, name: str, key: str) -> jax.stages.Compiled | None:
        """The stored program for ``key``; None (logged) when it is missing, stale or unreadable."""
        return self._read(name, key, lambda data, in_tree, out_tree: serialize_executable.deserialize_and_load(
            data, in_tree, out_tree, backend=self.devices[0].client, execution_devices=self.devices))

    def load_value(self, name: str, key: str) -> Any | None:
        """The stored value (a pytree of host arrays) for ``key``; None (logged) when it is missing, stale or
        unreadable."""
        return self._read(name, key, lambda value: value)

    def save(self, name: str, key: str, compiled: jax.stages.Compiled) -> bool:
        """Write ``compiled`` under ``key`` (atomically, mode 0600); False (logged) if it cannot be stored."""
        if self.devices[0].platform in RESERIALIZE_LOSES_CODE and xla_cache_on():
            if not self._warned:
                self._warned = True
                log.warning("executable cache: not written while JAX's compilation cache is on (%s): on the %s a "
                            "program it returns cannot be serialized again", jax.config.jax_compilation_cache_dir,
                            self.devices[0].platform)
            return False
        try:
            data, in_tree, out_tree = serialize_executable.serialize(compiled)
        except Exception as e:
            log.warning("executable cache: %s cannot be serialized (%s: %s)", name, type(e).__name__, e)
            return False
        return self._write(name, key, (key, data, in_tree, out_tree))

    def save_value(self, name: str, key: str, value: Any) -> bool:
        """Write ``value`` (a pytree of arrays, copied to the host) under ``key``; False (logged) if it cannot be
        stored."""
        return self._write(name, key, (key, jax.tree.map(np.asarray, value)))

    def _read(self, name: str, key: str, restore: Callable[..., Any]) -> Any | None:
        """``restore`` applied to the fields of the entry stored for ``key`` (after the key); None (logged) when
        the entry is missing, stale or unreadable, or ``restore`` raises."""
        path = self.path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("executable cache: %s: cannot read %s (%s); building it again", name, path.name, e)
            return None
        try:
            stored_key, *fields = pickle.loads(_unwrap(blob))
            if stored_key != key:
                raise ValueError("the entry's key differs from the program's")
            value = restore(*fields)
        except Exception as e:  # a truncated, corrupt or incompatible entry: never fatal
            log.warning("executable cache: %s: entry %s unusable (%s: %s); building it again", name, path.name,
                        type(e).__name__, e)
            return None
        with contextlib.suppress(OSError):  # the mtime orders entries for `_trim`: recently used go last
            os.utime(path)
        return value

    def _write(self, name: str, key: str, entry: tuple) -> bool:
        """Pickle ``entry`` (its key first) to ``key``'s path, atomically, mode 0600."""
        try:
            blob = _wrap(pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:
            log.warning("executable cache: %s cannot be serialized (%s: %s)", name, type(e).__name__, e)
            return False
        path = self.path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
        try:
            with self._lock:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, path)
        except OSError as e:
            log.warning("executable cache: cannot write %s (%s)", path, e)
            tmp.unlink(missing_ok=True)
            return False
        try:
            self._trim(keep=path)
        except OSError as e:  # the entry is written: the folder is trimmed at a later write
            log.warning("executable cache: cannot keep %s within its size (%s)", self.directory, e)
        return True

    def _trim(self, keep: Path) -> None:
        """Remove partial writes older than PARTIAL_WRITE_S, then the least recently used entries (oldest mtime
        first, never ``keep``) until the folder is within ``max_bytes``. Other processes may use the folder:
        a file gone meanwhile is skipped, and an entry removed under a reader is that reader's miss."""
        with self._trim_lock:
            now, total, entries = time.time(), 0, []
            for path in self.directory.iterdir():
                try:
                    info = path.lstat()
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(info.st_mode):
                    continue
                if path.suffix == ENTRY_SUFFIX:
                    entries.append((info.st_mtime, path, info.st_size))
                elif path.suffix.startswith(".tmp") and now - info.st_mtime > PARTIAL_WRITE_S:
                    path.unlink(missing_ok=True)
                    continue
                total += info.st_size
            if self.max_bytes is None or total <= self.max_bytes:
                return
            removed = freed = recent = 0
            for mtime, path, size in sorted(entries):
                if total - freed <= self.max_bytes:
                    break
                if path == keep:
                    continue
                path.unlink(missing_ok=True)
                removed, freed, recent = removed + 1, freed + size, recent + (mtime >= self._opened)
            log.info("executable cache: removed the %d least recently used entries (%s) to stay within %s",
                     removed, _size(freed), _size(self.max_bytes))
            if recent and not self._warned_small:
                self._warned_small = True
                log.warning("executable cache: %d of them were loaded or written since this engine started: the "
                            "limit (%s) is smaller than the programs in use, so restarts compile again; raise "
                            "executable_cache_size (--executable-cache-size)", recent, _size(self.max_bytes))


def xla_cache_on() -> bool:
    """Whether JAX's persistent compilation cache is in use in this process."""
    return bool(jax.config.jax_compilation_cache_dir) and bool(jax.config.jax_enable_compilation_cache)


@cache
def _initialize_lapack() -> None:
    """Fill jaxlib's LAPACK function table, which the CPU executables' triangular solves call into (the GDN
    reference's chunked form). JAX fills it while lowering such a solve; a program loaded without being lowered
    in this process would call through empty pointers."""
    try:
        from jax._src.lib import lapack  # what that lowering calls (private: lowering one solve is the fallback)

        lapack._lapack.initialize()
    except (ImportError, AttributeError):
        a = jax.ShapeDtypeStruct((2, 2), "float32")
        jax.jit(lambda x, y: jax.lax.linalg.triangular_solve(x, y, left_side=True, lower=True)).lower(a, a)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _wrap(payload: bytes) -> bytes:
    return MAGIC + hashlib.sha256(payload).digest() + payload


def _unwrap(blob: bytes) -> bytes:
    if not blob.startswith(MAGIC):
        raise ValueError("not an executable entry")
    digest, payload = blob[len(MAGIC): len(MAGIC) + 32], blob[len(MAGIC) + 32:]
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError("checksum mismatch (truncated or corrupt)")
    return payload


def stored_program(store: ExecutableStore | None, name: str, context: dict[str, Any], fn: Any,
                   args: tuple) -> jax.stages.Compiled:
    """One program outside the engine's table (the zeroed pools, random weights): loaded from ``store`` when it
    holds it, else lowered, compiled and stored."""
    if store is None:
        return fn.lower(*args).compile()
    key = store.key(name, context, args)
    compiled = store.load(name, key)
    if compiled is None:
        compiled = fn.lower(*args).compile()
        store.save(name, key, compiled)
    return compiled


def stored_value(store: ExecutableStore, name: str, context: dict[str, Any], fn: Any, args: tuple) -> Any:
    """The output of the deterministic program ``fn(*args)`` (a pytree of arrays) on the store's first device:
    read from ``store`` when it holds the value, else computed (by `stored_program`) and kept. For outputs that
    take longer to compute than to read: the CPU's random weights (DESIGN, "Executable store")."""
    key = store.key(f"{name} (value)", context, args)
    value = store.load_value(name, key)
    if value is None:
        value = stored_program(store, name, context, fn, args)(*args)
        store.save_value(name, key, value)
    return jax.device_put(value, store.devices[0])


class ProgramSpec(NamedTuple):
    """One program the engine runs: a jitted function at one set of argument shapes."""

    name: str  # for the log
    fn: Any  # a jax.jit-wrapped function
    args: tuple  # its arguments (arrays or ShapeDtypeStructs: only shapes, dtypes and shardings are read)
    essential: bool  # compiled before the engine reports ready (others may follow in the background)


class Programs:
    """The engine's compiled programs by key: each loaded from the store or compiled (and stored).

    The runner loads the stored programs start needs (``load_stored``) and compiles the missing ones
    (``compile_missing``), which may have been traced and lowered ahead (``lower``: from shapes alone, while the
    weights load); the rest build in a background thread (``compile_rest``), each usable as soon as it is built.
    """

    def __init__(self, specs: dict[Any, ProgramSpec], store: ExecutableStore | None, context: dict[str, Any]):
        self.specs, self.store, self.context = specs, store, context
        self.compiled: dict[Any, jax.stages.Compiled] = {}
        self.lowered: dict[Any, jax.stages.Lowered] = {}  # traced and lowered, not compiled yet
        self.counts = {"loaded": 0, "compiled": 0}
        self._count_lock = threading.Lock()
        self._background: threading.Thread | None = None
        self._stopping = threading.Event()  # set by `stop`: no further background builds

    def get(self, key) -> jax.stages.Compiled | None:
        return self.compiled.get(key)

    @property
    def pending(self) -> int:
        """Programs not built yet."""
        return len(self.specs) - len(self.compiled)

    def build(self, key, load: bool = True) -> jax.stages.Compiled:
        """Load ``key``'s program from the store (unless ``load`` is False: already tried), else lower (unless
        `lower` did) and compile it (and store it)."""
        compiled = self._load(key) if load else None
        if compiled is None:
            spec = self.specs[key]
            lowered = self.lowered.pop(key, None)
            compiled = (lowered if lowered is not None else spec.fn.lower(*spec.args)).compile()
            if self.store is not None:
                self.store.save(spec.name, self._store_key(key), compiled)
            self._count("compiled")
        self.compiled[key] = compiled
        return compiled

    def load_stored(self, threads: int, keys: Sequence[Any]) -> int:
        """Load those of ``keys`` that the store holds; returns how many."""
        keys = [k for k in keys if k not in self.compiled]
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="hybrid-jax-load") as pool:
            found = [(k, c) for k, c in zip(keys, pool.map(self._load, keys), strict=True) if c is not None]
        self.compiled.update(found)
        return len(found)

    def _store_key(self, key) -> str:
        spec = self.specs[key]
        return self.store.key(spec.name, self.context, spec.args)

    def _load(self, key) -> jax.stages.Compiled | None:
        """``key``'s program from the store (counted), or None."""
        if self.store is None:
            return None
        compiled = self.store.load(self.specs[key].name, self._store_key(key))
        if compiled is not None:
            self.lowered.pop(key, None)  # stored meanwhile by another process
            self._count("loaded")
        return compiled

    def _count(self, what: str) -> None:
        with self._count_lock:
            self.counts[what] += 1

    def lower(self, keys: Sequence[Any], until: Callable[[], bool] | None = None) -> tuple[int, float]:
        """Trace and lower ``keys`` (those not built or lowered yet) on this thread, in order, for `build` to
        compile later, stopping early once ``until()``; returns (programs lowered, seconds taken)."""
        keys = [k for k in keys if k not in self.compiled and k not in self.lowered]
        start, count = time.perf_counter(), 0
        for key in tqdm(keys, desc="lowering programs", unit="program", disable=None, leave=False):
            if until is not None and until():
                break
            spec = self.specs[key]
            self.lowered[key] = spec.fn.lower(*spec.args)
            count += 1
        return count, time.perf_counter() - start

    def compile_missing(self, keys: Sequence[Any], threads: int, progress: str) -> float:
        """Build ``keys`` (those not built yet), ``threads`` at a time; returns the seconds taken."""
        keys = [k for k in keys if k not in self.compiled]
        start = time.perf_counter()
        if not keys:
            return 0.0

        def build(key) -> tuple[str, float]:
            t = time.perf_counter()
            self.build(key, load=False)
            return self.specs[key].name, time.perf_counter() - t

        with ThreadPoolExecutor(max(1, min(threads, len(keys))), thread_name_prefix="hybrid-jax-compile") as pool, \
                tqdm(total=len(keys), desc=progress, unit="program", disable=None, leave=False) as bar:
            for name, seconds in pool.map(build, keys):
                log.debug("%s: %s built in %.1f s", progress, name, seconds)
                bar.update()
        return time.perf_counter() - start

    def compile_rest(self, threads: int = 1) -> threading.Thread | None:
        """Build (load or compile) every program still missing in the background, in order, ``threads`` at a
        time, until `stop` (a failure is logged and leaves that program missing: the engine runs a larger bucket
        or a plainer variant). The threads are daemons: a process that exits meanwhile waits for none of them."""
        keys = [k for k in self.specs if k not in self.compiled]
        if not keys:
            return None
        rest, take, failed = iter(keys), threading.Lock(), []

        def work() -> None:
            while not self._stopping.is_set():
                with take:
                    key = next(rest, None)
                if key is None:
                    return
                try:
                    self.build(key)
                except Exception:
                    log.exception("background compile of %s failed", self.specs[key].name)
                    failed.append(key)

        def run() -> None:
            start = time.perf_counter()
            workers = [threading.Thread(target=work, name=f"hybrid-jax-background-compile_{i}", daemon=True)
                       for i in range(threads)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            if self._stopping.is_set():
                log.info("background compiles stopped with %d programs left", self.pending)
            else:
                log.info("start-up: %d more programs built in the background in %.1f s%s", len(keys) - len(failed),
                         time.perf_counter() - start, f"; {len(failed)} failed" if failed else "; all programs ready")

        self._background = threading.Thread(target=run, name="hybrid-jax-background-compile", daemon=True)
        self._background.start()
        return self._background

    def stop(self, timeout: float | None = None) -> bool:
        """Start no more background builds; wait up to ``timeout`` s for those under way. True when none is."""
        self._stopping.set()
        return self.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background compiles; True when none is running."""
        if self._background is not None:
            self._background.join(timeout)
        return self._background is None or not self._background.is_alive()
