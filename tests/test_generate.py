"""Generation through the public API and the CLI, against stock transformers."""

from __future__ import annotations

import json

import torch
import transformers as T

import moestream
from moestream.cli import main


def test_cli_generate_json_matches_stock_greedy(tiny_dir, capsys):
    """In-process (`python -m moestream` as a process: test_faults, test_chat_cli and the server tests):
    stdout is the JSON object alone."""
    path = tiny_dir("qwen3_moe")
    tok = T.AutoTokenizer.from_pretrained(path)
    ids = tok.encode("Hello world", add_special_tokens=False)
    ref = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = ref.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[
        0, len(ids) :
    ]
    argv = ["generate", str(path), "--prompt", "Hello world", "--max-tokens", "12", "--ignore-eos"]
    rc = main([*argv, "--cache", "100KiB", "--json"])
    stdout, stderr = capsys.readouterr()
    assert rc == 0, stderr
    out = json.loads(stdout)
    assert out["tokens"] == expected.tolist()
    assert out["text"] == tok.decode(expected, skip_special_tokens=True)
    stats = out["stats"]
    assert stats["misses"] > 0 and stats["bytes_read"] > 0 and 0 <= stats["hit_rate"] <= 1
    assert set(stats) >= {
        "prefill_tok_s",
        "decode_tok_s",
        "bytes_read",
        "hits",
        "misses",
        "hit_rate",
        "read_wait_ms",
    }


def test_cli_generate_prints_text_on_stdout_and_mode_and_stats_on_stderr(tiny_dir, capsys):
    path = tiny_dir("qwen3_moe")
    assert (
        main(
            [
                "generate",
                str(path),
                "--prompt",
                "Hello",
                "--max-tokens",
                "5",
                "--ignore-eos",
                "--cache",
                "100KiB",
                "--io-mode",
                "pagecache",
                "--io-threads",
                "2",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    lines = [x for x in captured.err.splitlines() if not x.startswith("moestream: warning:")]
    assert lines[0].startswith(
        "moestream: qwen3_moe on cpu | io pagecache, 2 io threads, 128 KiB pieces | cache 100.0 KiB"
    )
    assert "threads 1" in lines[0] and "| context 256 tokens, KV cache 128.0 KiB when full" in lines[0]
    assert lines[-1].startswith("prefill ") and "decode " in lines[-1] and "MiB/token" in lines[-1]
    assert "hit rate" in lines[-1] and "ms/token" in lines[-1]
    # stdout is the text alone, streamed piece by piece: what `generate --json` reports as the text
    assert (
        main(["generate", "-m", str(path), "-p", "Hello", "-n", "5", "--ignore-eos", "--json", "-t", "1"])
        == 0
    )
    assert captured.out == json.loads(capsys.readouterr().out)["text"] + "\n"


def test_chat_template_is_applied(tiny_dir):
    path = tiny_dir("qwen3_moe")
    tok = T.AutoTokenizer.from_pretrained(path)
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True
    )
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    with moestream.load(str(path), cache="1MiB") as engine:
        assert engine.encode("Hi", chat=True) == expected
        assert engine.generate("Hi", chat=True, max_tokens=3).prompt_tokens == len(expected)


def test_sampling_is_seeded_and_degenerates_to_greedy(tiny_dir):
    with moestream.load(str(tiny_dir("mixtral")), cache="1MiB") as engine:
        prompt = [5, 17, 33, 2]
        greedy = engine.generate(prompt, max_tokens=16, ignore_eos=True).tokens
        a = engine.generate(prompt, max_tokens=16, temperature=1.5, seed=7, ignore_eos=True).tokens
        b = engine.generate(prompt, max_tokens=16, temperature=1.5, seed=7, ignore_eos=True).tokens
        c = engine.generate(prompt, max_tokens=16, temperature=1.5, seed=8, ignore_eos=True).tokens
        assert a == b and a != c and a != greedy
        assert (
            engine.generate(prompt, max_tokens=16, temperature=1.0, top_k=1, seed=3, ignore_eos=True).tokens
            == greedy
        )
        assert (
            engine.generate(
                prompt, max_tokens=16, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True
            ).tokens
            == greedy
        )


def test_stop_strings_and_eos(tiny_dir):
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="1MiB") as engine:
        full = engine.generate("Hello", max_tokens=24, ignore_eos=True)
        stop = full.text[len(full.text) // 2 :][:2]
        cut = engine.generate("Hello", max_tokens=24, ignore_eos=True, stop=[stop])
        assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]
        assert stop not in cut.text
