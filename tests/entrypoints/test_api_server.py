"""The HTTP server for real (uvicorn on 127.0.0.1, a free port) over a tiny random model.

The official `openai` client drives /v1/completions and /v1/chat/completions (streaming and not, n=2,
logprobs against transformers' log-softmax, stop strings, seeds, usage); raw HTTP drives /generate,
/tokenize, /metrics and every error case. Expected tokens come from the engine itself, run offline
before the server starts.
"""

from __future__ import annotations

import json
import re

import httpx
import msgpack
import numpy as np
import openai
import pytest
import zmq

from jaxserve.sampling_params import BeamSearchParams, SamplingParams
from jaxserve.testing.hf_reference import hf_logits
from jaxserve.testing.tiny_models import make_tiny_model
from tests.server import MODEL_NAME, ServerThread, tiny_async_engine

API_KEY = "test-key"
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Say something."}]
LONG_PROMPT = "a" * 600  # 600 byte tokens > max_model_len 512
NOT_FOUND_MESSAGE = "The model `gpt-nope` does not exist."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=3)


@pytest.fixture(scope="module")
def engine(model_dir):
    """Publishing KV cache events (on a port the system picks) for the KV-aware routing test."""
    return tiny_async_engine(model_dir, kv_events_config={"enable_kv_cache_events": True,
                                                          "endpoint": "tcp://127.0.0.1:*"})


def _offline(engine, prompt_ids: list[int], params) -> list:
    """The engine's own outputs, stepped synchronously before the server owns it."""
    llm_engine = engine.engine
    llm_engine.add_request("offline", {"prompt_token_ids": prompt_ids}, params)
    finals = []
    while llm_engine.has_unfinished_requests():
        finals += [out for out in llm_engine.step() if out.finished]
    (final,) = finals
    return final.outputs


def _greedy_ids(engine, prompt_ids: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return _offline(engine, prompt_ids, params)[0].token_ids


@pytest.fixture(scope="module")
def expected(engine):
    tokenizer = engine.engine.tokenizer
    prompt_ids = tokenizer(PROMPT).input_ids
    chat_text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    chat_ids = tokenizer(chat_text, add_special_tokens=False).input_ids
    greedy = _greedy_ids(engine, prompt_ids, 16)
    chat = _greedy_ids(engine, chat_ids, 12)
    beams = _offline(engine, prompt_ids, BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True))
    return {
        "beam_texts": [b.text for b in beams],
        "prompt_ids": prompt_ids, "greedy_ids": greedy, "greedy_text": tokenizer.decode(greedy),
        "chat_ids": chat_ids, "chat_greedy_ids": chat, "chat_text": tokenizer.decode(chat),
    }


@pytest.fixture(scope="module")
def server(engine, expected, model_dir):
    from jaxserve.entrypoints.api_server import build_app

    app = build_app(engine, served_model_name=MODEL_NAME, api_key=API_KEY, model_path=str(model_dir),
                    trust_request_chat_template=True)  # the tokenize test brings its own template
    with ServerThread(app, engine) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


# ----- completions ------------------------------------------------------------------------------------


def test_completion_is_the_engines_greedy_output_with_usage(client, expected):
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, **GREEDY)
    (choice,) = response.choices
    assert choice.text == expected["greedy_text"]
    assert (choice.index, choice.finish_reason) == (0, "length")
    assert response.model == MODEL_NAME and response.object == "text_completion"
    assert response.id.startswith("cmpl-")
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        len(expected["prompt_ids"]), 16, len(expected["prompt_ids"]) + 16)


def test_completion_stream_sums_to_the_same_text_and_reports_usage(client, expected):
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, stream=True, stream_options={"include_usage": True}, **GREEDY))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == expected["greedy_text"]
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert len({c.id for c in chunks}) == 1
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 16
    assert usage_chunk.usage.prompt_tokens == len(expected["prompt_ids"])
    assert all(c.usage is None for c in text_chunks)


def test_token_id_prompts_and_prompt_lists_give_one_choice_each(client, expected):
    response = client.completions.create(
        model=MODEL_NAME, prompt=[expected["prompt_ids"], expected["prompt_ids"][:3]], max_tokens=4, **GREEDY)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.choices[0].text == expected["greedy_text"][: len(response.choices[0].text)]
    assert response.usage.prompt_tokens == len(expected["prompt_ids"]) + 3
    assert response.usage.completion_tokens == 8


