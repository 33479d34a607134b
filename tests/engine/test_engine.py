"""The engine end to end on one worker: events, stop/length/abort, sampling, layouts, batching,
concurrency and block accounting."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvconnect.core.errors import ConfigError, InvalidRequestError
from kvconnect.engine import (
    EOS_ID,
    Engine,
    EngineConfig,
    EngineStateError,
    FinishReason,
    ModelConfig,
    SamplingParams,
)
from kvconnect.engine.attention import BatchItem, build_batch
from kvconnect.engine.tokenizer import VOCAB_SIZE, WORD_BASE

from .support import DEADLINE_S, LAYOUTS, Collector, generate, prompt, small_config, submit, wait_until


@pytest.fixture
def engine() -> Iterator[Engine]:
    with Engine(small_config()) as e:
        yield e


def test_generates_max_tokens_then_length(engine: Engine) -> None:
    free = engine.allocator.num_free
    c = generate(engine, prompt(0, 20), 12)
    assert len(c.tokens) == 12 and len(c.events) == 13
    assert [e.num_output_tokens for e in c.events] == [*range(1, 13), 12]
    assert all(e.num_prompt_tokens == 20 for e in c.events)
    assert all(lp is not None and lp <= 0 for lp in c.logprobs)
    assert all(WORD_BASE <= t < VOCAB_SIZE for t in c.tokens), c.tokens  # words, readable (tokenizer.py)
    final = c.final
    assert final.finish_reason is FinishReason.LENGTH and final.finish_reason == "length"
    assert final.token_id is None and final.error is None
    wait_until(lambda: engine.allocator.num_free == free and engine.num_running == 0, what="blocks back")


def test_one_token_prompt_and_output(engine: Engine) -> None:
    c = generate(engine, [256], 1)
    assert len(c.tokens) == 1 and c.final.finish_reason == "length"


def test_stop_token_ends_without_being_emitted(engine: Engine) -> None:
    ids = prompt(1, 15)
    first = generate(engine, ids, 3, "probe").tokens
    stop = SamplingParams(max_tokens=10, stop_token_ids=(first[1],), ignore_eos=True)
    c = generate(engine, ids, 10, "stop", sampling=stop)
    assert c.tokens == first[:1]
    assert c.final.finish_reason == "stop" and c.final.num_output_tokens == 2


def test_eos_stops_unless_ignored() -> None:
    ids = prompt(2, 10)
    e = Engine(small_config())
    with torch.inference_mode():
        logits = e.model.forward(build_batch([BatchItem(ids, 0, list(range(8)))], 16, "cpu"), e.cache)
        assert logits is not None
        first = int(logits[0].argmax())
        e.model.lm_head[EOS_ID] = 10 * e.model.lm_head[first]  # EOS now beats every token there
    with e:
        c = generate(e, ids, 5, "eos", sampling=SamplingParams(max_tokens=5))
        assert c.tokens == [] and c.final.finish_reason == "stop" and c.final.num_output_tokens == 1
        c = generate(e, ids, 2, "ignore", sampling=SamplingParams(max_tokens=2, ignore_eos=True))
        assert c.tokens[0] == EOS_ID and c.final.finish_reason == "length"


def test_all_layouts_give_identical_tokens_and_logprobs() -> None:
    outs = []
    for layout in LAYOUTS:
        with Engine(small_config(layout)) as e:
            cs = [submit(e, f"r{i}", prompt(i, 5 + 9 * i), 10) for i in range(3)]
            outs.append([(c.wait().tokens, c.logprobs) for c in cs])
    assert outs[0] == outs[1] == outs[2]


def test_batched_decode_is_bitwise_equal_to_alone() -> None:
    lengths = [7, 16, 17, 40, 3, 25, 12, 33]
    with Engine(small_config()) as e:
        alone = [generate(e, prompt(i, n), 12, f"alone{i}") for i, n in enumerate(lengths)]
        assert e.peak_decode_batch == 1
    e = Engine(small_config())
    together = [submit(e, f"t{i}", prompt(i, n), 12) for i, n in enumerate(lengths)]  # queued before start
    with e:
        for c in together:
            c.wait()
        assert e.peak_decode_batch >= len(lengths) - 1
    for a, t in zip(alone, together, strict=True):
        assert t.tokens == a.tokens
        assert t.logprobs == a.logprobs  # floats compared exactly: the logits were bit-identical


def test_sixteen_concurrent_requests() -> None:
    cases = [(prompt(40 + i, 3 + 5 * i), 4 + i % 9) for i in range(16)]
    with Engine(small_config(num_blocks=128)) as e:
        start_free = e.allocator.num_free
        want = [generate(e, ids, n, f"ref{i}").tokens for i, (ids, n) in enumerate(cases)]
        results: list[Collector] = [Collector() for _ in cases]

        def client(i: int) -> None:
            ids, n = cases[i]
            e.add_request(f"c{i}", ids, SamplingParams(max_tokens=n, ignore_eos=True), results[i])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for i, c in enumerate(results):
            c.wait()
            assert c.final.finish_reason == "length"
            assert c.tokens == want[i], f"request {i}"
        assert e.peak_decode_batch > 1
        wait_until(lambda: e.allocator.num_free == start_free, what="all blocks freed")
        # the counters are refreshed after the final events are sent: poll, do not race them
        wait_until(lambda: e.num_running == 0 and e.num_waiting == 0, what="counters back to zero")


def test_requests_wait_for_blocks() -> None:
    cfg = small_config(num_blocks=4, model=ModelConfig(max_position=128))
    with Engine(cfg) as e:
        ref = [generate(e, prompt(i, 20), 30, f"ref{i}").tokens for i in range(2)]
    e = Engine(cfg)
    cs = [submit(e, f"r{i}", prompt(i, 20), 30) for i in range(2)]  # 49 tokens each: 4 blocks each
    with e:
        for c, want in zip(cs, ref, strict=True):
            assert c.wait().tokens == want
        assert e.peak_decode_batch == 1  # never both admitted at once
        assert e.allocator.num_free == 4


def test_seeded_sampling_is_deterministic(engine: Engine) -> None:
    ids = prompt(5, 12)

    def run(rid: str, **kw: object) -> list[int]:
        params = SamplingParams(max_tokens=16, ignore_eos=True, **kw)  # type: ignore[arg-type]
        return generate(engine, ids, 16, rid, sampling=params).tokens

    a, b = run("a", temperature=1.0, seed=7), run("b", temperature=1.0, seed=7)
    c = run("c", temperature=1.0, seed=8)
    greedy = run("g")
    assert a == b and a != c and a != greedy
    assert run("p", temperature=1.0, seed=9, top_p=1e-9) == greedy  # top-p keeps only the argmax


def test_abort_frees_blocks(engine: Engine) -> None:
    free = engine.allocator.num_free
    c = submit(engine, "long", prompt(6, 30), 400)
    wait_until(lambda: len(c.events) >= 2, what="first tokens")
    engine.abort("long")
    engine.abort("unknown-id")  # ignored
    c.wait()
    assert c.final.finish_reason == "abort" and len(c.tokens) < 400
    wait_until(lambda: engine.allocator.num_free == free, what="blocks freed")


def test_invalid_requests_are_refused(engine: Engine) -> None:
    ok = SamplingParams(max_tokens=1)
    with pytest.raises(InvalidRequestError, match="prompt"):
        engine.add_request("a", [], ok, Collector())
    with pytest.raises(InvalidRequestError, match="prompt"):
        engine.add_request("a", [999], ok, Collector())
    tiny = Engine(small_config(num_blocks=8))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        tiny.add_request("a", [1], SamplingParams(max_tokens=500), Collector())  # needs 32 > 8 blocks
    tiny.stop()
    c = submit(engine, "dup", prompt(7, 10), 300)
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.add_request("dup", [1], ok, Collector())
    engine.abort("dup")
    c.wait()
    generate(engine, [1, 2], 1, "dup")  # the id is free again once finished
    for bad in (
        dict(max_tokens=0),
        dict(max_tokens=1, temperature=-1.0),
        dict(max_tokens=1, top_p=0.0),
        dict(max_tokens=1, seed=-3),
    ):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)  # type: ignore[arg-type]


def test_max_tokens_is_clipped_to_max_position() -> None:
    with Engine(small_config(model=ModelConfig(max_position=32))) as e:
        c = generate(e, prompt(8, 30), 100)
        assert len(c.tokens) == 3 and c.final.finish_reason == "length"  # positions 29..31, then one more


def test_stop_aborts_live_requests_and_refuses_new_ones() -> None:
    e = Engine(small_config())
    queued = submit(e, "queued", [1, 2, 3], 5)
    e.stop()  # never started: queued requests still get their final event
    assert queued.wait().final.finish_reason == "abort"
    with pytest.raises(EngineStateError):
        e.add_request("x", [1], SamplingParams(max_tokens=1), Collector())
    with pytest.raises(EngineStateError):
        e.start()
    e = Engine(small_config())
    e.start()
    c = submit(e, "long", prompt(9, 10), 400)
    wait_until(lambda: len(c.events) >= 1, what="first token")
    e.stop()
    assert c.wait().final.finish_reason == "abort"
    assert c.final.error == "engine stopped"


def test_callback_errors_do_not_kill_the_engine(engine: Engine) -> None:
    def bad(_: object) -> None:
        raise RuntimeError("client bug")

    engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=3), bad)
    assert len(generate(engine, [1, 2, 3], 3, "good").tokens) == 3


def test_config_validation() -> None:
    assert EngineConfig(layout="cross_layer").layout.value == "cross_layer"  # type: ignore[arg-type]
    for bad in (
        dict(layout="nope"),
        dict(block_size=0),
        dict(device="tpu"),
        dict(kv_cache_dtype="int8"),
        dict(attention_backend="magic"),
    ):
        with pytest.raises(ConfigError):
            EngineConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        ModelConfig(num_heads=6, num_kv_heads=4)
    spec = small_config(LAYOUTS[2]).cache_spec()
    assert (spec.kind, spec.num_layers, spec.num_kv_heads, spec.head_dim) == (LAYOUTS[2], 4, 2, 32)


def test_stop_from_a_callback_does_not_deadlock() -> None:
    e = Engine(small_config())
    stopped = Collector()

    def stop_on_first(event: object) -> None:
        stopped(event)  # type: ignore[arg-type]
        e.stop()

    e.start()
    e.add_request("s", prompt(11, 5), SamplingParams(max_tokens=50, ignore_eos=True), stop_on_first)
    assert stopped.wait().final.finish_reason == "abort"
    assert e._thread is not None
    e._thread.join(DEADLINE_S)
    assert not e._thread.is_alive()
