"""What users of llama-server, vLLM and mlx-lm expect, through the real openai client against a live
server: the prompt cache across chat turns, the context cap, nulls and stream_options as clients send
them, the logits processors, the model's sampling defaults, chat_template_kwargs and --chat-template,
unsupported fields refused by name, an access-log line per request, and a clean stop on SIGTERM/SIGINT."""

from __future__ import annotations

import json
import re
import shutil
import signal
import threading
import time

import httpx
import openai
import pytest
import transformers as T
from test_server_harness import KEY, LiveServer, long_context_copy

from moestream.cli import main

CONTEXT = 200
# the tiny ChatML template plus Qwen3's switch: enable_thinking=False writes an empty think block
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
LONG_TURN = "The quick brown fox jumps over the lazy dog. Mixture of experts models route every token. " * 2
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    """64 experts behind a two-slot cache (bytes follow the work), context capped at 200 with -c, the
    template from a file, and a generation_config.json that makes top_k 1 the model's default."""
    root = tmp_path_factory.mktemp("users")
    path = root / "users_model"
    shutil.copytree(tiny_dir("qwen3_moe", experts=64), path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "top_k": 1}))
    (root / "template.jinja").write_text(TEMPLATE)
    live = LiveServer(
        path,
        [
            "-m",
            str(path),
            "-c",
            str(CONTEXT),
            "-t",
            "1",
            "--cache",
            "100KiB",
            "--chat-template",
            str(root / "template.jinja"),
            "--api-key",
            KEY,
        ],
        positional=False,
    )
    yield live
    live.stop()


@pytest.fixture(scope="module")
def tokenizer(server):
    tok = T.AutoTokenizer.from_pretrained(server.path)
    tok.chat_template = TEMPLATE
    return tok


def _chat(server, messages, **kwargs):
    return server.client().chat.completions.create(model=server.model, messages=messages, **kwargs)


def test_second_chat_turn_reuses_the_first_and_reads_less(server):
    cached_before = server.metric("moestream_prompt_tokens_cached_total")
    turn = [{"role": "user", "content": LONG_TURN}]
    first = _chat(server, turn, max_tokens=6, **GREEDY)
    turn2 = turn + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    warm = _chat(server, turn2, max_tokens=8, **GREEDY)
    cold = _chat(
        server, turn2, max_tokens=8, temperature=0, extra_body={"ignore_eos": True, "cache_prompt": False}
    )
    assert warm.choices[0].message.content == cold.choices[0].message.content
    tw, tc = warm.model_extra["timings"], cold.model_extra["timings"]
    # the whole first prompt is a prefix of the second (its last token may merge with the reply's first)
    assert tw["cache_n"] >= first.usage.prompt_tokens - 1
    assert tw["prompt_n"] == warm.usage.prompt_tokens - tw["cache_n"] < warm.usage.prompt_tokens / 2
    assert tc["cache_n"] == 0 and tc["prompt_n"] == cold.usage.prompt_tokens == warm.usage.prompt_tokens
    assert warm.model_extra["moe"]["bytes_read"] < cold.model_extra["moe"]["bytes_read"]
    reused = first.model_extra["timings"]["cache_n"] + tw["cache_n"]
    assert server.metric("moestream_prompt_tokens_cached_total") - cached_before == reused


def test_context_cap(server):
    client = server.client()
    assert [m.model_extra["context_length"] for m in client.models.list()] == [CONTEXT]
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=server.model, prompt=prompt, max_tokens=CONTEXT - 9)
    assert (
        f"max_tokens {CONTEXT - 9} plus the prompt's 10 tokens exceeds the context of {CONTEXT}"
        in err.value.message
    )
    assert err.value.code == "context_length_exceeded"
    # chat without max_tokens: the rest of the context
    out = _chat(server, [{"role": "user", "content": "Hi"}], **GREEDY)
    assert out.usage.total_tokens == CONTEXT and out.choices[0].finish_reason == "length"


