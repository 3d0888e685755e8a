"""The prefix cache's server surface: the serve flag, the metrics, cached tokens in usage, cache_salt, the reset
endpoint."""

from types import SimpleNamespace

import pytest

from hybrid_jax.cli import parser
from hybrid_jax.engine.sampling_params import SamplingParams
from hybrid_jax.tokenizer import load_tokenizer
from server.app import create_app
from server.backend import Backend
from server.cli import add_serve
from server.errors import APIError
from server.generation import Generation
from server.metrics import ServerMetrics
from server.protocol import parse_chat, parse_completion
from server.settings import Settings


def test_serve_flag():
    assert parser(add_serve).parse_args(["serve", "--enable-prefix-caching"]).enable_prefix_caching is True
    assert parser(add_serve).parse_args(["serve", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parser(add_serve).parse_args(["serve"]).kv_offloading_size == 0.0
    assert parser(add_serve).parse_args(["serve", "--kv-offloading-size", "64"]).kv_offloading_size == 64.0
    args = parser(add_serve).parse_args(["serve"])
    assert (args.snapshot_stride, args.snapshot_share) == (Settings.snapshot_stride, Settings.snapshot_share)
    args = parser(add_serve).parse_args(["serve", "--snapshot-stride", "1", "--snapshot-share", "0.25"])
    assert (args.snapshot_stride, args.snapshot_share) == (1, 0.25)


@pytest.mark.parametrize(("flags", "named"), [(["--snapshot-stride", "0"], "--snapshot-stride"),
                                              (["--snapshot-share", "1"], "--snapshot-share"),
                                              (["--snapshot-share", "0"], "--snapshot-share")])
def test_snapshot_flags_out_of_range_exit_naming_the_flag(flags, named):
    args = parser(add_serve).parse_args(["serve", *flags])
    with pytest.raises(SystemExit, match=named):
        args.run(args)


def test_prefix_cache_counters_on_metrics():
    stats = {"prefix_cache_queries": 300, "prefix_cache_hits": 128, "prefix_cache_host_hits": 64,
             "host_bytes_used": 4096}
    text = ServerMetrics(lambda: stats, "m").render().decode()
    assert 'vllm:prefix_cache_queries_total{model_name="m"} 300.0' in text
    assert 'vllm:prefix_cache_hits_total{model_name="m"} 128.0' in text
    assert 'hybrid_jax:prefix_cache_host_hits_total{model_name="m"} 64.0' in text
    assert 'hybrid_jax:prefix_cache_host_bytes_used{model_name="m"} 4096.0' in text


def test_usage_counts_cached_tokens_once_per_prompt():
    generation = Generation.__new__(Generation)
    handle = lambda cached: SimpleNamespace(num_cached_tokens=cached)
    output = SimpleNamespace(token_ids=[1, 2])
    generation.prompts = [[0] * 100, [0] * 70]
    generation.choices = [SimpleNamespace(handle=handle(c), output=output) for c in (64, 64, 0, 0)]  # n = 2
    assert generation.usage() == {"prompt_tokens": 170, "completion_tokens": 8, "total_tokens": 178,
                                  "prompt_tokens_details": {"cached_tokens": 64}}


def test_cache_salt_reaches_every_choice_and_must_be_a_non_empty_string():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_completion({"prompt": "x", "cache_salt": "tenant-a"}, {}).cache_salt == "tenant-a"
    assert parse_chat({**chat, "cache_salt": "tenant-a"}, {}).cache_salt == "tenant-a"
    assert parse_chat(chat, {}).cache_salt is None
    with pytest.raises(APIError) as caught:
        parse_completion({"prompt": "x", "cache_salt": 5}, {})
    assert caught.value.param == "cache_salt"
    salts = []
    engine = SimpleNamespace(submit=lambda ids, params, cache_salt=None: salts.append(cache_salt))
    Generation(engine, load_tokenizer(), ServerMetrics(lambda: {}, "m"), [[1, 2], [3]], 2,
               lambda sample: SamplingParams(max_tokens=1), "tenant-a")
    assert salts == ["tenant-a"] * 4


def test_an_empty_cache_salt_is_a_400_naming_the_field():
    def submit(ids, params, cache_salt=None):  # as Engine.submit checks it
        raise ValueError("cache_salt: must be a non-empty string if given")

    engine = SimpleNamespace(submit=submit)
    with pytest.raises(APIError) as caught:
        Generation(engine, load_tokenizer(), ServerMetrics(lambda: {}, "m"), [[1]], 1,
                   lambda sample: SamplingParams(max_tokens=1), "")
    assert caught.value.status == 400 and caught.value.param == "cache_salt"


def test_reset_endpoint_resets_the_engines_prefix_cache():
    resets = []
    engine = SimpleNamespace(reset_prefix_cache=lambda: resets.append(True), shutdown=lambda: None)
    backend = Backend(Settings(), lambda settings: SimpleNamespace(engine=engine, tokenizer=load_tokenizer()))
    client = create_app(Settings(), backend).test_client()
    assert backend.ready.wait(30)
    assert client.post("/reset_prefix_cache").status_code == 200 and resets == [True]
