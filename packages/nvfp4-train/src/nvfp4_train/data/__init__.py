"""The data pipeline: corpora, tokenizers, packing, and grain iterators for training.

`make_datasets(DataConfig(...), seq_len=..., batch_size=..., seed=...)` returns `Datasets` with
`vocab_size`, `tokenizer`, `train_iterator()` (infinite, shuffled, resumable grain iterator) and
`validation_batches()` (fixed). Batches are `{"inputs": int32[B, L], "targets": int32[B, L]}`,
plus `segment_ids` and `positions` (int32[B, L]) when documents are masked (`data.document_mask`).
See docs/data.md for the `data:` config section.
"""

from nvfp4_train.data.builtin_text import kjv_chapters
from nvfp4_train.data.config import DataConfig, MixtureSource
from nvfp4_train.data.mixture import MixedSequences
from nvfp4_train.data.packing import PackedSequences
from nvfp4_train.data.pipeline import Batch, Datasets, make_datasets
from nvfp4_train.data.prepare import prepare_corpus
from nvfp4_train.data.prepared import open_prepared
from nvfp4_train.data.tokenization import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    id_tokenizer,
    load_tokenizer,
    train_bpe,
)
from nvfp4_train.errors import DataError

__all__ = [
    "Batch",
    "ByteTokenizer",
    "DataError",
    "DataConfig",
    "Datasets",
    "HFTokenizer",
    "MixedSequences",
    "MixtureSource",
    "PackedSequences",
    "Tokenizer",
    "id_tokenizer",
    "kjv_chapters",
    "load_tokenizer",
    "make_datasets",
    "open_prepared",
    "prepare_corpus",
    "train_bpe",
]
