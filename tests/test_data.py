import json

import numpy as np
import pytest
import torch

from llmtrain.config import DataConfig
from llmtrain.data.corpus import DataError, iter_documents
from llmtrain.data.loader import (
    PackedDataset,
    batches_for_step,
    document_mask,
    global_sample_indices,
)
from llmtrain.data.prepare import prepare_data


def _cfg(tmp_path, sources, **kw):
    return DataConfig(
        sources=[str(s) for s in sources], cache_dir=str(tmp_path / "cache"), val_percent=20.0, **kw
    )


def test_txt_jsonl_parquet_sources(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n")
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"text": "first doc"}) + "\n\n" + json.dumps({"text": "second"}) + "\n"
    )
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["p1", "p2", ""]}), tmp_path / "c.parquet")
    docs = list(iter_documents([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]))
    assert [t for _, t in docs] == ["hello world\n", "first doc", "second"]
    assert [t for _, t in iter_documents([str(tmp_path / "c.parquet")], text_field="content")] == [
        "p1",
        "p2",
    ]
    with pytest.raises(DataError, match="no field 'body'"):
        list(iter_documents([str(tmp_path / "b.jsonl")], text_field="body"))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(DataError, match="bad.jsonl:1"):
        list(iter_documents([str(tmp_path / "bad.jsonl")]))


def test_prepare_packs_with_eos_and_caches(tmp_path):
    src = tmp_path / "docs"
    src.mkdir()
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    for i in range(40):
        (src / f"{i:02d}.txt").write_text(" ".join(rng.choice(words, 200)))
    cfg = _cfg(tmp_path, [src])
    d = prepare_data(cfg, vocab_size=300)
    assert prepare_data(cfg, vocab_size=300) == d  # cached by content
    idx = json.loads((d / "index.json").read_text())
    assert idx["splits"]["train"]["docs"] + idx["splits"]["val"]["docs"] == 40
    ds = PackedDataset(d, "train", 32)
    stream = ds._range(0, ds.n_tokens)
    assert (stream == ds.eos_id).sum() == idx["splits"]["train"]["docs"]
    x, y = ds.batch([0, 1])
    assert torch.equal(x[0, 1:], y[0, :-1]) and x.dtype == torch.int64
    assert torch.equal(y[0, -1], x[1, 0])  # sequences tile the stream
    assert 0 < ds.unigram_entropy() < np.log(300)
    with pytest.raises(DataError, match="model.vocab_size"):
        prepare_data(_cfg(tmp_path, [src], tokenizer=str(d)), vocab_size=100)


def test_step_tokens_independent_of_world_size():
    class DS:
        n_seq = 1000

    for step in (0, 7, 124):  # 124 crosses into the second epoch
        one = np.concatenate(batches_for_step(DS, step, 8, 0, 1, 4, seed=3))
        two = np.concatenate(
            [np.concatenate(batches_for_step(DS, step, 8, r, 2, 2, seed=3)) for r in range(2)]
        )
        assert np.array_equal(one, two)
    first_epoch = np.concatenate([global_sample_indices(1000, s, 8, 3) for s in range(125)])
    assert sorted(first_epoch.tolist()) == list(range(1000))  # each sequence once per epoch


def test_document_mask():
    ids = torch.tensor([[5, 6, 0, 7, 8, 0, 9]])  # eos = 0
    m = document_mask(ids, 0)[0, 0]
    assert m[1, 0] and m[2, 0]  # EOS belongs to its document
    assert not m[3, 2] and m[4, 3] and not m[6, 4]
    assert not m[0, 1]  # causal


def test_unigram_entropy_estimate_is_close(tmp_path):
    src = tmp_path / "docs"
    src.mkdir()
    rng = np.random.default_rng(1)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    for i in range(20):
        (src / f"{i:02d}.txt").write_text(" ".join(rng.choice(words, 300)))
    ds = PackedDataset(prepare_data(_cfg(tmp_path, [src]), vocab_size=300), "train", 32)
    exact = ds.unigram_entropy()
    assert ds.unigram_entropy(max_tokens=ds.n_tokens // 4) == pytest.approx(exact, rel=0.05)
