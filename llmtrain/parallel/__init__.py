"""Everything that knows about ranks: the layout, process groups, the expert-parallel
dispatcher, and (in engine.py, the only importer of deepspeed) the DeepSpeed engine."""

from llmtrain.parallel.layout import Layout, make_layout

__all__ = ["Layout", "make_layout"]
