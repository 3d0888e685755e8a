"""The executable store: a restarted engine loads its programs instead of compiling them and gives the same tokens;
a corrupt or stale entry is compiled again; a directory others can write is refused; the folder keeps within its
size, least recently used first; background compiles serve the same tokens as a full warm-up, and each runs once
while the engine idles."""

import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hybrid_jax
from hybrid_jax.compilation_cache import CacheDirError, ExecutableDir, executable_dir
from hybrid_jax.engine import programs
from hybrid_jax.engine.engine import Engine, EngineConfig
from hybrid_jax.engine.programs import ExecutableStore, Programs, _unwrap, _wrap, stored_value
from hybrid_jax.engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]

# A fresh process without JAX's compilation cache (its hits are not stored on the CPU: see programs.py).
RUN = """
import json, logging, sys
import jax
import numpy as np
import hybrid_jax
from hybrid_jax.engine.engine import Engine, EngineConfig
from hybrid_jax.engine.llm import stored_random_model
from hybrid_jax.weights import abstract_model
from hybrid_jax.engine.sampling_params import SamplingParams

compiles = []
class Compiles(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("Compiling "):
            compiles.append(record.getMessage()[:120])
logging.getLogger("jax").addHandler(Compiles())
jax.config.update("jax_log_compiles", True)
model = stored_random_model(abstract_model(hybrid_jax.preset("tiny").replace(vocab_size=512), np.float32), 1,
                            sys.argv[1])
config = EngineConfig(max_batch=2, max_model_len=int(sys.argv[2]), page_size=16, prefill_chunk=32, decode_steps=2,
                      prefill_sizes=(32,), decode_sizes=(2,))
engine = Engine(model, config, executable_dir=sys.argv[1])
if sys.argv[3] == "load":  # load what the store holds, compile nothing
    print(json.dumps({"all_loaded": engine.load_stored_programs(), "counts": engine.programs.counts}))
    sys.exit()
engine.start()
rng = np.random.default_rng(0)
params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
handles = [engine.submit(rng.integers(0, 512, n).tolist(), params) for n in (5, 40)]
tokens = [[e.token_id for e in h if e.token_id is not None] for h in handles]
engine.shutdown()
print(json.dumps({"counts": engine.programs.counts, "total": len(engine.programs.specs), "tokens": tokens,
                  "compiles": compiles}))
"""


