"""The embedded SmolLM2-135M-Instruct (GGUF): greedy tokens equal transformers' on the shared chats."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from jaxserve import LLM, AsyncLLMEngine, SamplingParams, StructuredOutputsParams
from jaxserve.entrypoints.cli import chat_prompt_ids
from tests.embedded_reference import NEW_TOKENS, chats, hf_greedy_references
from tests.paths import SHARED_WORKLOADS

BATCHING_TOKENS = 8  # outputs of the batching test are capped so that its requests also run alone quickly


@pytest.fixture(scope="module")
def llm():
    """Up to 16 sequences (15 executables; 20 at 32): the 32 chats run in turns. Compiled into the session's compile
    cache (tests/conftest.py), where this module's second engine and the router test's replicas, which build the
    same executables, load them."""
    return LLM(dtype="float32", max_model_len=1024, max_num_seqs=16)


@pytest.fixture(scope="module")
def llm_without_caching():
    return LLM(dtype="float32", max_model_len=1024, max_num_seqs=16, enable_prefix_caching=False)


def test_greedy_tokens_match_transformers_on_every_chat(llm, reference_dir):
    tokenizer = llm.get_tokenizer()
    conversations = chats()
    assert len(conversations) == 32
    prompts = [chat_prompt_ids(tokenizer, msgs) for msgs in conversations]
    references = hf_greedy_references(prompts, tokenizer.eos_token_id, reference_dir)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)
    num_exact = 0
    for reference, output in zip(references, outputs, strict=True):
        ours, expected = output.outputs[0].token_ids, reference.tokens
        if ours == expected:
            num_exact += 1
            continue
        # the only excuse for a different token is a near tie in the reference logits at that point
        first = next(i for i, (a, b) in enumerate(zip(ours, expected, strict=False)) if a != b)
        assert reference.gaps[first] < 1e-3, (first, ours, expected)
    assert num_exact >= 30


def _text_prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Prompts of exactly the given lengths, cut from the chats' text (real text, not random ids)."""
    text = " ".join(m["content"] for msgs in chats() for m in msgs)
    ids = tokenizer(text).input_ids
    ids = ids * (max(lengths) // len(ids) + 2)
    return [ids[i * 7 : i * 7 + n] for i, n in enumerate(lengths)]


def test_continuous_batching_changes_no_token(llm):
    """16 requests of the mixed-lengths workload, alone and all at once (the chats above take turns: 32 rows)."""
    rows = [json.loads(line) for line in (SHARED_WORKLOADS / "mixed_lengths.jsonl").read_text().splitlines()[:16]]
    prompts = _text_prompts(llm.get_tokenizer(), [r["prompt_len"] for r in rows])
    assert [len(p) for p in prompts] == [r["prompt_len"] for r in rows]
    params = [SamplingParams(temperature=0.0, max_tokens=min(r["output_len"], BATCHING_TOKENS), ignore_eos=True)
              for r in rows]
    alone = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids
             for p, sp in zip(prompts, params, strict=True)]
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == alone
    assert [len(t) for t in alone] == [sp.max_tokens for sp in params]
    engine = llm.llm_engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_generate_returns_vllm_shaped_outputs(llm):
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert len(outputs) == 1
    out = outputs[0]
    assert out.prompt == "The capital of France is"
    assert out.prompt_token_ids == llm.get_tokenizer()("The capital of France is").input_ids
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids)


def test_requests_arriving_while_others_decode_change_no_token(llm_without_caching):
    """Mixed steps on the real model: requests that arrive while others decode share steps with them (offline
    and through AsyncLLMEngine), and every request's greedy tokens equal its tokens alone. Without the prefix
    cache: it would serve the prompts the requests alone computed, and their prefills would not be measured."""
    llm = llm_without_caching
    prompts = _text_prompts(llm.get_tokenizer(), [40, 300, 9, 150, 70])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    engine = llm.llm_engine
    mixed_before = engine.stats.num_mixed_steps
    arrivals, finished = {0: [0], 2: [1, 2], 5: [3, 4]}, {}
    for step in range(200):
        for i in arrivals.get(step, []):
            engine.add_request(f"trace-{i}", {"prompt_token_ids": prompts[i]}, params)
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests() and step > max(arrivals):
            break
    assert [finished[f"trace-{i}"] for i in range(len(prompts))] == alone
    assert engine.stats.num_mixed_steps - mixed_before >= 3

    async_engine = AsyncLLMEngine(engine)

    async def one(i: int) -> list[int]:
        outputs = [o async for o in async_engine.generate({"prompt_token_ids": prompts[i]}, params, f"async-{i}")]
        return outputs[-1].outputs[0].token_ids

    async def all_requests():
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    mixed_before = engine.stats.num_mixed_steps
    assert asyncio.run(all_requests()) == alone
    assert engine.stats.num_mixed_steps > mixed_before


