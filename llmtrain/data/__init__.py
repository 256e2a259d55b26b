"""Text in, token shards out, packed fixed-length batches back: corpus, tokenizer, shards, loader.

Exports load lazily: data preparation (and its worker processes) never imports torch."""

__all__ = ["PackedDataset", "batches_for_step", "prepare_data"]


def __getattr__(name: str):
    if name in ("PackedDataset", "batches_for_step"):
        from llmtrain.data import loader

        return getattr(loader, name)
    if name == "prepare_data":
        from llmtrain.data.prepare import prepare_data

        return prepare_data
    raise AttributeError(name)