def run_engine(directory: Path, max_model_len: int = 128, mode: str = "serve") -> tuple[dict, str]:
    """A fresh process's engine over the store in ``directory``: started and serving two requests ("serve"), or
    only loading the stored programs it would start with ("load")."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false")
    out = subprocess.run([sys.executable, "-c", RUN, str(directory), str(max_model_len), mode], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.slow
def test_restart_loads_every_program_and_gives_the_same_tokens(tmp_path):
    store = tmp_path / "executables"
    cold, _ = run_engine(store)
    assert cold["counts"] == {"loaded": 0, "compiled": cold["total"]}
    warm, _ = run_engine(store)
    assert warm["counts"] == {"loaded": warm["total"], "compiled": 0}
    assert warm["compiles"] == []  # nor the random weights, the pools' zeroing or anything else
    assert warm["tokens"] == cold["tokens"]

    entries = {json.loads(pickle.loads(_unwrap(p.read_bytes()))[0])["name"]: p for p in store.glob("*.xla")}
    # and the random weights' program and its output, the pools' and the snapshots' programs
    assert len(entries) == cold["total"] + 4
    prefill = entries[next(name for name in entries if name.startswith("prefill"))]
    prefill.write_bytes(prefill.read_bytes()[: prefill.stat().st_size // 2])  # truncated
    entries["random weights (value)"].write_bytes(b"garbage")
    repaired, log = run_engine(store)
    assert repaired["counts"] == {"loaded": repaired["total"] - 1, "compiled": 1}
    assert repaired["tokens"] == cold["tokens"]  # the weights made again by their stored program
    assert log.count("unusable") == 2 and "building it again" in log

    same, _ = run_engine(store, mode="load")
    assert same == {"all_loaded": True, "counts": {"loaded": cold["total"], "compiled": 0}}
    other, _ = run_engine(store, max_model_len=96, mode="load")  # another engine setting: other keys
    assert other == {"all_loaded": False, "counts": {"loaded": 0, "compiled": 0}}


def test_keys_name_everything_that_changes_a_program(tmp_path):
    store = ExecutableStore(tmp_path / "x", jax.devices()[:1])
    args = (jax.ShapeDtypeStruct((4, 8), np.float32), np.zeros(3, np.int32))
    key = store.key("decode", {"engine": {"max_batch": 4}}, args)
    assert store.key("decode", {"engine": {"max_batch": 4}}, args) == key
    assert store.key("decode", {"engine": {"max_batch": 8}}, args) != key
    assert store.key("prefill", {"engine": {"max_batch": 4}}, args) != key
    assert store.key("decode", {"engine": {"max_batch": 4}}, (args[0], np.zeros(4, np.int32))) != key
    assert store.key("decode", {"engine": {"max_batch": 4}}, (args[0], np.zeros(3, np.int64))) != key
    env = json.loads(key)["env"]
    assert {"jax", "jaxlib", "device_kind", "devices", "source", "env"} <= env.keys()


def test_a_directory_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(CacheDirError, match="writable by group or others"):
        ExecutableStore(shared, jax.devices()[:1])
    shared.chmod(0o755)
    ExecutableStore(shared, jax.devices()[:1])


def test_unreadable_entries_are_misses(tmp_path, caplog):
    store = ExecutableStore(tmp_path / "x", jax.devices()[:1])
    key = store.key("double", {}, (np.ones(3, np.float32),))
    assert store.load("double", key) is None  # missing: no log line
    assert "unusable" not in caplog.text
    other = store.key("other", {}, (np.ones(3, np.float32),))
    store.path(key).write_bytes(_wrap(pickle.dumps((other, b"", None, None))))  # another program's entry
    assert store.load("double", key) is None and "differs" in caplog.text
    store.path(key).write_bytes(store.path(key).read_bytes()[:-3])
    assert store.load("double", key) is None and "checksum" in caplog.text


def test_stored_values_are_read_back_bitwise_and_rebuilt_when_corrupt(tmp_path, monkeypatch, caplog):
    store = ExecutableStore(tmp_path / "x", jax.devices()[:1])
    noise = jax.jit(lambda seed: {"a": jax.random.normal(jax.random.key(seed), (4, 3)), "b": jnp.arange(5) * seed})
    args = (np.int32(3),)
    made = stored_value(store, "noise", {}, noise, args)
    with monkeypatch.context() as patch:  # read back: the program is neither loaded nor run
        patch.setattr(programs, "stored_program", lambda *a: pytest.fail("the stored value was not used"))
        read = stored_value(store, "noise", {}, noise, args)
    assert jax.tree.all(jax.tree.map(lambda x, y: bool((x == y).all()), made, read))
    assert isinstance(read["a"], jax.Array) and read["a"].dtype == made["a"].dtype
    assert "unusable" not in caplog.text
    entry = store.path(store.key("noise (value)", {}, args))
    entry.write_bytes(entry.read_bytes()[:-8])  # truncated: built again and rewritten
    rebuilt = stored_value(store, "noise", {}, noise, args)
    assert "unusable" in caplog.text and "checksum" in caplog.text
    assert jax.tree.all(jax.tree.map(lambda x, y: bool((x == y).all()), made, rebuilt))
    assert store.load_value("noise", store.key("noise (value)", {}, args)) is not None


def write_values(store: ExecutableStore, names: str, mtimes: list[float] | None = None) -> dict[str, Path]:
    """An entry of ~1 KiB per name in ``names``, stored in turn (its mtime set after, if given); their paths."""
    paths = {}
    for i, name in enumerate(names):
        key = store.key(name, {}, ())
        assert store.save_value(name, key, np.full(256, i, np.float32))
        paths[name] = store.path(key)
        if mtimes is not None:
            os.utime(paths[name], (mtimes[i], mtimes[i]))
    return paths


def entry_bytes(tmp_path: Path) -> int:
    """The size of one `write_values` entry."""
    probe = ExecutableStore(ExecutableDir(tmp_path / "probe", None), jax.devices()[:1])
    return write_values(probe, "a")["a"].stat().st_size


def test_the_folder_keeps_within_its_size_least_recently_used_first(tmp_path, caplog):
    size, hour_ago = entry_bytes(tmp_path), time.time() - 3600
    store = ExecutableStore(ExecutableDir(tmp_path / "x", 3 * size), jax.devices()[:1])
    paths = write_values(store, "abc", [hour_ago, hour_ago + 10, hour_ago + 20])
    assert store.load_value("a", store.key("a", {}, ())) is not None  # a load makes "a" the most recent
    with caplog.at_level(logging.INFO, "hybrid_jax.engine"):
        paths |= write_values(store, "d")
    assert {name for name, path in paths.items() if path.exists()} == {"a", "c", "d"}
    assert "removed the 1 least recently used entries" in caplog.text
    assert "loaded or written since this engine started" not in caplog.text  # "b" was an hour old

    unlimited = ExecutableStore(ExecutableDir(tmp_path / "y", None), jax.devices()[:1])
    assert all(path.exists() for path in write_values(unlimited, "abcdef").values())


def test_a_limit_below_the_programs_in_use_is_reported(tmp_path, caplog):
    store = ExecutableStore(ExecutableDir(tmp_path / "x", 2 * entry_bytes(tmp_path)), jax.devices()[:1])
    paths = write_values(store, "abc")  # all three written by this engine: the oldest goes, with a warning
    assert [path.exists() for path in paths.values()] == [False, True, True]
    assert "1 of them were loaded or written since this engine started" in caplog.text
    assert "--executable-cache-size" in caplog.text


def test_partial_writes_of_dead_processes_are_removed(tmp_path):
    store = ExecutableStore(ExecutableDir(tmp_path / "x", None), jax.devices()[:1])
    dead, live = store.directory / "0123.tmp999-1", store.directory / "4567.tmp998-2"
    for path, age in ((dead, 2 * programs.PARTIAL_WRITE_S), (live, 5)):
        path.write_bytes(b"partial")
        os.utime(path, (time.time() - age, time.time() - age))
    write_values(store, "a")
    assert not dead.exists() and live.exists()


def test_a_folder_that_cannot_be_trimmed_still_stores(tmp_path, monkeypatch, caplog):
    store = ExecutableStore(ExecutableDir(tmp_path / "x", 1), jax.devices()[:1])

    def refuse(*args, **kwargs):
        raise PermissionError("read-only")

    monkeypatch.setattr(Path, "unlink", refuse)
    paths = write_values(store, "ab")
    assert all(path.exists() for path in paths.values()) and "cannot keep" in caplog.text


def test_cache_sizes_are_checked_where_given(tmp_path):
    assert executable_dir(tmp_path, 0.5) == ExecutableDir(tmp_path / "executables", 2**29)
    assert executable_dir(tmp_path, 0).max_bytes is None  # no limit
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="executable_cache_size"):
            executable_dir(tmp_path, bad)
    assert ExecutableStore(tmp_path / "bare", jax.devices()[:1]).max_bytes == ExecutableDir(tmp_path).max_bytes


def test_nothing_is_written_on_the_cpu_while_jaxs_cache_is_on(tmp_path, caplog):
    """The suite runs with JAX's compilation cache on (conftest): an executable it returns would lose its code."""
    assert jax.config.jax_compilation_cache_dir
    store = ExecutableStore(tmp_path / "x", jax.devices()[:1])
    compiled = jax.jit(lambda x: x * 2 + 1).lower(np.ones(3, np.float32)).compile()
    key = store.key("double", {}, (np.ones(3, np.float32),))
    assert not store.save("double", key, compiled) and not store.path(key).exists()
    assert "not written while JAX's compilation cache is on" in caplog.text