def _greedy_turn(llm, prompt: list[int]):
    return llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=24),
                        use_tqdm=False)[0]


def _cached_tokens_after(previous: list[int], prompt: list[int], block_size: int) -> int:
    """What a prompt finds cached after `previous` (a request's computed tokens): their common full blocks, never
    the prompt's last token."""
    common = next((i for i, (a, b) in enumerate(zip(previous, prompt, strict=False)) if a != b),
                  min(len(previous), len(prompt)))
    return min(common, len(prompt) - 1) // block_size * block_size


def test_prefix_caching_gives_the_tokens_of_no_caching_over_a_three_turn_conversation(llm, llm_without_caching):
    """Each turn resends the earlier ones: it starts on their cached blocks (the last reply's too) and generates
    exactly what the engine without prefix caching generates."""
    tokenizer = llm.get_tokenizer()
    questions = [msgs[-1]["content"] for msgs in chats()[:3]]
    messages, previous = [], None
    for question in questions:
        messages.append({"role": "user", "content": question})
        prompt = chat_prompt_ids(tokenizer, messages)
        got, want = _greedy_turn(llm, prompt), _greedy_turn(llm_without_caching, prompt)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert want.num_cached_tokens == 0
        if previous is not None:  # the reply's last token is computed too when the step after its EOS ran
            assert got.num_cached_tokens in {_cached_tokens_after(previous[:-1], prompt, llm.llm_engine.block_size),
                                             _cached_tokens_after(previous, prompt, llm.llm_engine.block_size)}
            assert got.num_cached_tokens >= len(previous) // 2
        previous = prompt + got.outputs[0].token_ids
        messages.append({"role": "assistant", "content": got.outputs[0].text})


def test_prefix_caching_gives_the_tokens_of_no_caching_behind_a_shared_system_prompt(llm, llm_without_caching):
    tokenizer = llm.get_tokenizer()
    system = " ".join(m["content"] for msgs in chats()[3:20] for m in msgs)
    prompts = [chat_prompt_ids(tokenizer, [{"role": "system", "content": system}, msgs[-1]])
               for msgs in chats()[20:28]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = llm_without_caching.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for _ in range(2):  # all at once: later admissions hit the first ones' blocks; then again: every one hits
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    block_size = llm.llm_engine.block_size
    assert [o.num_cached_tokens for o in got] == [(len(p) - 1) // block_size * block_size for p in prompts]
    engine = llm.llm_engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.stats.num_compiles_after_warm_up == 0


# ----- structured outputs ------------------------------------------------------------------------------

PERSON = {  # nested objects, an enum, an array, required fields; bounded strings so 200 tokens always suffice
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "doctor", "artist"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
CHOICES = ["positive", "negative", "neutral"]


def _sampled_under(llm, groups: list[tuple[str, StructuredOutputsParams, int, float]]) -> list[list]:
    """20 seeds at temperature 1.0 of each (question, constraint, max_tokens, min_p) group, all in one generate
    call: the groups share steps (a seeded row samples the same in any batch), so the short groups' rows fill
    the long ones' steps instead of each group ending on a tail of a few rows."""
    tokenizer = llm.get_tokenizer()
    prompts, params = [], []
    for question, constraint, max_tokens, min_p in groups:
        prompt = {"prompt_token_ids": chat_prompt_ids(tokenizer, [{"role": "user", "content": question}])}
        prompts += [prompt] * 20
        params += [SamplingParams(temperature=1.0, min_p=min_p, seed=seed, max_tokens=max_tokens,
                                  structured_outputs=constraint) for seed in range(20)]
    outputs = [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]
    return [outputs[i : i + 20] for i in range(0, len(outputs), 20)]


# Any JSON object: at temperature 1.0 the 135M model's tail rambles in free-form objects (measured: 14 of 20 seeds
# close their object within 400 tokens); min_p 0.1 cuts most of that tail (19 of 20 with the inverse-CDF draws; the
# 20th nests {"type": "json", "data": {...}} past 400 tokens, as it does at min_p 0.2). Every object that closes
# parses: the grammar does the rest.
WEATHER_OBJECT = 'Reply with a JSON object like {"city": "Paris", "temperature": 21} for the weather in London.'


def test_every_structured_output_is_valid_at_temperature_one_over_20_seeds(llm):
    import jsonschema

    people, phones, choices, objects = _sampled_under(llm, [
        ("Describe a person as JSON.", StructuredOutputsParams(json=PERSON), 200, 0.0),
        ("Give me a phone number.", StructuredOutputsParams(regex=r"\d{3}-\d{4}"), 200, 0.0),
        ("Is 'I love it' positive?", StructuredOutputsParams(choice=CHOICES), 200, 0.0),
        (WEATHER_OBJECT, StructuredOutputsParams(json_object=True), 400, 0.1),
    ])
    for out in people:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    for out in phones:
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.text), out.text
    for out in choices:
        assert out.text in CHOICES and out.finish_reason == "stop"
    closed = [out for out in objects if out.finish_reason == "stop"]
    assert len(closed) >= 18, [out.text for out in objects if out.finish_reason != "stop"]
    for out in closed:
        assert isinstance(json.loads(out.text), dict)


def test_constrained_rows_leave_the_other_rows_of_their_batch_alone(llm):
    """Greedy unconstrained rows get the tokens they get without the constrained ones beside them; n > 1 samples
    each follow the schema; nothing compiles."""
    tokenizer = llm.get_tokenizer()
    free = [{"prompt_token_ids": p} for p in _text_prompts(tokenizer, [30, 50, 20])]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(free, greedy, use_tqdm=False)]
    question = {"prompt_token_ids": chat_prompt_ids(tokenizer, [{"role": "user", "content": "A person as JSON."}])}
    schema = StructuredOutputsParams(json=PERSON)
    several = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=200, structured_outputs=schema)
    one = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=StructuredOutputsParams(choice=CHOICES))
    outputs = llm.generate(free + [question, question], [greedy] * 3 + [several, one], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs[:3]] == alone
    import jsonschema

    assert len(outputs[3].outputs) == 3
    for sample in outputs[3].outputs:
        jsonschema.validate(json.loads(sample.text), PERSON)
    assert outputs[4].outputs[0].text in CHOICES
    assert llm.llm_engine.stats.num_compiles_after_warm_up == 0


