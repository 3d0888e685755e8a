"""``hybrid-jax generate`` and ``score`` on JSONL files with the embedded tiny model, ``export-tokenizer``;
``serve``'s flags."""

from __future__ import annotations

import json
import math

import pytest

from hybrid_jax.chat import BUILTIN_TEMPLATE, ChatTemplate
from hybrid_jax.cli import main, parser
from hybrid_jax.tokenizer import load_tokenizer
from server.cli import add_serve

EXPORT_TEXT = "Hello wörld, 12345 你好 <|im_end|><think>\n</think> tabs\tand  spaces"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


GENERATE_ROWS = [{"prompt": "Hello"}, {"prompt_token_ids": [1, 2, 3], "max_tokens": 2},
                 {"prompt": "Bye", "temperature": 1.0, "seed": 3}]


def generate(directory, tensor_parallel_size: int) -> list[dict]:
    """`hybrid-jax generate` over GENERATE_ROWS (greedy unless a row says otherwise): the output rows."""
    source, target = directory / "in.jsonl", directory / f"out_tp{tensor_parallel_size}.jsonl"
    write_jsonl(source, GENERATE_ROWS)
    main(["generate", "--input", str(source), "--output", str(target), "--max-batch", "2", "--max-model-len", "64",
          "--max-tokens", "4", "--temperature", "0", "--ignore-eos", "--decode-sizes", "2", "--prefill-chunk", "32",
          "--tensor-parallel-size", str(tensor_parallel_size)])
    return read_jsonl(target)


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> list[dict]:
    return generate(tmp_path_factory.mktemp("generate"), 1)


def test_generate(generated):
    assert [r["prompt"] for r in generated] == ["Hello", None, "Bye"]
    assert [len(r["token_ids"]) for r in generated] == [4, 2, 4]
    assert all(r["finish_reason"] == "length" and isinstance(r["text"], str) for r in generated)


def test_generate_tensor_parallel_matches_single_device(generated, tmp_path):
    sharded = generate(tmp_path, 2)
    greedy = [0, 1]  # the sampled row's draws need not survive the sharded reductions' rounding
    assert [sharded[i]["token_ids"] for i in greedy] == [generated[i]["token_ids"] for i in greedy]


def test_score(tmp_path):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(source, [{"text": "The cat sat"}, {"prompt_token_ids": [5, 6, 7, 8]}])
    main(["score", "--input", str(source), "--output", str(target), "--max-model-len", "64"])
    rows = read_jsonl(target)
    assert len(rows[1]["token_ids"]) == 4 and len(rows[1]["logprobs"]) == 3
    for row in rows:
        assert all(v <= 0 for v in row["logprobs"])
        assert math.isclose(row["total_logprob"], sum(row["logprobs"]), rel_tol=1e-6)


def test_export_tokenizer(tmp_path):
    import tokenizers

    main(["export-tokenizer", str(tmp_path / "tok")])
    exported = tokenizers.Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    assert exported.encode(EXPORT_TEXT, add_special_tokens=False).ids == load_tokenizer().encode(EXPORT_TEXT)
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == BUILTIN_TEMPLATE
    assert (config["eos_token"], config["pad_token"], config["bos_token"]) == ("<|im_end|>", "<|endoftext|>", None)
    with pytest.raises(SystemExit, match="model-path"):
        main(["export-tokenizer", str(tmp_path / "other"), "--model-path", str(tmp_path / "missing")])


def test_exported_tokenizer_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    main(["export-tokenizer", str(tmp_path)])
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.encode(EXPORT_TEXT, add_special_tokens=False) == load_tokenizer().encode(EXPORT_TEXT)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ChatTemplate.builtin().render(messages)
    assert hf.eos_token == "<|im_end|>"


def test_bad_input_line_names_the_line(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "ok"}\n{"oops": 1}\n')
    with pytest.raises(SystemExit, match=r"in.jsonl:2"):
        main(["score", "--input", str(source), "--output", str(tmp_path / "out.jsonl"), "--max-model-len", "64"])


def test_serve_comes_from_the_server():
    """`server.cli` adds ``serve`` to the batch jobs' command line; `hybrid_jax.cli` alone has no ``serve``."""
    args = parser(add_serve).parse_args(["serve", "--port", "9", "--max-batch", "4"])
    assert (args.command, args.port, args.max_batch, args.max_model_len, args.threads) == ("serve", 9, 4, 4096, 64)
    assert parser(add_serve).parse_args(["score", "--input", "a", "--output", "b"]).max_batch == 1
    with pytest.raises(SystemExit):
        parser().parse_args(["serve"])