@pytest.fixture(scope="module")
def model():
    return hybrid_jax.load_pretrained(ROOT / "tests" / "fixtures" / "golden" / "causal_grouped", "float32")


def test_background_compiles_serve_the_same_tokens_then_run_once_while_idle(model):
    """Ready with only the largest buckets built: requests run on them (or a plainer variant) while the rest
    compile, with the tokens of an engine that built everything first. Then each program built in the
    background runs once on a padding batch while the engine idles, not inside a request (a first run costs on
    a GPU: it records CUDA graphs), and those runs leave the cached prefixes intact."""
    options = dict(max_batch=4, max_model_len=256, page_size=16, prefill_chunk=64, max_prefill_seqs=2,
                   decode_steps=3)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 512, n).tolist() for n in (3, 30, 70)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def serve(engine):
        handles = [engine.submit(p, params) for p in prompts]
        return [[e.token_id for e in h if e.token_id is not None] for h in handles], handles

    full = Engine(model, EngineConfig(**options)).start()
    assert full.programs.pending == 0
    try:
        want, _ = serve(full)
    finally:
        full.shutdown()
    background = Engine(model, EngineConfig(**options, background_compile=True))
    background.runner.first_runs = True  # as on a GPU (the CPU records nothing on a first run)
    background.start()
    try:
        built = set(background.programs.compiled)
        assert {k for k, spec in background.programs.specs.items() if spec.essential} <= built
        assert background.programs.pending > 0 or len(built) == len(background.programs.specs)
        assert serve(background)[0] == want
        assert background.programs.wait(600) and background.programs.pending == 0
        runner, deadline = background.runner, time.monotonic() + 120
        while background.stats()["programs_first_runs_pending"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(key in runner.ran_once or runner.runs[key] for key in background.programs.specs)
        assert runner.first_runs_pending() == 0
        ran_idle = runner.ran_once - set(runner.start_programs)  # the warm-up ran those
        assert {k[0] for k in ran_idle} >= {"prefill", "decode"}
        tokens, handles = serve(background)
        assert tokens == want and handles[2].num_cached_tokens == 64
    finally:
        background.shutdown()


def test_shutdown_stops_the_background_compiles(model, monkeypatch, caplog):
    """A shutdown waits for the builds under way, not for every program left (a process that exits without one
    waits for none: the builders are daemon threads). Each background build is slowed so that many are left."""
    caplog.set_level(logging.INFO, "hybrid_jax.engine")
    build = Programs.build

    def slow_in_background(self, key, load=True):
        if threading.current_thread().name.startswith("hybrid-jax-background-compile"):
            time.sleep(0.5)
        return build(self, key, load)

    monkeypatch.setattr(Programs, "build", slow_in_background)
    engine = Engine(model, EngineConfig(max_batch=4, max_model_len=256, page_size=16, prefill_chunk=64,
                                        decode_steps=3, background_compile=True)).start()
    left = engine.programs.pending
    assert left > 4
    engine.shutdown()
    assert engine.programs.wait(0)  # nothing builds after the shutdown
    builders = [t for t in threading.enumerate() if t.name.startswith("hybrid-jax-background-compile")]
    assert engine.programs.pending >= left - 2 and not builders  # at most the builds under way finished
    assert f"background compiles stopped with {engine.programs.pending} programs left" in caplog.text


def test_programs_lower_from_an_abstract_model_while_its_weights_load(model):
    """An engine over the model's shapes traces and lowers its programs (as a cold start does while the weights
    load), until the weights are in; given the loaded model it compiles those lowerings, allocates its pools and
    serves the plain engine's tokens. One whose programs turn up built (another process stored them) starts too,
    and so does one started without a warm-up (its programs compile on first use)."""
    from hybrid_jax.weights import abstract_model

    options = EngineConfig(max_batch=2, max_model_len=128, page_size=16, prefill_chunk=32, decode_steps=2,
                           prefill_sizes=(32,), decode_sizes=(1,))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = list(range(3, 40))
    plain = Engine(model, options).start(warmup=False)  # builds only what it runs
    try:
        want = [e.token_id for e in plain.submit(prompt, params) if e.token_id is not None]
    finally:
        plain.shutdown()
    engine = Engine(abstract_model(model.config, model.dtype), options)
    assert engine.pools is None  # they wait for the compiles
    engine.lower_start_programs(until=lambda: True)  # the weights are in: nothing is lowered
    programs = engine.programs
    assert not programs.lowered
    engine.lower_start_programs()
    assert set(programs.lowered) == set(programs.specs) and not programs.compiled
    with pytest.raises(RuntimeError, match="attach"):
        engine.start()
    with pytest.raises(ValueError, match="parameters differ"):
        engine.attach(hybrid_jax.random_model(model.config.replace(vocab_size=256), "float32"))
    engine.attach(model)
    engine.start()
    assert not programs.lowered and programs.counts["compiled"] == len(programs.specs)
    try:
        assert [e.token_id for e in engine.submit(prompt, params) if e.token_id is not None] == want
    finally:
        engine.shutdown()
    late = Engine(abstract_model(model.config, model.dtype), options)
    late.programs.compiled.update(programs.compiled)
    late.attach(model)
    late.start()
    try:
        assert [e.token_id for e in late.submit(prompt, params) if e.token_id is not None] == want
    finally:
        late.shutdown()
    lazy = Engine(abstract_model(model.config, model.dtype), options)  # its programs compile on first use
    lazy.lower_start_programs()
    lazy.attach(model)
    lazy.start(warmup=False)
    try:
        assert lazy.pools is not None
        assert [e.token_id for e in lazy.submit(prompt, params) if e.token_id is not None] == want
    finally:
        lazy.shutdown()


def test_prefill_has_no_branch_for_the_host_to_wait_on(model):
    """A data-dependent branch (lax.cond) makes the host wait for the device mid-call; prefill has none (its few
    rows take every sampling path, or all are greedy), so the host queues the next decode call while a prefill
    runs. The greedy-only prefill skips the filters' sort and the top logprobs' selection."""
    engine = Engine(model, EngineConfig(max_batch=2, max_model_len=64, page_size=16, prefill_chunk=32))
    specs = engine.runner.programs.specs
    lowered = lambda key: specs[key].fn.lower(*specs[key].args).as_text()
    general, greedy = lowered(("prefill", False, 32)), lowered(("prefill", True, 32))
    assert "stablehlo.case" not in general and "stablehlo.case" not in greedy
    assert "stablehlo.sort" in general and "stablehlo.sort" not in greedy
    assert "stablehlo.case" in lowered(("decode", False, 1, 2))  # the general decode's branches
    engine.release()