def test_the_openai_client_gets_structured_outputs_from_the_server(llm):
    """response_format (json_object and json_schema) and vLLM's extra-body fields, through the official client;
    an unsupported response_format is a 400."""
    import openai

    from jaxserve.entrypoints.api_server import build_app
    from tests.server import ServerThread

    engine = AsyncLLMEngine(llm.llm_engine)
    app = build_app(engine, served_model_name="smol")
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    with ServerThread(app, engine) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        chat = lambda **kwargs: client.chat.completions.create(  # noqa: E731
            model="smol", messages=messages, max_tokens=200, temperature=1.0, seed=9, **kwargs).choices[0]
        answer = chat(response_format={"type": "json_object"})  # seed 9 closes its object (7 rambles past 200)
        assert answer.finish_reason == "stop" and isinstance(json.loads(answer.message.content), dict)
        schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        import jsonschema

        jsonschema.validate(json.loads(chat(response_format=schema).message.content), PERSON)
        assert chat(extra_body={"guided_choice": CHOICES}).message.content in CHOICES
        assert re.fullmatch(r"[0-9]{3}", chat(extra_body={"guided_regex": r"\d{3}"}).message.content)
        assert chat(extra_body={"structured_outputs": {"choice": ["yes", "no"]}}).message.content in ("yes", "no")
        completion = client.completions.create(model="smol", prompt="Name:", max_tokens=8, temperature=1.0,
                                               extra_body={"guided_choice": CHOICES}).choices[0]
        assert completion.text in CHOICES
        with pytest.raises(openai.BadRequestError, match="response_format type 'structural_tag' is not supported"):
            chat(response_format={"type": "structural_tag"})
        with pytest.raises(openai.BadRequestError, match="invalid structured outputs json: Invalid type: nope"):
            chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})


# ----- tool calling through the server --------------------------------------------------------------------------

