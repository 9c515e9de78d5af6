"""AsyncLLMEngine: cumulative streams, abort, cancellation freeing blocks, errors confined to their request."""

from __future__ import annotations

import asyncio

import pytest

from jaxserve import AsyncLLMEngine, SamplingParams
from jaxserve.config.engine_config import EngineConfig
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """Two executables (decode batch 2, prefill chunks of 32, context 512): at most two requests run at once here."""
    path = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=2)
    buckets = small_bucket_file(path.parent, decode_batch_sizes=(2,), context=512)
    config = EngineConfig(dtype="float32", model=str(path), max_model_len=512, buckets=buckets)
    return AsyncLLMEngine.from_config(config)


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def _collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_stream_is_cumulative_and_matches_offline(engine):
    prompt = {"prompt_token_ids": [4, 5, 6, 7]}
    outputs = asyncio.run(_collect(engine, prompt, _params(6), "s1"))
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert [len(t) for t in tokens] == [1, 2, 3, 4, 5, 6]
    assert all(tokens[i] == tokens[-1][: i + 1] for i in range(6))
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    engine.engine.add_request("offline", prompt, _params(6))
    final = None
    while engine.engine.has_unfinished_requests():
        final = ([final] + engine.engine.step())[-1]  # with async scheduling a step may return nothing
    assert final.outputs[0].token_ids == tokens[-1]


def test_cancelled_consumer_aborts_and_frees_blocks(engine):
    async def scenario():
        async def consume_two():
            n = 0
            async for _ in engine.generate({"prompt_token_ids": [8, 9, 10]}, _params(200), "cancel-me"):
                n += 1
                if n == 2:
                    await asyncio.sleep(3600)  # a client that stops reading; cancelled below

        task = asyncio.create_task(consume_two())
        for _ in range(200):
            await asyncio.sleep(0.01)
            if engine.engine.block_manager.num_used_blocks:
                break
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        done = await _collect(engine, {"prompt_token_ids": [3]}, _params(2), "after")  # the loop lives on
        return done

    done = asyncio.run(scenario())
    assert done[-1].finished
    assert "cancel-me" not in engine.engine.requests
    pool = engine.engine.block_manager
    assert pool.num_free_blocks == pool.num_blocks


def test_error_reaches_only_its_request(engine):
    async def scenario():
        good = asyncio.create_task(_collect(engine, {"prompt_token_ids": [5, 6]}, _params(8), "good"))
        with pytest.raises(ValueError, match="maximum context length is 512 tokens"):
            await _collect(engine, {"prompt_token_ids": [5] * 600}, _params(4), "bad")
        return await good

    outputs = asyncio.run(scenario())
    assert len(outputs[-1].outputs[0].token_ids) == 8


def test_explicit_abort(engine):
    async def scenario():
        stream = engine.generate({"prompt_token_ids": [11, 12]}, _params(300), "abort-me")
        first = await stream.__anext__()
        await engine.abort("abort-me")
        rest = [out async for out in stream]
        return first, rest

    first, rest = asyncio.run(scenario())
    assert not first.finished
    assert rest and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    pool = engine.engine.block_manager
    assert pool.num_free_blocks == pool.num_blocks


def test_abort_queued_with_its_own_add_is_not_lost(engine):
    """A client that disconnects before the worker picks its request up: the add and the abort wait for
    the same step, and the request must not run on orphaned."""

    async def scenario():
        busy = asyncio.create_task(_collect(engine, {"prompt_token_ids": [5, 6, 7]}, _params(40), "busy"))
        while not engine.engine.requests:  # the worker is now stepping "busy"
            await asyncio.sleep(0.005)
        stream = engine.generate({"prompt_token_ids": [13, 14]}, _params(300), "gone-at-once")
        task = asyncio.create_task(stream.__anext__())
        await asyncio.sleep(0)  # generate() queued the add
        task.cancel()  # ... and the client is gone before the next step
        with pytest.raises(asyncio.CancelledError):
            await task
        return await busy

    done = asyncio.run(scenario())
    assert len(done[-1].outputs[0].token_ids) == 40
    assert "gone-at-once" not in engine.engine.requests
    pool = engine.engine.block_manager
    assert pool.num_free_blocks == pool.num_blocks
