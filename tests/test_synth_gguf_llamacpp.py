"""A synthetic GGUF in real llama.cpp: llama-server loads it, tokenizes like the synthetic HF tokenizer,
and answers an OpenAI chat request. Runs when MOESTREAM_LLAMA_SERVER names a llama-server binary
(benchmarks/llamacpp/build.sh builds one); skipped otherwise."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from moestream.synth import synthesize
from moestream.synth.tokenizer import build_tokenizer

SERVER = os.environ.get("MOESTREAM_LLAMA_SERVER", "")
pytestmark = pytest.mark.skipif(
    not (SERVER and os.access(SERVER, os.X_OK)), reason="set MOESTREAM_LLAMA_SERVER to a llama-server binary"
)
TEXT = "The expert cache keeps the hot experts. 캐시는 자주 쓰는 전문가를 보관합니다."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CASES = [("qwen3_moe", "Q4_K_M"), ("qwen3_moe", "MXFP4_MOE"), ("qwen2_moe", "Q4_K_M"), ("olmoe", "Q5_K_M")]
LLAMA_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe"}


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def server(request, tmp_path_factory):
    arch, quant = request.param
    path = tmp_path_factory.mktemp("llama") / f"{arch}-{quant}.gguf"
    # llama.cpp's olmoe wants as many kv heads as heads: the preset's attention (16 heads of 128)
    shape = (
        {"preset": "olmoe-1b-7b", "layers": 1}
        if arch == "olmoe"
        else {"arch": arch, "layers": 2, "hidden": 256}
    )
    synthesize(path, **shape, experts=16, top_k=4, moe_intermediate=256, format="gguf", quant=quant)
    port = _free_port()
    log = open(path.with_suffix(".log"), "w")
    cmd = [SERVER, "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-c", "512"]
    proc = subprocess.Popen([*cmd, "--no-warmup", "-v"], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            if proc.poll() is not None:
                pytest.fail(f"llama-server exited: {Path(log.name).read_text()[-3000:]}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield base, Path(log.name), request.param
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_llama_server_loads_the_types_we_wrote(server):
    _, log, (arch, quant) = server
    text = log.read_text()
    want = {
        "Q4_K_M": ("q4_K", "q6_K", "Q4_K - Medium"),
        "Q5_K_M": ("q5_K", "q6_K", "Q5_K - Medium"),
        "MXFP4_MOE": ("mxfp4", "q8_0", "MXFP4 MoE"),
    }
    for name in want[quant][:2]:
        assert re.search(rf"- type +{name}: +\d+ tensors", text), name
    assert want[quant][2] in text and re.search(rf"arch += {LLAMA_ARCH[arch]}\n", text)


def test_llama_cpp_tokenizes_like_the_synthetic_tokenizer(server):
    base, _, _ = server
    got = httpx.post(base + "/tokenize", json={"content": TEXT}, timeout=30).json()["tokens"]
    assert got == build_tokenizer().encode(TEXT)
    back = httpx.post(base + "/detokenize", json={"tokens": got}, timeout=30).json()["content"]
    assert back == TEXT


def test_openai_chat_completion(server):
    import openai

    base, _, _ = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    r = client.chat.completions.create(
        model="synth", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(
        build_tokenizer().encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    )


def test_greedy_tokens_equal_moestreams(server, tmp_path):
    """The same file through llama-server and moestream's graphs, greedy: the same tokens (the graphs
    compute the routers in float32 and sum the experts with llama.cpp's roundings)."""
    import moestream

    base, log, _ = server
    path = Path(log).with_suffix(".gguf")
    ids = build_tokenizer().encode(TEXT)
    body = {"prompt": ids, "n_predict": 24, "temperature": 0, "cache_prompt": False, "return_tokens": True}
    body["ignore_eos"] = True
    want = httpx.post(base + "/completion", json=body, timeout=120).json()["tokens"]
    with moestream.load(str(path), threads=2, ctx_size=512) as engine:
        got = engine.generate(ids, max_tokens=24, ignore_eos=True).tokens
    assert got == want