# bounded schemas, so that 200 tokens always close a call at temperature 1
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                           "parameters": NO_ARGUMENTS}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": NO_ARGUMENTS}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# a Hermes-style template (Qwen2.5's shape): tools in a system turn, calls as <tool_call> JSON, results as
# <tool_response> in a user turn
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}</tools>\nCall one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n"
    "{% endif %}{% for message in messages %}{% if message.role == 'tool' %}<|im_start|>user\n<tool_response>"
    "{{ message.content }}</tool_response><|im_end|>\n{% elif message.tool_calls %}<|im_start|>assistant\n"
    "{% for call in message.tool_calls %}<tool_call>{{ {'name': call.function.name, 'arguments': "
    "call.function.arguments} | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% else %}<|im_start|>"
    "{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"  # Qwen3's switch: the prompt ends the reasoning
)
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
FORCED_HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'
# the same call in the other parsers' formats (vLLM's): Llama 3's JSON, Mistral's [TOOL_CALLS] list, a Python list
FORCED_CALLS = {
    "llama3_json": r'\{"name": "get_weather", "parameters": \{"city": "Paris"\}\}',
    "mistral": r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\]',
    "pythonic": r'\[get_weather\(city="Paris"\)\]',
}
CALL_IDS = {"mistral": "[A-Za-z0-9]{9}"}  # Mistral's templates take 9 alphanumerics (as vLLM's parser makes them)


def _calls(choice) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in choice.message.tool_calls]


def _streamed_calls(stream) -> tuple[list[tuple[str, dict]], str | None]:
    """A streamed answer's tool calls reassembled from their deltas (name first, then argument fragments), and
    its finish reason (each call's id comes with its name)."""
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": None, "arguments": ""})
                if delta.function.name:
                    assert entry["name"] is None and delta.id
                    entry["name"] = delta.function.name
                entry["arguments"] += delta.function.arguments or ""
    return [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)], finish


@pytest.mark.parametrize("parser", sorted(FORCED_CALLS))
def test_auto_tool_choice_reads_the_call_in_each_parsers_format(llm, parser):
    """tool_choice "auto" on a server started with --tool-call-parser llama3_json, mistral or pythonic (hermes:
    the next test): the model's call in that parser's format (forced by a regex) answers as an OpenAI tool call,
    whole and streamed."""
    import openai

    from jaxserve.entrypoints.api_server import build_app
    from jaxserve.entrypoints.chat_output import ChatParserOptions
    from tests.server import ServerThread

    engine = AsyncLLMEngine(llm.llm_engine)
    options = ChatParserOptions(enable_auto_tool_choice=True, tool_call_parser=parser)
    app = build_app(engine, served_model_name="smol", chat_template=TOOL_TEMPLATE, chat_parsers=options)
    forced = {"structured_outputs": {"regex": FORCED_CALLS[parser]}}
    with ServerThread(app, engine) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        ask = lambda **kwargs: client.chat.completions.create(  # noqa: E731
            model="smol", messages=WEATHER_QUESTION, tools=TOOLS, temperature=0.0, max_tokens=60, extra_body=forced,
            **kwargs)
        whole = ask().choices[0]
        assert (_calls(whole), whole.finish_reason, whole.message.content) == (
            [("get_weather", {"city": "Paris"})], "tool_calls", None)
        ids = CALL_IDS.get(parser, r"call_[0-9a-f]{24}")
        assert re.fullmatch(ids, whole.message.tool_calls[0].id), whole.message.tool_calls[0].id
        assert _streamed_calls(ask(stream=True)) == (_calls(whole), "tool_calls")


