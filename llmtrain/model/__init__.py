"""Plain-torch model: no ranks, no deepspeed. Parallelism is handed in (see moe.LocalDispatcher)."""

from llmtrain.model.attention import MLACache
from llmtrain.model.generate import generate
from llmtrain.model.moe import LocalDispatcher
from llmtrain.model.transformer import ModelOutput, Transformer, build_model

__all__ = ["MLACache", "LocalDispatcher", "ModelOutput", "Transformer", "build_model", "generate"]
