"""The engine core in a process of its own (`--engine-core-process`): the same answers as the in-process
engine, refusals and failures reported, nothing left running.

Two servers over the same tiny model, one with each engine, answer the same requests (greedy and seeded
sampling with n=2, stop strings, logprobs, prompt logprobs with echo, streaming, beam search): every answer is
identical but for ids and timestamps. A core that dies fails the open stream with a message naming it, later
requests get a 503 with it and /health answers 503; a core whose API process is killed exits by itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
import zmq

from jaxserve.engine_core import core_messages as msg
from jaxserve.engine_core.core_client import AsyncMPEngine
from jaxserve.sampling_params import SamplingParams
from jaxserve.testing.tiny_models import make_tiny_model
from tests.paths import REPO_ROOT
from tests.server import MODEL_NAME, serve, tiny_engine_config

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Say something."}]
VOLATILE_FIELDS = ("id", "created", "system_fingerprint")

REQUESTS = [  # (route, body)
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "logprobs": 3}),
    ("/v1/completions", {"prompt": [PROMPT, "Hello"], "max_tokens": 24, "temperature": 1.0, "seed": 7, "n": 2,
                         "stop": ["e", "a"], "ignore_eos": True}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "echo": True, "logprobs": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10, "temperature": 0.0, "logprobs": True,
                              "top_logprobs": 2}),
    ("/generate", {"prompt": PROMPT, "use_beam_search": True, "n": 2, "best_of": 3, "max_tokens": 8,
                   "temperature": 0.0, "ignore_eos": True}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "echo": True,
                         "truncate_prompt_tokens": 4, "allowed_token_ids": list(range(67, 77)),
                         "bad_words": ["a", "bc", "cb", "ab"]}),
    ("/v1/completions", {"prompt": PROMPT, "use_beam_search": True, "n": 2, "max_tokens": 6, "temperature": 0.5,
                         "ignore_eos": True, "stop": ["e"], "logprobs": 5, "seed": 3}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "temperature": 0.0, "prompt_logprobs": 1}),
]
STREAMED = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 3, "stop": ["o"],
                         "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10, "temperature": 0.8, "seed": 5, "n": 2, "stream": True,
                              "logprobs": True, "top_logprobs": 1}),
    ("/generate", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "stream": True, "stop": ["e"]}),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=5)


@pytest.fixture(scope="module")
def servers(model_dir):
    """{"in-process": server, "core-process": server} over the same model."""
    in_process, _ = serve(model_dir)
    core_process, core_engine = serve(model_dir, core_process=True)
    with in_process, core_process:
        yield {"in-process": in_process, "core-process": core_process}
    core_engine.close()


def _without_volatile(value):
    if isinstance(value, dict):
        return {k: _without_volatile(v) for k, v in value.items() if k not in VOLATILE_FIELDS}
    if isinstance(value, list):
        return [_without_volatile(v) for v in value]
    return value


def _with_model(route: str, body: dict) -> dict:
    return body if route == "/generate" else {"model": MODEL_NAME, **body}  # vLLM's demo route takes no model


def _answer(server, route: str, body: dict):
    response = httpx.post(server.base_url + route, json=_with_model(route, body), timeout=120)
    assert response.status_code == 200, response.text
    return _without_volatile(response.json())


def _streamed(server, route: str, body: dict) -> list:
    lines = []
    with httpx.stream("POST", server.base_url + route, json=_with_model(route, body), timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.strip():
                text = line.removeprefix("data: ")
                lines.append(text if text == "[DONE]" else _without_volatile(json.loads(text)))
    return lines


@pytest.mark.parametrize(("route", "body"), REQUESTS, ids=[f"{r}-{i}" for i, (r, _) in enumerate(REQUESTS)])
def test_answers_match_the_in_process_engine(servers, route, body):
    ours = _answer(servers["core-process"], route, body)
    assert ours == _answer(servers["in-process"], route, body)
    if "choices" in ours:
        assert all(choice["finish_reason"] in ("stop", "length") for choice in ours["choices"])


@pytest.mark.parametrize(("route", "body"), STREAMED, ids=[f"{r}-{i}" for i, (r, _) in enumerate(STREAMED)])
def test_streams_match_the_in_process_engine(servers, route, body):
    ours = _streamed(servers["core-process"], route, body)
    assert len(ours) > 3
    assert ours == _streamed(servers["in-process"], route, body)


def test_a_constraint_waiting_for_its_marker_waits_in_the_core_too(servers):
    """`structured_outputs.reasoning_end` travels to the core with the request: greedy over the letters a-j (a
    logit bias), a marker from the free text leaves the output free up to it and then the choice, as in process."""
    letters = {str(67 + i): 100 for i in range(10)}  # the byte-level tokenizer's a-j
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "logit_bias": letters}
    free = _answer(servers["in-process"], "/v1/completions", body)["choices"][0]["text"]
    marker = free[4:7]
    end = free.index(marker) + len(marker)
    waiting = {**body, "structured_outputs": {"choice": ["beta"], "reasoning_end": marker}}
    for server in servers.values():
        choice = _answer(server, "/v1/completions", waiting)["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (free[:end] + "beta", "stop")


def test_metrics_come_from_the_core(servers):
    text = httpx.get(servers["core-process"].base_url + "/metrics").text
    assert "jaxserve:compiles_after_warmup_total 0.0" in text
    prompt_tokens = [line for line in text.splitlines() if line.startswith("jaxserve:prompt_tokens_total")]
    assert prompt_tokens and float(prompt_tokens[0].split()[-1]) > 0


def test_a_routers_calls_reach_the_core(servers):
    """/flush_cache runs the engine's reset in the core, between steps: both servers served the same requests, so
    both drop the same cached blocks, and nothing the second time; /get_load reads the core's stats."""
    post = lambda server, route: httpx.post(server.base_url + route).json()  # noqa: E731
    assert [httpx.get(s.base_url + "/get_load").json() for s in servers.values()] == [{"load": 0}] * 2
    dropped = {name: post(server, "/flush_cache") for name, server in servers.items()}
    assert dropped["core-process"] == dropped["in-process"] and dropped["in-process"]["num_blocks_dropped"] > 0
    assert [post(s, "/reset_prefix_cache") for s in servers.values()] == [{"num_blocks_dropped": 0}] * 2