def test_the_openai_client_calls_tools(llm):
    """tool_choice named and "required": valid calls over 20 seeds at temperature 1 (the grammar enforces each
    function's schema); streamed, the same call; "auto" parses the model's hermes call (here forced by a regex);
    the qwen3 reasoning parser splits <think> reasoning off, whole and streamed; the call and its result go back
    through the template; bad tool requests are 400s naming the problem."""
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema
    import openai

    from jaxserve.entrypoints.api_server import build_app
    from jaxserve.entrypoints.chat_output import ChatParserOptions
    from tests.server import ServerThread

    engine = AsyncLLMEngine(llm.llm_engine)
    options = ChatParserOptions(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    app = build_app(engine, served_model_name="smol", chat_template=TOOL_TEMPLATE, chat_parsers=options,
                    trust_request_chat_template=True)  # a request below brings a tool-blind template
    named = {"type": "function", "function": {"name": "get_weather"}}
    with ServerThread(app, engine) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        # under the qwen3 reasoning parser a constraint waits for </think>, which this model never writes: its
        # requests switch thinking off, so the prompt ends the reasoning and constraints apply at once
        ask = lambda seed=0, **kwargs: client.chat.completions.create(  # noqa: E731
            model="smol", messages=kwargs.pop("messages", WEATHER_QUESTION), tools=TOOLS, temperature=1.0, seed=seed,
            max_tokens=kwargs.pop("max_tokens", 200), extra_body={**NO_THINKING, **kwargs.pop("extra_body", {})},
            **kwargs)
        with ThreadPoolExecutor(20) as pool:  # 20 requests at once: one batch; 64 tokens are enough for compact JSON
            named_answers = list(pool.map(lambda seed: ask(seed, tool_choice=named, max_tokens=64).choices[0],
                                          range(20)))
            required = list(pool.map(lambda seed: ask(seed, tool_choice="required", parallel_tool_calls=False,
                                                      max_tokens=64).choices[0], range(20)))
        for choice in named_answers:
            ((name, arguments),) = _calls(choice)
            assert (name, choice.finish_reason, choice.message.content) == ("get_weather", "tool_calls", None)
            jsonschema.validate(arguments, WEATHER)
        for choice in required:
            ((name, arguments),) = _calls(choice)
            assert choice.finish_reason == "tool_calls"
            jsonschema.validate(arguments, SCHEMAS[name])
        # greedy: compact JSON, where free whitespace let this model fill its whole budget with blanks in the call
        greedy = client.chat.completions.create(model="smol", messages=WEATHER_QUESTION, tools=TOOLS, max_tokens=64,
                                                temperature=0.0, tool_choice="required", parallel_tool_calls=False,
                                                extra_body=NO_THINKING)
        assert greedy.choices[0].finish_reason == "tool_calls", greedy.choices[0].message.content
        assert _calls(greedy.choices[0]) == [("get_weather", {"city": "Paris", "unit": "c"})]
        assert _streamed_calls(ask(3, tool_choice=named, stream=True)) == (_calls(named_answers[3]), "tool_calls")
        assert _streamed_calls(ask(5, tool_choice="required", parallel_tool_calls=False, stream=True)) == (
            _calls(required[5]), "tool_calls")

        forced = {"structured_outputs": {"regex": FORCED_HERMES_CALL}}
        auto = ask(extra_body=forced).choices[0]  # tool_choice "auto": the server's hermes parser reads the call
        assert (_calls(auto), auto.finish_reason, auto.message.content) == (
            [("get_weather", {"city": "Paris"})], "tool_calls", None)
        assert _streamed_calls(ask(extra_body=forced, stream=True)) == (_calls(auto), "tool_calls")

        thought = {"structured_outputs": {"regex": r"<think>Paris is in France\.</think>Sunny\."}}
        reasoned = ask(tool_choice="none", extra_body=thought).choices[0].message
        assert (reasoned.model_extra["reasoning_content"], reasoned.content) == ("Paris is in France.", "Sunny.")
        deltas = [c.choices[0].delta for c in ask(tool_choice="none", extra_body=thought, stream=True) if c.choices]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Paris is in France."
        assert "".join(d.content or "" for d in deltas) == "Sunny."

        call = auto.message.tool_calls[0]
        second_turn = [*WEATHER_QUESTION, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                       {"role": "tool", "tool_call_id": call.id, "content": "21 C and sunny"}]
        answer = ask(messages=second_turn, tool_choice="none", max_tokens=8).choices[0]
        assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
        rendered = httpx.post(server.base_url + "/tokenize", json={"messages": second_turn}).json()["tokens"]
        prompt = llm.get_tokenizer().decode(rendered)
        assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
        assert "<tool_response>21 C and sunny</tool_response>" in prompt

        bad = {"type": "function", "function": {"name": "nope"}}
        with pytest.raises(openai.BadRequestError, match="tool_choice names the function 'nope', which is not among "
                                                         r"the tools \(get_weather, get_time\)"):
            ask(tool_choice=bad)
        broken = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
        with pytest.raises(openai.BadRequestError, match="tool 'f' has invalid parameters"):
            client.chat.completions.create(model="smol", messages=WEATHER_QUESTION, tools=broken)
        with pytest.raises(openai.BadRequestError, match="the chat template does not render tools"):
            ask(extra_body={"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})
    plain = build_app(engine, served_model_name="smol", chat_template=TOOL_TEMPLATE)
    with ServerThread(plain, engine) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError, match='"auto" tool choice requires --enable-auto-tool-choice and '
                                                         "--tool-call-parser to be set"):
            client.chat.completions.create(model="smol", messages=WEATHER_QUESTION, tools=TOOLS)