def test_echo_prepends_the_prompt(client, expected):
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, echo=True, **GREEDY)
    assert response.choices[0].text == PROMPT + expected["greedy_text"]


def _stop_after(text: str, width: int) -> tuple[str, int]:
    """A stop string of `width` characters first occurring at a position >= 2 of `text`."""
    for k in range(2, len(text) - width + 1):
        stop = text[k : k + width]
        if stop.strip() and text.find(stop) == k:
            return stop, k
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("width", [1, 2])
def test_stop_string_cuts_the_text_streamed_or_not(client, expected, width):
    stop, position = _stop_after(expected["greedy_text"], width)
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, stop=[stop], **GREEDY)
    choice = response.choices[0]
    assert choice.text == expected["greedy_text"][:position]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", stop)
    chunks = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, stop=stop, stream=True,
                                       **GREEDY)
    assert "".join(c.choices[0].text for c in chunks) == expected["greedy_text"][:position]


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int, stream: bool = False) -> str:
        kwargs = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": seed,
                  "extra_body": {"ignore_eos": True}}
        if stream:
            return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
        return client.completions.create(**kwargs).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(1234, stream=True) == first
    assert sample(4321) != first


def test_completion_n2_returns_two_sampled_choices(client):
    kwargs = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 7,
              "extra_body": {"ignore_eos": True}}
    response = client.completions.create(**kwargs)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.choices[0].text != response.choices[1].text
    assert response.usage.completion_tokens == 16
    chunks = list(client.completions.create(stream=True, **kwargs))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in (0, 1)]
    assert streamed == [c.text for c in response.choices]


def _hf_log_softmax(model_dir, token_ids: list[int]) -> np.ndarray:
    """transformers' log-softmax [len(token_ids) - 1, V]: row j predicts token_ids[j + 1]."""
    logits = hf_logits(model_dir, token_ids)[:-1].astype(np.float64)
    peak = logits.max(-1, keepdims=True)
    return logits - peak - np.log(np.exp(logits - peak).sum(-1, keepdims=True))


def _hf_logprobs(model_dir, prompt_ids: list[int], output_ids: list[int]) -> np.ndarray:
    """transformers' log-softmax [len(output), V] at each output position."""
    return _hf_log_softmax(model_dir, prompt_ids + output_ids)[len(prompt_ids) - 1 :]


def test_completion_logprobs_match_transformers(client, expected, model_dir, engine):
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY)
    logprobs = response.choices[0].logprobs
    output_ids = expected["greedy_ids"][:6]
    reference = _hf_logprobs(model_dir, expected["prompt_ids"], output_ids)
    decode = engine.engine.tokenizer.decode
    assert logprobs.tokens == [decode([t]) for t in output_ids]
    np.testing.assert_allclose(logprobs.token_logprobs, reference[np.arange(6), output_ids], atol=1e-4)
    assert logprobs.text_offset == list(np.cumsum([0] + [len(t) for t in logprobs.tokens[:-1]]))
    for position, top in enumerate(logprobs.top_logprobs):
        best3 = [int(t) for t in np.argsort(-reference[position])[:3]]
        names = [decode([t]) for t in best3]
        assert set(top) == set(names)  # greedy: the sampled token is one of the three
        for token_id, name in zip(best3, names, strict=True):
            if names.count(name) == 1:  # two ids can decode to one string (partial UTF-8)
                assert top[name] == pytest.approx(reference[position, token_id], abs=1e-4)


def test_echo_logprobs_and_prompt_logprobs_match_transformers(http, expected, model_dir, engine):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "echo": True, "logprobs": 1, "prompt_logprobs": 1}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    prompt_ids, output_ids = expected["prompt_ids"], expected["greedy_ids"][:2]
    token_ids = prompt_ids + output_ids
    reference = _hf_log_softmax(model_dir, token_ids)
    decode = engine.engine.tokenizer.decode
    assert choice["text"] == PROMPT + decode(output_ids)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [decode([t]) for t in token_ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    np.testing.assert_allclose(logprobs["token_logprobs"][1:], reference[np.arange(len(token_ids) - 1), token_ids[1:]],
                               atol=1e-4)
    assert logprobs["text_offset"] == list(np.cumsum([0] + [len(t) for t in logprobs["tokens"][:-1]]))
    prompt_logprobs = choice["prompt_logprobs"]
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for j in range(1, len(prompt_ids)):
        entry = prompt_logprobs[j][str(prompt_ids[j])]
        assert entry["logprob"] == pytest.approx(reference[j - 1, prompt_ids[j]], abs=1e-4)
        assert entry["rank"] == 1 + int((reference[j - 1] > reference[j - 1, prompt_ids[j]]).sum())


# ----- chat -------------------------------------------------------------------------------------------


def test_chat_completion_applies_the_template(client, expected):
    response = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=12, **GREEDY)
    (choice,) = response.choices
    assert choice.message.role == "assistant" and choice.message.content == expected["chat_text"]
    assert choice.finish_reason == "length" and response.object == "chat.completion"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(expected["chat_ids"]), 12)