async def _collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_a_request_the_core_refuses_fails_its_stream_only(model_dir):
    engine = AsyncMPEngine.launch(tiny_engine_config(model_dir))
    try:
        async def both():
            refused = _collect(engine, {"prompt": "", "prompt_token_ids": []}, SamplingParams(max_tokens=2), "empty")
            fine = _collect(engine, {"prompt": "x", "prompt_token_ids": [5, 6]},
                            SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), "fine")
            return await asyncio.gather(refused, fine, return_exceptions=True)

        refused, fine = asyncio.run(both())
        assert isinstance(refused, ValueError) and str(refused) == "the prompt must contain at least one token"
        assert len(fine) == 3 and fine[-1].finished and fine[-1].prompt == "x"
        assert fine[-1].prompt_token_ids == [5, 6] and len(fine[-1].outputs[0].token_ids) == 3

        asyncio.run(engine.shutdown())
        assert engine.process.exitcode == 0
    finally:
        engine.close()


def test_a_dead_core_fails_open_streams_and_health_then_the_server_stops(model_dir):
    server, engine = serve(model_dir, core_process=True, engine_dead_grace_s=5.0)  # time to ask it twice
    try:
        with server:
            assert httpx.get(server.base_url + "/health").status_code == 200
            body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))  # the request runs
                os.kill(engine.process.pid, signal.SIGKILL)
                rest = [line for line in lines if line.strip()]
            message = f"the engine core process (pid {engine.process.pid}) exited with code -9"
            assert rest[-1] == "data: [DONE]" and message in rest[-2]
            assert httpx.get(server.base_url + "/health").status_code == 503
            again = httpx.post(server.base_url + "/v1/completions", json={**body, "stream": False}, timeout=60)
            assert again.status_code == 503 and message in again.json()["error"]["message"]
            server.thread.join(timeout=30)  # the server stops by itself once the grace has passed
            assert not server.thread.is_alive() and server.server.engine_died
    finally:
        engine.close()


