"""Parse time of two tokenizer.json files, alternating: python tok_parse.py ROUNDS NAME=FILE NAME=FILE."""

import statistics
import sys
import time

import tokenizers

rounds, files = int(sys.argv[1]), dict(arg.split("=", 1) for arg in sys.argv[2:])
seconds = {name: [] for name in files}
for _ in range(rounds):
    for name, file in files.items():
        begin = time.perf_counter()
        tokenizers.Tokenizer.from_file(file)
        seconds[name].append(time.perf_counter() - begin)
for name, values in seconds.items():
    summary = f"{name:14s} median {statistics.median(values):.3f} s  min {min(values):.3f} s  all"
    print(summary, *(f"{v:.3f}" for v in values))
