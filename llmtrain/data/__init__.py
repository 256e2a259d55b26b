"""Text in, token shards out, packed fixed-length batches back: corpus, tokenizer, shards, loader."""

from llmtrain.data.loader import PackedDataset, batches_for_step
from llmtrain.data.prepare import prepare_data

__all__ = ["PackedDataset", "batches_for_step", "prepare_data"]
