"""One warm start as the server's worker makes it (the launcher's order, then the backend), without gunicorn.
argv: mode (plain) cache_dir; env T0: the launching shell's clock. Prints a timeline, and the process's CPU
seconds at ready."""

import logging
import os
import resource
import sys
import threading
import time

T0 = float(os.environ["T0"])


def stamp(msg):
    print(f"{time.time() - T0:7.3f} {threading.current_thread().name:24s} {msg}", flush=True)


stamp("python up")
mode, cache = sys.argv[1], sys.argv[2]
import server.cli  # noqa: E402,F401  (the arbiter's imports)
from server import launcher  # noqa: E402

stamp("arbiter imports")
launcher.start_backend_client()
stamp("jax imported")
import server.app  # noqa: E402,F401

stamp("server.app imported")
logging.basicConfig(level=logging.INFO, format="%(message)s")


class Stamp(logging.Handler):
    def emit(self, record):
        if "start-up" in record.getMessage() or record.levelno >= logging.WARNING:
            stamp(record.getMessage()[:90])


logging.getLogger("hybrid_jax").addHandler(Stamp())
logging.getLogger().handlers[0].setLevel(logging.ERROR)
from server.backend import default_llm  # noqa: E402
from server.settings import Settings  # noqa: E402

default_llm(Settings(max_batch=64, max_model_len=4096, prefill_chunk=1024, decode_steps=4, compilation_cache_dir=cache))
usage = resource.getrusage(resource.RUSAGE_SELF)
stamp(f"cpu {usage.ru_utime + usage.ru_stime:.2f} ready")
os._exit(0)