def test_chat_stream_starts_with_the_role_and_ends_with_usage(client, expected):
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=12, stream=True, stream_options={"include_usage": True},
        **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content = chunks[1:-1]
    assert "".join(c.choices[0].delta.content for c in content) == expected["chat_text"]
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(expected["chat_ids"])


def test_chat_stop_and_max_completion_tokens(client, expected):
    stop, position = _stop_after(expected["chat_text"], 1)
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_completion_tokens=12, stop=[stop], **GREEDY)
    assert response.choices[0].message.content == expected["chat_text"][:position]
    assert response.choices[0].finish_reason == "stop"
    short = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=3, **GREEDY)
    assert short.usage.completion_tokens == 3


def test_chat_n2_and_seed(client):
    kwargs = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 11,
              "extra_body": {"ignore_eos": True}}
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens == 12


def test_chat_logprobs_match_transformers(client, expected, model_dir):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY)
    content = response.choices[0].logprobs.content
    output_ids = expected["chat_greedy_ids"][:5]
    reference = _hf_logprobs(model_dir, expected["chat_ids"], output_ids)
    np.testing.assert_allclose([c.logprob for c in content], reference[np.arange(5), output_ids], atol=1e-4)
    for position, entry in enumerate(content):
        assert len(entry.top_logprobs) == 2
        best2 = np.sort(reference[position])[::-1][:2]
        np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], best2, atol=1e-4)
        assert entry.bytes == list(entry.token.encode("utf-8"))


def test_chat_prompt_logprobs_are_the_responses_as_vllm_puts_them(http, expected):
    """In the response beside the choices (vLLM's place), the same as a completion of the rendered prompt's."""
    chat = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 2,
                                                   "temperature": 0, "prompt_logprobs": 2}).json()
    completion = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": expected["chat_ids"],
                                                     "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}).json()
    prompt_logprobs = chat["prompt_logprobs"]
    assert len(prompt_logprobs) == len(expected["chat_ids"]) and prompt_logprobs[0] is None
    assert prompt_logprobs == completion["choices"][0]["prompt_logprobs"]
    assert all(2 <= len(step) <= 3 for step in prompt_logprobs[1:])
    assert "prompt_logprobs" not in chat["choices"][0]
    plain = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 1}).json()
    assert plain["prompt_logprobs"] is None

# ----- other endpoints --------------------------------------------------------------------------------


def test_models_health_version(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].max_model_len == 512
    health = httpx.get(server.base_url + "/health")  # no API key needed
    assert (health.status_code, health.text) == (200, "")
    assert httpx.get(server.base_url + "/version").json() == {"version": "0.1.0"}


def test_tokenize_and_detokenize(http, expected, engine):
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert tokens == {"count": len(expected["prompt_ids"]), "max_model_len": 512, "tokens": expected["prompt_ids"]}
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == expected["chat_ids"]
    own_template = {"messages": CHAT, "chat_template": "{{ messages[0]['content'] }}|{{ flavour }}",
                    "chat_template_kwargs": {"flavour": "plain"}}
    own_ids = engine.engine.tokenizer("Say something.|plain", add_special_tokens=False).input_ids
    assert http.post("/tokenize", json=own_template).json()["tokens"] == own_ids
    assert http.post("/detokenize", json={"tokens": expected["greedy_ids"]}).json() == {
        "prompt": expected["greedy_text"]}


