"""Random router traces with a realistic shape (skewed, sticky routing), for tests and benchmarks.

Each layer has a Zipf-like expert popularity; a token's router scores are that popularity plus noise,
plus a bonus for the experts the previous token used at the same layer (adjacent tokens share experts),
and the top-k of the scores are routed. The stale-gate prediction for layer L+1 is the top-2k of layer
L+1's scores with extra noise, so its recall is imperfect. Nothing here claims to match a real model.
"""

from __future__ import annotations

import numpy as np

from moestream.trace.schema import TraceHeader
from moestream.trace.table import Trace


def _scores(rng: np.random.Generator, log_pop: np.ndarray, n_tokens: int, stickiness: float) -> np.ndarray:
    """[T, L, E] router scores for one request's tokens: popularity + Gumbel noise + previous-token bonus."""
    n_layers, n_experts = log_pop.shape
    noise = rng.gumbel(size=(n_tokens, n_layers, n_experts)).astype(np.float32)
    scores = log_pop[None] + noise
    cut = n_experts - max(1, n_experts // 10)  # index of the 90th percentile in a sorted row
    for t in range(1, n_tokens):  # sticky: bonus on the experts the previous token scored in its top 10%
        threshold = np.partition(scores[t - 1], cut, axis=-1)[:, cut : cut + 1]
        scores[t] += stickiness * (scores[t - 1] >= threshold)
    return scores


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores along the last axis, best first."""
    part = np.argpartition(-scores, k - 1, axis=-1)[..., :k]
    best = np.take_along_axis(scores, part, axis=-1)
    return np.take_along_axis(part, np.argsort(-best, axis=-1), axis=-1)


def random_trace(
    n_layers: int = 8,
    n_experts: int = 32,
    top_k: int = 4,
    n_requests: int = 4,
    prompt_len: int = 16,
    decode_len: int = 32,
    seed: int = 0,
    skew: float = 1.0,
    stickiness: float = 1.5,
    predictions: bool = False,
    expert_bytes: int = 1 << 20,
    synthetic: bool = True,
) -> Trace:
    """A trace of `n_requests` requests, each a prefill of `prompt_len` tokens then `decode_len` decode
    tokens.

    Rows are in recording order: a request's prefill layer by layer (all tokens of a layer together),
    then its decode token by token; one step per prefill and per decode token.
    """
    rng = np.random.default_rng(seed)
    ranks = np.argsort(rng.random((n_layers, n_experts)), axis=1) + 1  # a different favourite per layer
    log_pop = (-skew * np.log(ranks)).astype(np.float32)
    cols: dict[str, list[np.ndarray]] = {
        k: [] for k in ("request", "token", "phase", "layer", "step", "experts", "weights", "pred")
    }
    step, n_tok = 0, prompt_len + decode_len
    for r in range(n_requests):
        scores = _scores(rng, log_pop, n_tok, stickiness)
        experts = _top(scores, top_k)  # [T, L, k]
        weights = np.take_along_axis(scores, experts, axis=-1)
        weights = np.exp(weights - weights.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        noisy = np.concatenate([scores[:, 1:], scores[:, :1]], axis=1) + rng.gumbel(size=scores.shape)
        pred = _top(noisy.astype(np.float32), min(2 * top_k, n_experts))  # row L predicts layer L+1
        pred[:, -1] = -1  # the last layer has no next layer
        t_idx, l_idx = _order(prompt_len, n_tok, n_layers)
        steps = np.where(t_idx < prompt_len, step, step + 1 + t_idx - prompt_len)
        step += 1 + decode_len
        for name, value in (
            ("request", np.full(len(t_idx), r)),
            ("token", t_idx),
            ("phase", (t_idx >= prompt_len).astype(np.int8)),
            ("layer", l_idx),
            ("step", steps),
            ("experts", experts[t_idx, l_idx]),
            ("weights", weights[t_idx, l_idx]),
            ("pred", pred[t_idx, l_idx]),
        ):
            cols[name].append(value)
    c = {name: np.concatenate(parts) for name, parts in cols.items()}
    header = TraceHeader(
        model_id=f"synthetic-{n_layers}x{n_experts}-top{top_k}",
        n_layers=n_layers,
        n_experts=n_experts,
        top_k=top_k,
        dtype="bf16",
        expert_bytes=expert_bytes,
        synthetic=synthetic,
        source="moestream.trace.synthetic.random_trace",
    )
    return Trace(
        header=header,
        request=c["request"].astype(np.int32),
        request_names=[f"r{i}" for i in range(n_requests)],
        token=c["token"].astype(np.int64),
        phase=c["phase"],
        layer=c["layer"].astype(np.int32),
        step=c["step"].astype(np.int64),
        experts=c["experts"].astype(np.int32),
        weights=c["weights"].astype(np.float32),
        pred_experts=c["pred"].astype(np.int32) if predictions else None,
        pred_scores=np.where(c["pred"] >= 0, 1.0, np.nan).astype(np.float32) if predictions else None,
    )


def _order(prompt_len: int, n_tok: int, n_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """(token, layer) of each row: prefill layer-major, then decode token-major."""
    pre_l, pre_t = np.divmod(np.arange(prompt_len * n_layers), prompt_len)
    dec_t, dec_l = np.divmod(np.arange((n_tok - prompt_len) * n_layers), n_layers)
    return np.concatenate([pre_t, dec_t + prompt_len]), np.concatenate([pre_l, dec_l])
