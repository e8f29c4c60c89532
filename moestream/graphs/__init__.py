"""The ggml graphs of each model family: what a step of the model computes, built by moestream from the
weights transformers loaded (like llama.cpp's `src/models/` and mlx-lm's `models/`).

- `spec.py`: a model's `ModelSpec` (each layer's weights and hyperparameters), read through the family
  registered for its model_type (`family.py`); `parts.py` the pieces every reader shares.
- one module per family (`qwen3_moe.py`, `qwen2_moe.py`, `olmoe.py`, `mixtral.py`, `glm4_moe.py`,
  `gpt_oss.py`, `qwen3_next.py`, `qwen3_5_moe.py`, `deepseek.py`): its readers, and the graph of any
  layer kind of its own (a Gated DeltaNet, DeepSeek's latent attention).
- the builders every family shares: `layers.py` (a decoder layer, a whole step, the head),
  `attention.py` (standard attention), `moe.py` (router, shared expert, cached experts, their sum),
  `graph_set.py` (the graphs and buffers of one step shape).

The runner that computes with them is the engine's (`engine/ggml_runner.py`). Importing this package
registers every family.
"""

from moestream.graphs import (  # noqa: F401  (each module registers its family)
    deepseek,
    glm4_moe,
    gpt_oss,
    mixtral,
    olmoe,
    qwen2_moe,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from moestream.graphs.family import family_names
from moestream.graphs.parts import NoGraph
from moestream.graphs.spec import ModelSpec, config_no_graph, graph_spec

GRAPH_FAMILIES = family_names()  # the model types with a graph (their own names; aliases aside)

__all__ = ["GRAPH_FAMILIES", "ModelSpec", "NoGraph", "config_no_graph", "graph_spec"]
