"""Scaling laws: compute-optimal allocation, fits from many small runs (Approaches 1-3 of
Hoffmann et al. 2022), bootstrap intervals, plots, and IsoFLOP sweeps. No torch.distributed."""

from llmtrain.scaling.laws import BUILTIN_LAWS, Law, load_law

__all__ = ["BUILTIN_LAWS", "Law", "load_law"]