def test_the_servers_chat_template_renders_chats_that_name_none(engine):
    """`--chat-template` (build_app's chat_template) for a model without one; a request's own still wins."""
    from jaxserve.entrypoints.openai_protocol import TokenizeRequest
    from jaxserve.entrypoints.serving_tokenization import OpenAIServingTokenization

    serving = OpenAIServingTokenization(engine, MODEL_NAME, chat_template="[{{ messages[0]['content'] }}]",
                                        trust_request_chat_template=True)
    tokenizer = engine.engine.tokenizer
    ids = serving.tokenize(TokenizeRequest(messages=CHAT)).tokens
    assert ids == tokenizer("[Say something.]", add_special_tokens=False).input_ids
    own = serving.tokenize(TokenizeRequest(messages=CHAT, chat_template="<{{ messages[0]['role'] }}>")).tokens
    assert own == tokenizer("<user>", add_special_tokens=False).input_ids


def test_a_requests_own_chat_template_is_refused_unless_trusted(engine, expected):
    """vLLM's `--trust-request-chat-template`, off by default: a template in the request (its `chat_template`, or
    in `chat_template_kwargs`) is a 400 with vLLM's words, for chats and /tokenize alike; other kwargs pass."""
    import asyncio

    from jaxserve.entrypoints.api_server import build_parser
    from jaxserve.entrypoints.openai_protocol import ChatCompletionRequest, TokenizeRequest
    from jaxserve.entrypoints.serving_chat import OpenAIServingChat
    from jaxserve.entrypoints.serving_engine import ServingError
    from jaxserve.entrypoints.serving_tokenization import OpenAIServingTokenization

    untrusted = ("Chat template is passed with request, but --trust-request-chat-template is not set. Refused "
                 "request with untrusted chat template.")
    tokenization, chat = OpenAIServingTokenization(engine, MODEL_NAME), OpenAIServingChat(engine, MODEL_NAME)
    own = [{"chat_template": "{{ 'x' }}"}, {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}]
    for fields in own:
        with pytest.raises(ServingError) as refused:
            tokenization.tokenize(TokenizeRequest(messages=CHAT, **fields))
        assert (refused.value.message, refused.value.status, refused.value.param) == (untrusted, 400, "chat_template")
        with pytest.raises(ServingError, match=re.escape(untrusted)):
            asyncio.run(chat.create_chat_completion(ChatCompletionRequest(model=MODEL_NAME, messages=CHAT, **fields)))
    plain_kwargs = TokenizeRequest(messages=CHAT, chat_template_kwargs={"flavour": "plain"})
    assert tokenization.tokenize(plain_kwargs).tokens == expected["chat_ids"]
    assert build_parser().parse_args([]).trust_request_chat_template is False
    assert build_parser().parse_args(["--trust-request-chat-template"]).trust_request_chat_template is True


def test_auto_tool_choice_needs_a_template_that_renders_the_tools(engine):
    """A tool-blind template is a 400 for an "auto" tool choice, a tool-aware one goes on to the request's other
    checks (here a max_tokens past the context); the check compares rendered texts, so the prompt is the only
    text tokenized."""
    import asyncio

    from jaxserve.entrypoints.chat_output import ChatParserOptions
    from jaxserve.entrypoints.openai_protocol import ChatCompletionRequest
    from jaxserve.entrypoints.serving_chat import OpenAIServingChat
    from jaxserve.entrypoints.serving_engine import ServingError

    auto = ChatParserOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    serving = OpenAIServingChat(engine, MODEL_NAME, parser_options=auto, trust_request_chat_template=True)
    tokenized, encode = [], serving.encode
    serving.encode = lambda text, add_special_tokens: tokenized.append(text) or encode(text, add_special_tokens)
    tools = [{"type": "function", "function": {"name": "get_time"}}]

    def refusal(template: str) -> str:
        request = ChatCompletionRequest(model=MODEL_NAME, messages=CHAT, tools=tools, chat_template=template,
                                        max_tokens=1000)
        with pytest.raises(ServingError) as refused:
            asyncio.run(serving.create_chat_completion(request))
        return refused.value.message

    assert refusal("{{ messages[0]['content'] }}") == (
        "the chat template does not render tools, so the model cannot call them: \"auto\" tool choice needs a "
        "tool-aware template (the request's or the server's chat_template)")
    assert tokenized == ["Say something."]
    tool_aware = "{% for tool in tools or [] %}{{ tool.function.name }}: {% endfor %}{{ messages[0]['content'] }}"
    assert refusal(tool_aware).startswith("This model's maximum context length is 512 tokens.")
    assert tokenized == ["Say something.", "get_time: Say something."]