ORPHAN_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from jaxserve.engine_core.core_client import AsyncMPEngine
    from jaxserve.sampling_params import SamplingParams
    from tests.server import tiny_engine_config
    engine = AsyncMPEngine.launch(tiny_engine_config(sys.argv[1]))

    async def busy():  # the core is stepping a long request when this process is killed
        params = SamplingParams(max_tokens=500, ignore_eos=True)
        async for out in engine.generate({"prompt": "x", "prompt_token_ids": [5, 6]}, params, "busy"):
            if len(out.outputs[0].token_ids) == 2:
                print(engine.process.pid, flush=True)
        await asyncio.sleep(600)

    asyncio.run(busy())
""")


def test_the_core_exits_when_the_api_process_is_killed(model_dir):
    api = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT, str(model_dir)], cwd=REPO_ROOT,
                           stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(api.stdout.readline())
        os.kill(api.pid, signal.SIGKILL)
        api.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(core_pid):
            assert time.monotonic() < deadline, "the engine core outlived its API process"
            time.sleep(0.1)
    finally:
        api.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] != "Z"  # a zombie has exited


# ----- bad input and failed steps, in both modes ------------------------------------------------------

UNICODE_ERROR = "{} holds a lone surrogate (U+{}), which is not valid Unicode text."
INT64_RANGE = "[-9223372036854775808, 9223372036854775807]"
BAD_INPUTS = [  # (route, JSON body as a client sends it, message): a 400 before anything reaches the engine
    ("/v1/completions", r'{"prompt": "\ud800", "max_tokens": 2}', UNICODE_ERROR.format("prompt", "D800")),
    ("/v1/completions", r'{"prompt": "x", "stop": ["ok", "\udc00"]}', UNICODE_ERROR.format("stop[1]", "DC00")),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "\ud800"}]}',
     UNICODE_ERROR.format("messages[0].content", "D800")),
    ("/tokenize", r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udfff"}]}]}',
     UNICODE_ERROR.format("messages[0].content[0].text", "DFFF")),
    ("/tokenize", r'{"prompt": "\ud83d"}', UNICODE_ERROR.format("prompt", "D83D")),
    ("/generate", r'{"prompt": "\ud800"}', UNICODE_ERROR.format("prompt", "D800")),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 2, "seed": 18446744073709551616}',
     f"seed must be in {INT64_RANGE}, got 18446744073709551616."),
    ("/generate", '{"prompt": "x", "max_tokens": 2, "seed": -9223372036854775809}',
     f"seed must be in {INT64_RANGE}, got -9223372036854775809."),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 2, "stop_token_ids": [3, 18446744073709551616]}',
     "token_id(s) [18446744073709551616] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: 320"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "n": 10000000, "temperature": 1}',
     "n cannot be greater than max_num_seqs(16), but got 10000000."),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "n": 0}',  # found by the fuzzer
     "n must be at least 1, got 0."),
]


def _held_requests(server) -> dict:
    """The requests the server's engine holds: the in-process engine's and its streams, or the core client's."""
    engine = server.server.engine
    if isinstance(engine, AsyncMPEngine):
        return dict(engine._requests)
    return {**engine.engine.requests, **engine._streams}


