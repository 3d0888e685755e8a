"""One warm start as the server's worker makes it, without gunicorn, with a timeline: new (this tree's
launcher order) or old (the arbiter's imports first). argv: mode cache_dir."""
import os
import sys
import threading
import time

T0 = float(os.environ["T0"])  # the launching shell's clock at exec


def stamp(msg):
    print(f"{time.time() - T0:7.3f} {threading.current_thread().name:24s} {msg}", flush=True)


stamp("python up")
mode, cache = sys.argv[1], sys.argv[2]
if mode == "new":
    import server.cli  # noqa: F401  (the arbiter's imports)
    stamp("arbiter imports")
    import jax
    stamp("jax imported")

    def client():
        jax.devices()
        stamp("client up")

    threading.Thread(target=client, name="client").start()
else:
    import server.cli  # noqa: F401
    stamp("arbiter imports")
import server.app  # noqa: E402,F401

stamp("server.app imported")
import logging  # noqa: E402

logging.basicConfig(level=logging.INFO, format="%(message)s")


class Stamp(logging.Handler):
    def emit(self, record):
        if "start-up" in record.getMessage():
            stamp(record.getMessage()[:90])


logging.getLogger("hybrid_jax").addHandler(Stamp())
logging.getLogger().handlers[0].setLevel(logging.ERROR)
import hybrid_jax.engine.llm as llm  # noqa: E402

real_tok, real_dev = llm.load_tokenizer, llm.start_devices


def tok(*a):
    stamp("parse begins")
    t = real_tok(*a)
    stamp("parse ends")
    return t


def dev(*a):
    stamp("start_devices called")
    d = real_dev(*a)
    stamp("start_devices returned (first allocation done)")
    return d


llm.load_tokenizer, llm.start_devices = tok, dev
from server.backend import default_llm  # noqa: E402
from server.settings import Settings  # noqa: E402

default_llm(Settings(model_path=os.environ.get("PROBE_MODEL") or None, max_batch=64, max_model_len=4096,
                     prefill_chunk=1024, decode_steps=4,
                     compilation_cache_dir=cache))
stamp("ready")
os._exit(0)