def test_generate_answers_prompt_plus_output(http, expected):
    response = http.post("/generate", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200
    assert response.json() == {"text": [PROMPT + expected["greedy_text"]]}


def test_generate_streams_cumulative_json_lines(http, expected):
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/generate", json=body) as response:
        lines = [json.loads(line) for line in response.iter_lines() if line]
    texts = [line["text"][0] for line in lines]
    assert len(texts) >= 2 and texts[-1] == PROMPT + expected["greedy_text"]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))  # cumulative


def test_generate_beam_search_is_the_engines(http, expected):
    """The seeds' demo request: n=4 beams, greedy, 16 tokens; beams best first, each prompt + output."""
    body = {"prompt": PROMPT, "n": 4, "use_beam_search": True, "temperature": 0.0, "max_tokens": 16,
            "ignore_eos": True}
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    assert response.json() == {"text": [PROMPT + text for text in expected["beam_texts"]]}
    with http.stream("POST", "/generate", json={**body, "stream": True}) as streamed:
        lines = [json.loads(line) for line in streamed.iter_lines() if line]
    assert lines == [response.json()]  # a beam search has one, final, output
    best_two = http.post("/generate", json={**body, "n": 2, "best_of": 4}).json()  # 4 beams, the best 2
    assert best_two == {"text": [PROMPT + text for text in expected["beam_texts"][:2]]}


def test_completion_beam_search(client, expected):
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, n=4, max_tokens=16, temperature=0.0,
        extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.text for c in response.choices] == expected["beam_texts"]
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.usage.completion_tokens == 64


def test_metrics_count_one_request_exactly(http, expected, engine):
    def scrape() -> dict[str, float]:
        text = http.get("/metrics").text
        return {m[0]: float(m[1]) for m in re.findall(r"^(jaxserve:[^ ]+) ([0-9.e+-]+)$", text, re.M)}

    before = scrape()
    http.post("/generate", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    after = scrape()
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["jaxserve:prompt_tokens_total"] == len(expected["prompt_ids"])
    assert delta["jaxserve:generation_tokens_total"] == 5
    assert delta["jaxserve:time_to_first_token_seconds_count"] == 1
    assert delta["jaxserve:inter_token_latency_seconds_count"] == 4
    assert delta["jaxserve:e2e_request_latency_seconds_count"] == 1
    assert delta['jaxserve:request_success_total{finished_reason="length"}'] == 1
    assert after["jaxserve:num_requests_running"] == after["jaxserve:num_requests_waiting"] == 0
    assert after["jaxserve:kv_cache_usage_perc"] == 0.0
    assert after["jaxserve:compiles_after_warmup_total"] == 0
    assert after["jaxserve:bucket_padding_per_real_token"] == pytest.approx(
        after["jaxserve:bucket_padded_tokens_total"] / after["jaxserve:bucket_real_tokens_total"])
    http.post("/generate", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})  # its prompt is cached now
    again = scrape()
    num_tokens, block_size = len(expected["prompt_ids"]), engine.engine.block_size
    assert again["jaxserve:prefix_cache_queries_total"] - after["jaxserve:prefix_cache_queries_total"] == num_tokens
    assert again["jaxserve:prefix_cache_hits_total"] - after["jaxserve:prefix_cache_hits_total"] == (
        (num_tokens - 1) // block_size * block_size)


# ----- vLLM's request fields ------------------------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, expected):
    ids = expected["prompt_ids"]
    truncated = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, echo=True,
                                          temperature=0.0, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 3})
    alone = client.completions.create(model=MODEL_NAME, prompt=ids[-3:], max_tokens=6, echo=True, **GREEDY)
    assert truncated.choices[0].text == alone.choices[0].text  # the echo is the 3 tokens the model saw
    assert truncated.usage.prompt_tokens == 3


def test_allowed_token_ids_and_bad_words_reach_the_sampler(client, engine, http):
    """One allowed token is sampled every time; banning one-token bad words is banning their tokens."""
    tokenizer = engine.engine.tokenizer
    token = tokenizer.encode("e", add_special_tokens=False)[0]
    only_e = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0.0,
                                       extra_body={"ignore_eos": True, "allowed_token_ids": [token]})
    assert only_e.choices[0].text == "eeee"
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=3, temperature=0.0,
                                          extra_body={"ignore_eos": True, "allowed_token_ids": [token]})
    assert chat.choices[0].message.content == "eee"
    letters = tokenizer.encode("abcdefghij", add_special_tokens=False)
    banned = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                       extra_body={"ignore_eos": True, "allowed_token_ids": letters,
                                                   "bad_words": ["a", " e"]})
    others = letters[1:4] + letters[5:]
    without = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                        extra_body={"ignore_eos": True, "allowed_token_ids": others})
    assert banned.choices[0].text == without.choices[0].text
    assert not {"a", "e"} & set(banned.choices[0].text)