def _post_json(server, route: str, body: str) -> httpx.Response:
    """The body's JSON text as it is (a lone surrogate stays the `\\ud800` escape a client sends), with the model."""
    if route != "/generate":
        body = f'{{"model": "{MODEL_NAME}", {body[1:]}'
    return httpx.post(server.base_url + route, content=body, timeout=120, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("mode", ["in-process", "core-process"])
@pytest.mark.parametrize(("route", "body", "message"), BAD_INPUTS, ids=[f"{r}-{i}" for i, (r, *_) in
                                                                       enumerate(BAD_INPUTS)])
def test_bad_input_is_a_400_and_leaves_no_request(servers, mode, route, body, message):
    response = _post_json(servers[mode], route, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == message
    assert _held_requests(servers[mode]) == {}
    assert _answer(servers[mode], "/generate", {"prompt": PROMPT, "max_tokens": 2})["text"]  # still serving


@pytest.mark.parametrize("mode", ["in-process", "core-process"])
@pytest.mark.parametrize("length_penalty", [-2.8138008428577384e89, 1e300])  # the fuzzer's, and its mirror
def test_a_beam_search_with_an_extreme_length_penalty_is_answered(servers, mode, length_penalty):
    """length ** length_penalty past float's range (0, or an OverflowError) made the step fail (a 500 that also
    failed every other running request); the score now takes its limit."""
    body = {"prompt": PROMPT, "use_beam_search": True, "n": 2, "max_tokens": 4, "ignore_eos": True,
            "length_penalty": length_penalty}
    answer = _answer(servers[mode], "/v1/completions", body)
    assert [choice["index"] for choice in answer["choices"]] == [0, 1]
    assert answer["usage"]["completion_tokens"] == 8 and _held_requests(servers[mode]) == {}


def test_a_request_that_cannot_be_sent_to_the_core_leaves_no_entry(servers):
    """The client encodes a request before it holds it: text msgpack cannot write (a lone surrogate the server's
    checks would have refused) fails the call and leaves the client's request map as it was."""
    engine = servers["core-process"].server.engine

    async def send():
        prompt = {"prompt": chr(0xD800), "prompt_token_ids": [5]}
        return [out async for out in engine.generate(prompt, SamplingParams(max_tokens=1), "unsendable")]

    with pytest.raises(UnicodeEncodeError, match="surrogates not allowed"):
        asyncio.run(send())
    assert engine._requests == {}


STEP_FAILURE = "engine step failed: ValueError('boom')"
LONG = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0.0}


def _fail_the_step(server, monkeypatch) -> None:
    """The next step of the in-process engine raises a ValueError; for the engine core, the step that ran the request
    the server holds fails as the core reports a failed step (an error message for it)."""
    engine = server.server.engine
    if not isinstance(engine, AsyncMPEngine):
        monkeypatch.setattr(engine.engine, "step", lambda: (_ for _ in ()).throw(ValueError("boom")))
        return
    while not engine._requests:  # the request was sent from another thread
        time.sleep(0.01)
    (request_id,) = engine._requests
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.connect(f"ipc://{engine._socket_dir}/output")
    failed = [[request_id, "EngineStepError", STEP_FAILURE]]
    sock.send(msg.encode([msg.OUTPUTS, [], failed, engine.make_stats(), engine.backend_compiles()]))
    sock.close(linger=1000)
    context.term()


@pytest.mark.parametrize("mode", ["in-process", "core-process"])
def test_a_failed_step_is_a_500_not_the_clients_400(servers, mode, monkeypatch):
    server = servers[mode]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, server.base_url + "/v1/completions", json=_with_model("/", LONG), timeout=120)
        _fail_the_step(server, monkeypatch)
        response = answer.result()
    assert response.status_code == 500, response.text
    assert response.json()["error"] == {"message": STEP_FAILURE, "type": "InternalServerError", "param": None,
                                        "code": 500}
    monkeypatch.undo()
    _wait_until_released(server)
    assert _answer(server, "/generate", {"prompt": PROMPT, "max_tokens": 2})["text"]  # still serving


@pytest.mark.parametrize("mode", ["in-process", "core-process"])
def test_a_failed_step_ends_a_stream_with_an_error_event_then_done(servers, mode, monkeypatch):
    server = servers[mode]
    body = _with_model("/", {**LONG, "stream": True})
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the stream has started
        _fail_the_step(server, monkeypatch)
        rest = [line for line in lines if line.strip()]
    error = json.loads(rest[-2].removeprefix("data: "))
    assert rest[-1] == "data: [DONE]" and error == {"error": {"message": STEP_FAILURE, "type": "InternalServerError",
                                                              "param": None, "code": 500}}
    monkeypatch.undo()
    _wait_until_released(server)
    assert _answer(server, "/generate", {"prompt": PROMPT, "max_tokens": 2})["text"]


def _wait_until_released(server) -> None:
    """A failed request leaves nothing held: at once in-process; the core client forgets it as it fails it."""
    assert _held_requests(server) == {}
    engine = server.server.engine
    if isinstance(engine, AsyncMPEngine):  # the core itself drops it once the client's abort arrives
        while httpx.get(server.base_url + "/get_load").json()["load"]:
            time.sleep(0.01)
