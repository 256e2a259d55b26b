"""Datasets of the shipped offline tasks, read from the JSONL files next to this module (so the
task YAMLs work from any working directory and without a network)."""

from pathlib import Path

import datasets

HERE = Path(__file__).parent


def _load(name: str) -> datasets.DatasetDict:
    return datasets.DatasetDict(
        {"test": datasets.load_dataset("json", data_files=str(HERE / name), split="train")}
    )


def ppl_dataset(**kwargs) -> datasets.DatasetDict:
    return _load("ppl.jsonl")


def mc_dataset(**kwargs) -> datasets.DatasetDict:
    return _load("mc.jsonl")