# ----- errors -----------------------------------------------------------------------------------------


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]["code"] == status
    return body["error"]["message"]


BAD_COMPLETIONS = [
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens: Input should be a valid integer"),
    ({"prompt": "x", "temperature": "hot"}, "temperature: Input should be a valid number"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens must be at least 1, got -1."),
    ({"prompt": "x", "temperature": -0.5}, "temperature must be non-negative, got -0.5."),
    ({"prompt": "x", "top_p": 0}, "top_p must be in (0, 1], got 0.0."),
    ({"prompt": "x", "logprobs": -1}, "`logprobs` must be a positive value."),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "Stream options can only be defined when"),
    ({"prompt": [], "max_tokens": 3}, "prompt must not be an empty list"),
    ({"prompt": [5, 100000]}, "Token id 100000 is out of vocabulary (size 320)."),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias keys must be token ids (integers), got 'a'."),
    ({"prompt": "x", "allowed_token_ids": [5, 320]}, "allowed_token_ids contains out-of-vocab token id!"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids is not None and empty!"),
    ({"prompt": "x", "truncate_prompt_tokens": 513},
     "truncate_prompt_tokens value (513) is greater than max_model_len (512). Please, select a smaller "
     "truncation size."),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be an integer >= 1 or -1, got 0"),
    ({"prompt": "x", "priority": 1}, "Got priority 1 but Priority scheduling is not enabled."),
    ({"prompt": LONG_PROMPT, "max_tokens": 16},
     "This model's maximum context length is 512 tokens. However, you requested 616 tokens "
     "(600 in the messages, 16 in the completion)."),
]


@pytest.mark.parametrize(("body", "message"), BAD_COMPLETIONS)
def test_bad_completion_requests_are_400(http, body, message):
    assert message in _error(http.post("/v1/completions", json={"model": MODEL_NAME, **body}), 400)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate", "/tokenize"])
def test_invalid_json_is_400(http, path):
    response = http.post(path, content=b'{"prompt": "x",', headers={"Content-Type": "application/json"})
    assert _error(response, 400).startswith("The request body is not valid JSON")


@pytest.mark.parametrize(("path", "message"), [("/v1/completions", "There was an error parsing the body"),
                                                ("/generate", "The request body is not valid JSON: nested too deeply")])
def test_a_body_nested_too_deeply_is_400(http, path, message):
    """Python's JSON parser (/generate's) raises RecursionError past its depth: a 400, never the server's 500."""
    deep = "[" * 100_000 + "]" * 100_000
    nested = f'{{"model": "{MODEL_NAME}", "prompt": "x", "a": {deep}}}'
    response = http.post(path, content=nested, headers={"Content-Type": "application/json"})
    assert _error(response, 400) == message


BAD_CHATS = [
    ({"messages": "hello"}, "messages: Input should be a valid list"),
    ({"messages": []}, "messages must contain at least one message"),
    ({"messages": CHAT, "top_logprobs": 2}, "when using `top_logprobs`, `logprobs` must be set to true."),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens must be at least 1, got 0."),
    ({"messages": CHAT, "prompt_logprobs": 1, "stream": True},
     "`prompt_logprobs` are not available when `stream=True`."),
    ({"messages": CHAT, "priority": -3, "stream": True}, "Got priority -3 but Priority scheduling is not enabled."),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "Only text content parts are supported, got 'image_url'."),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "A text content part needs a `text` string."),
    ({"messages": [{"role": "user", "content": LONG_PROMPT}]}, "This model's maximum context length is 512 tokens."),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21},
     "Requested sample logprobs of 21, which is greater than max allowed: 20"),
]


@pytest.mark.parametrize(("body", "message"), BAD_CHATS)
def test_bad_chat_requests_are_400(http, body, message):
    assert message in _error(http.post("/v1/chat/completions", json={"model": MODEL_NAME, **body}), 400)


