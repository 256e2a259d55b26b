"""llmtrain: pre-training DeepSeek-style MoE language models."""

from llmtrain.config import Config, ConfigError, ModelConfig, load_config
from llmtrain.errors import LlmtrainError

__version__ = "0.1.0"
__all__ = [
    "Config",
    "ConfigError",
    "LlmtrainError",
    "ModelConfig",
    "load_config",
    "from_pretrained",
]


def __getattr__(name: str):
    # torch-heavy entry points load lazily so `llmtrain scaling ...` starts fast.
    if name == "from_pretrained":
        from llmtrain.hf import from_pretrained

        return from_pretrained
    raise AttributeError(name)
