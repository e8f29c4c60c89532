"""response_format / json_schema by constrained decoding (engine/grammar.py) and log-probabilities
(engine/sampling.py), through the Python API on random-weight models: whatever the weights, the output
parses and validates, and a reported log-probability is the log-softmax of the distribution the token
was drawn from, against a float64 reference of the model's logits."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

import moestream
from moestream.engine.grammar import GrammarError
from moestream.engine.sampling import NO_PROBABILITY
from moestream.errors import MoestreamError

# bounded strings, numbers and arrays: a random walk through it ends within the token budget
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": -5, "maximum": 500},
        "score": {"type": "number", "enum": [0.5, 2, -1.25]},  # free digits would run past any budget
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog", None]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "null"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "note": {
            "anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "string", "maxLength": 2}]
        },
    },
    "required": ["name", "age", "ok", "kind", "tags", "point", "note"],
    "additionalProperties": False,
}
SEEDS = range(16)


@pytest.fixture(scope="module")
def engines(tiny_dir):
    opened = {}

    def get(arch: str, trunk: str = "auto"):
        if (arch, trunk) not in opened:
            opened[arch, trunk] = moestream.load(str(tiny_dir(arch)), cache="1MiB", trunk=trunk)
        return opened[arch, trunk]

    yield get
    for engine in opened.values():
        engine.close()


@pytest.mark.parametrize("arch, trunk", [("qwen3_moe", "auto"), ("qwen3_moe", "eager"), ("gpt_oss", "auto")])
def test_json_schema_output_always_validates(engines, arch, trunk):
    engine = engines(arch, trunk)
    validator = jsonschema.Draft202012Validator(SCHEMA)
    for seed in SEEDS:
        for temperature in (1.0, 1.5):
            out = engine.generate(
                "Hello", max_tokens=200, temperature=temperature, seed=seed, json_schema=SCHEMA
            )
            assert out.finish_reason == "stop", (seed, out.text)  # the grammar ended it, not the budget
            validator.validate(json.loads(out.text))
    greedy = engine.generate("Hello", max_tokens=200, response_format=_format(SCHEMA))
    validator.validate(json.loads(greedy.text))
    # a grammar changes nothing for the next plain request (the prompt cache, the sampler)
    plain = [engine.generate("Hello", max_tokens=8, ignore_eos=True).tokens for _ in range(2)]
    assert plain[0] == plain[1]


def test_json_object_output_parses_as_an_object(engines):
    engine = engines("qwen3_moe")
    finished = 0
    for seed in SEEDS:
        out = engine.generate(
            "Hi", max_tokens=120, temperature=1.0, seed=seed, response_format={"type": "json_object"}
        )
        if out.finish_reason == "stop":
            finished += 1
            assert isinstance(json.loads(out.text), dict), out.text
        else:  # cut by max_tokens: a prefix of an object, never anything else
            assert out.text.startswith("{") and out.finish_reason == "length"
    assert finished >= len(SEEDS) // 2


def test_grammar_with_a_stop_string_and_the_stream(engines):
    engine = engines("qwen3_moe")
    pieces = [
        g.piece for g in engine.stream("Hi", max_tokens=200, seed=3, temperature=1.0, json_schema=SCHEMA)
    ]
    whole = engine.generate("Hi", max_tokens=200, seed=3, temperature=1.0, json_schema=SCHEMA)
    assert "".join(pieces) == whole.text and json.loads(whole.text)
    cut = engine.generate("Hi", max_tokens=200, seed=3, temperature=1.0, json_schema=SCHEMA, stop=['"age"'])
    assert cut.finish_reason == "stop" and whole.text.startswith(cut.text) and '"age"' not in cut.text


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"json_schema": {"type": "wat"}}, "JSON schema cannot be compiled: Invalid type: wat"),
        ({"json_schema": {"not": {"type": "string"}}}, "Unimplemented keys"),
        ({"json_schema": {"type": "string", "pattern": "(("}}, "regex parse error"),
        ({"json_schema": {"$ref": "#/$defs/missing"}}, "does not exist"),
        ({"json_schema": [1]}, "a JSON schema must be an object"),
        ({"response_format": {"type": "xml"}}, "not one of text, json_object, json_schema"),
        ({"response_format": {"type": "json_schema"}}, "json_schema must be"),
        ({"response_format": {"type": "json_object"}, "json_schema": {}}, "not both"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos cannot be combined"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
    ],
)
def test_what_cannot_be_compiled_is_one_sentence(engines, kwargs, match):
    engine = engines("qwen3_moe")
    with pytest.raises(MoestreamError, match=match) as err:
        engine.generate("Hi", max_tokens=4, **kwargs)
    if isinstance(err.value, GrammarError):
        assert "\n" not in str(err.value)
    assert engine.generate("Hi", max_tokens=2).tokens  # the engine is still usable


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


def _captured_logits(engine):
    """Wrap the runner's forward: every forward's last-position logits, in order."""
    seen, runner = [], engine.runner.forward

    def step(ids, cache, greedy=False):
        logits, cache = runner(ids, cache, greedy)
        seen.append(logits.detach().double().clone())
        return logits, cache

    return seen, step


@pytest.mark.parametrize(
    "sampling",
    [
        {},  # greedy: the model's own distribution
        {"temperature": 0.7, "seed": 5},
        {"temperature": 1.3, "seed": 2, "presence_penalty": 1.5, "frequency_penalty": 0.5},
        {"temperature": 0.9, "seed": 1, "json_schema": SCHEMA},
    ],
)
def test_logprobs_are_the_log_softmax_of_the_sampled_distribution(engines, monkeypatch, sampling):
    engine = engines("qwen3_moe")
    seen, step = _captured_logits(engine)
    monkeypatch.setattr(engine.runner, "forward", step)
    out = engine.generate("Hello world", max_tokens=12, logprobs=5, **sampling)
    assert len(out.logprobs) == len(out.tokens) and len(seen) >= len(out.tokens)
    temperature = sampling.get("temperature", 1.0)
    counts = torch.zeros(seen[0].shape[-1], dtype=torch.float64)
    allowed = _allowed_tokens(engine, out.tokens) if "json_schema" in sampling else None
    for i, (token, entry) in enumerate(zip(out.tokens, out.logprobs)):
        scores = seen[i].clone()
        if allowed is not None:
            scores[~allowed[i]] = float("-inf")
        scores = scores - sampling.get("frequency_penalty", 0) * counts
        scores = scores - sampling.get("presence_penalty", 0) * (counts > 0).double()
        reference = torch.log_softmax(scores / temperature, dim=-1)  # float64
        assert entry.token == token
        assert abs(entry.logprob - float(reference[token])) < 1e-4, (
            i,
            entry.logprob,
            float(reference[token]),
        )
        best = torch.topk(reference, 5)
        for (t, lp), (rt, rlp) in zip(entry.top, zip(best.indices.tolist(), best.values.tolist())):
            if rlp == float("-inf"):
                assert lp == NO_PROBABILITY
            else:
                assert abs(lp - rlp) < 1e-4 and (t == rt or abs(float(reference[t]) - rlp) < 1e-6)
        if not sampling.get("temperature"):
            assert token == entry.top[0][0]  # greedy took the most likely
        counts[token] += 1


def _allowed_tokens(engine, tokens: list[int]) -> list[torch.Tensor]:
    """The grammar's allowed set before each token, replayed by a matcher of its own."""
    from moestream.engine.grammar import response_format_grammar

    constraint = engine.grammars.constraint(response_format_grammar(None, SCHEMA))
    masks = []
    for token in tokens:
        scores = torch.zeros(engine.grammars.vocab_size, dtype=torch.float32)
        constraint.mask(scores)
        masks.append(scores == 0)
        constraint.accept(token)
    return masks