BAD_GENERATES = [
    ([1, 2], "The request body must be a JSON object."),
    ({"max_tokens": 4}, "`prompt` is required and must be a string."),
    ({"prompt": "x", "stream": "yes"}, "`stream` must be a boolean."),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens must be at least 1, got -3."),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens: Input should be a valid integer"),
    ({"prompt": "x", "temperature": [1]}, "temperature: Input should be a valid number"),
    ({"prompt": "x", "bogus": 1}, "Unknown sampling parameter(s): bogus."),
    ({"prompt": "x", "output_kind": 1}, "Unknown sampling parameter(s): output_kind."),
    ({"prompt": "x", "use_beam_search": True, "n": 3, "best_of": 2},
     "best_of must be greater than or equal to n, got n=3 and best_of=2."),
    ({"prompt": "x", "use_beam_search": "yes"}, "`use_beam_search` must be a boolean."),
    ({"prompt": "x", "temperature": 0, "n": 2}, "n must be 1 when using greedy sampling, got 2."),
    ({"prompt": LONG_PROMPT}, "This model's maximum context length is 512 tokens. However, you requested 616 tokens"),
]


@pytest.mark.parametrize(("body", "message"), BAD_GENERATES)
def test_bad_generate_requests_are_400(http, body, message):
    assert message in _error(http.post("/generate", json=body), 400)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match=re.escape(NOT_FOUND_MESSAGE)):
        client.completions.create(model="gpt-nope", prompt=PROMPT, max_tokens=2)