def test_nulls_mean_defaults_and_stream_options_include_usage(server):
    client = server.client()
    greedy = (
        client.completions.create(model=server.model, prompt="Hello", max_tokens=5, **GREEDY).choices[0].text
    )
    # what the openai package sends when a wrapper passes None (temperature None: 1.0, the model's top_k 1)
    nulls = dict(
        temperature=None,
        top_p=None,
        stop=None,
        seed=None,
        presence_penalty=None,
        frequency_penalty=None,
        logit_bias=None,
        n=None,
        user=None,
        stream_options=None,
        logprobs=None,
        best_of=None,
    )
    out = client.completions.create(
        model=server.model,
        prompt="Hello",
        max_tokens=5,
        extra_body={"ignore_eos": True, "min_p": None, "top_k": None},
        **nulls,
    )
    assert out.choices[0].text == greedy
    raw = server.http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": None,
            "temperature": None,
            "tools": None,
            "stream": None,
        },
    )
    assert raw.status_code == 200 and raw.json()["usage"]["completion_tokens"] >= 1
    chunks = list(
        _chat(
            server,
            [{"role": "user", "content": "Hi"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].model_extra["timings"]["predicted_n"] == 6
    assert all(c.usage is None and "timings" not in c.model_extra for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"


def test_logits_processors_and_model_defaults(server, tokenizer, capsys):
    client = server.client()

    def complete(**kwargs) -> str:
        extra = {"ignore_eos": True, **kwargs.pop("extra", {})}
        return (
            client.completions.create(
                model=server.model, prompt="Mixture of", max_tokens=12, extra_body=extra, **kwargs
            )
            .choices[0]
            .text
        )

    assert complete(temperature=0, logit_bias={"9": 100}) == tokenizer.decode([9] * 12)
    # the CLI (itself checked against stock transformers) is the oracle for the penalties
    capsys.readouterr()
    assert (
        main(
            [
                "generate",
                str(server.path),
                "-p",
                "Mixture of",
                "-n",
                "12",
                "--ignore-eos",
                "--json",
                "--repeat-penalty",
                "1.5",
                "--presence-penalty",
                "0.5",
                "--frequency-penalty",
                "0.8",
            ]
        )
        == 0
    )
    expected = json.loads(capsys.readouterr().out)["text"]
    assert (
        complete(
            temperature=0, presence_penalty=0.5, frequency_penalty=0.8, extra={"repetition_penalty": 1.5}
        )
        == expected
    )
    assert (
        complete(temperature=0, presence_penalty=0.5, frequency_penalty=0.8, extra={"repeat_penalty": 1.5})
        == expected
    )
    # generation_config.json says top_k 1: a hot, seeded request that names no top_k is greedy
    greedy = complete(temperature=0)
    assert complete(temperature=1.3, seed=5) == greedy
    assert complete(temperature=1.3, seed=5, extra={"top_k": 0}) != greedy
    assert complete(temperature=1.3, seed=5, extra={"top_k": 0, "min_p": 1.0}) == greedy


def test_chat_template_file_and_kwargs(server, tokenizer):
    messages = [{"role": "user", "content": "Hi there"}]
    plain = _chat(server, messages, max_tokens=4, **GREEDY)
    thinking_off = _chat(
        server,
        messages,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    rendered = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, enable_thinking=False
    )
    ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert thinking_off.usage.prompt_tokens == len(ids) > plain.usage.prompt_tokens
    # the same ids sent as a completion prompt give the same text: the template is what was rendered
    same = server.client().completions.create(model=server.model, prompt=ids, max_tokens=4, **GREEDY)
    assert same.choices[0].text == thinking_off.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:
        _chat(server, messages, extra_body={"chat_template_kwargs": {"tokenize": False}})
    assert err.value.param == "chat_template_kwargs"


@pytest.mark.parametrize(
    "field, value",
    [
        ("functions", [{"name": "f"}]),
        ("audio", {"voice": "alloy"}),
        ("modalities", ["audio"]),
        ("n", 2),
    ],
)
def test_unsupported_fields_are_refused_by_name(server, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(server, [{"role": "user", "content": "x"}], max_tokens=2, **{field: value})
    assert err.value.param == field and err.value.code == "unsupported_parameter"


def test_access_log_has_one_line_per_request(server):
    before = server.log_text().count("\n")
    first = [{"role": "user", "content": "log me"}]
    _chat(server, first, max_tokens=3, **GREEDY)
    list(_chat(server, first, max_tokens=3, stream=True, **GREEDY))
    server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    server.http.get("/v1/nope")
    deadline = time.monotonic() + 5  # a line is written once its response's last byte has gone out,
    while time.monotonic() < deadline and len(server.log_text().splitlines()) < before + 4:  # in any order
        time.sleep(0.05)
    lines = server.log_text().splitlines()[before:]
    assert len(lines) == 4, lines
    chat = r'^moestream: 127\.0\.0\.1:\d+ "POST /v1/chat/completions" 200 prompt \d+'
    patterns = [
        chat + r"(?: \(cached \d+\))? predicted 3 [\d.]+ ms$",  # the template's start may be cached
        chat + r" \(cached \d+\) predicted 3 [\d.]+ ms$",  # the streamed repeat reuses the first
        r'^moestream: \S+ "POST /v1/completions" 400 [\d.]+ ms$',
        r'^moestream: \S+ "GET /v1/nope" 404 [\d.]+ ms$',
    ]
    unmatched = list(lines)
    for pattern in reversed(patterns):  # the most specific first
        found = next((x for x in unmatched if re.match(pattern, x)), None)
        assert found is not None, (pattern, lines)
        unmatched.remove(found)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_a_stream_ends_it_cleanly_and_exits_0(tiny_dir, sig):
    live = LiveServer(
        long_context_copy(tiny_dir("qwen3_moe")),
        ["--cache", "1MiB", "--api-key", KEY, "-t", "1", "-np", "1"],  # one slot: the second request waits
    )
    queued: list[httpx.Response] = []
    try:
        stream = live.client().completions.create(
            model=live.model, prompt="Hello", max_tokens=4000, stream=True, extra_body={"ignore_eos": True}
        )
        pieces = [next(stream) for _ in range(3)]
        waiter = threading.Thread(
            target=lambda: queued.append(
                live.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
            )
        )
        waiter.start()
        deadline = time.monotonic() + 30
        while live.http.get("/health").json()["waiting"] < 1:  # until it is queued behind the stream
            assert time.monotonic() < deadline, "the second request was never queued"
            time.sleep(0.01)
        live.proc.send_signal(sig)
        start = time.monotonic()
        with pytest.raises(openai.APIError, match="shutting down"):
            for chunk in stream:
                pieces.append(chunk)
        assert time.monotonic() - start < 5 and len(pieces) < 3000
        waiter.join(10)
        assert queued[0].status_code == 503 and queued[0].json()["error"]["code"] == "server_shutting_down"
        assert live.proc.wait(15) == 0
    finally:
        log = live.log_text()
        live.stop()
    assert "Traceback" not in log and "Error" not in log.replace("APIError", ""), log[-2000:]