def test_api_key_is_required_except_for_probes(server):
    unauthorized = [
        httpx.post(server.base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x"}),
        httpx.post(server.base_url + "/generate", json={"prompt": "x"}),
        httpx.get(server.base_url + "/v1/models", headers={"Authorization": "Bearer wrong"}),
        httpx.get(server.base_url + "/v1/models", headers={"Authorization": b"Bearer t\xe9st"}),
    ]
    for response in unauthorized:
        assert _error(response, 401) == "Unauthorized: a valid API key is required."
    bad_client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert httpx.get(server.base_url + "/metrics").status_code == 200
    assert httpx.get(server.base_url + "/health").status_code == 200


ROUTER_ROUTES = [("GET", "/get_server_info"), ("GET", "/kv_event_sources"), ("GET", "/get_load"),
                 ("POST", "/reset_prefix_cache"), ("POST", "/flush_cache")]


@pytest.mark.parametrize(("method", "route"), ROUTER_ROUTES)
def test_the_routers_admin_routes_need_the_api_key(server, method, route):
    """What vllm-router (and operators) call on a worker is behind the API key, as every route but the probes."""
    url = server.base_url + route
    assert _error(httpx.request(method, url), 401) == "Unauthorized: a valid API key is required."
    assert _error(httpx.request(method, url, headers={"Authorization": "Bearer wrong"}), 401)
    authorized = httpx.request(method, url, headers={"Authorization": f"Bearer {API_KEY}"})
    assert authorized.status_code == 200 and isinstance(authorized.json(), dict)


def test_unknown_route_is_an_openai_404(http):
    assert _error(http.get("/v1/nothing"), 404) == "Not Found"


# ----- what a KV-aware router reads ------------------------------------------------------------------


def _complete(http, prompt: list[int]) -> int:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    return http.post("/v1/completions", json=body).status_code


@pytest.fixture(scope="module")
def kv_events(http):
    """A subscriber to the server's KV cache events, once it receives them (a batch published before the
    subscription is up is not received)."""
    (rank, source), = http.get("/kv_event_sources").json().items()
    assert rank == "0" and source["endpoint"].startswith("tcp://127.0.0.1:")
    assert (source["publisher"], source["encoding"], source["schema_version"]) == ("zmq", "msgpack", 1)
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.setsockopt(zmq.RCVTIMEO, 200)
    subscriber.connect(source["endpoint"])
    for attempt in range(50):
        assert _complete(http, [200 + attempt] * 20) == 200
        try:
            subscriber.recv_multipart()
            break
        except zmq.Again:
            continue
    subscriber.setsockopt(zmq.RCVTIMEO, 5000)
    yield subscriber
    subscriber.close()


def _next_event(subscriber, wanted) -> tuple[bytes, dict]:
    """The first event ``wanted(event)`` accepts, with its batch's topic."""
    while True:
        topic, _, payload = subscriber.recv_multipart()
        for event in msgpack.unpackb(payload)[1]:
            if wanted(event):
                return topic, event


def test_server_info_and_kv_events_tell_a_router_which_blocks_this_replica_holds(http, model_dir, kv_events):
    """vllm-router's `kv_aware` policy: `/get_server_info` and `/kv_event_sources` say where to subscribe; a completion
    then publishes its prompt's full blocks (one BlockStored: 2 blocks of 16 of a 40-token prompt, no parent)."""
    assert http.get("/get_server_info").json() == {"model_id": MODEL_NAME, "model_path": str(model_dir),
                                                   "kv_block_size": 16, "max_model_len": 512}
    prompt = list(range(100, 140))
    assert _complete(http, prompt) == 200
    topic, event = _next_event(kv_events, lambda e: e["type"] == "BlockStored" and e["token_ids"][0] == 100)
    assert topic == b"" and event["token_ids"] == prompt[:32] and event["parent_block_hash"] is None
    assert len(event["block_hashes"]) == 2 and event["block_size"] == 16 and event["medium"] == "GPU"


def test_flush_cache_drops_every_cached_block_and_tells_the_router(http, engine, kv_events):
    """The router's POST /flush_cache (vLLM's /reset_prefix_cache): an idle engine drops every cached block, publishes
    AllBlocksCleared, and computes the next request's prefix anew; /get_load counts the requests it holds."""
    prefix_cache = engine.engine.block_manager.prefix_cache
    assert _complete(http, list(range(150, 190))) == 200
    cached = prefix_cache.num_cached_blocks
    assert cached >= 2 and http.get("/get_load").json() == {"load": 0}
    assert http.post("/flush_cache").json() == {"num_blocks_dropped": cached}
    assert prefix_cache.num_cached_blocks == 0
    assert _next_event(kv_events, lambda e: e["type"] == "AllBlocksCleared")[1] == {"type": "AllBlocksCleared"}
    hits = engine.make_stats().scheduler.prefix_cache_hits
    assert _complete(http, list(range(150, 190))) == 200
    assert engine.make_stats().scheduler.prefix_cache_hits == hits
    assert http.post("/reset_prefix_cache").json() == {"num_blocks_dropped": 2}


def test_under_a_reasoning_parser_constraints_wait_for_the_reasoning_to_end(engine):
    """The chat server gives a request's constraint (a forced call, response_format) the parser's end marker, which
    the engine waits for, unless the prompt ended the reasoning already (Qwen3 with enable_thinking false)."""
    import asyncio

    from jaxserve.entrypoints.chat_output import ChatParserOptions
    from jaxserve.entrypoints.openai_protocol import ChatCompletionRequest
    from jaxserve.entrypoints.serving_chat import OpenAIServingChat

    class Sent(Exception):
        pass

    def sent_constraint(reasoning_parser: str | None, **fields):
        serving = OpenAIServingChat(engine, MODEL_NAME, parser_options=ChatParserOptions(
            reasoning_parser=reasoning_parser), trust_request_chat_template=True)
        sent = []

        def generate(prompts, params, request_id, priority=0):
            sent.extend(params)
            raise Sent

        serving.generate = generate
        with pytest.raises(Sent):
            asyncio.run(serving.create_chat_completion(ChatCompletionRequest(model=MODEL_NAME, messages=CHAT,
                                                                             max_tokens=4, **fields)))
        constraint = sent[0].structured_outputs
        return constraint and (constraint.kind, constraint.reasoning_end)

    tools = [{"type": "function", "function": {"name": "get_time"}}]
    named = {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    json_object = {"response_format": {"type": "json_object"}}
    thinking_off = "{{ messages[0]['content'] }}<|im_start|>assistant\n<think>\n\n</think>\n\n"
    for parser in ("deepseek_r1", "qwen3"):
        assert sent_constraint(parser, **named) == ("json", "</think>")
        assert sent_constraint(parser, tools=tools, tool_choice="required") == ("json", "</think>")
        assert sent_constraint(parser, **json_object) == ("json_object", "</think>")
        assert sent_constraint(parser, guided_regex="a+") == ("regex", "</think>")
        assert sent_constraint(parser, **json_object, chat_template=thinking_off) == ("json_object", None)
        assert sent_constraint(parser) is None
    assert sent_constraint(None, **named) == ("json", None)
