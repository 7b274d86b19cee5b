"""Data side: packing documents into rows and cutting rows into per-rank batches with their context.

``PackedDataset`` (stream of examples -> packed rows) -> ``PackingCollator`` (rows -> this rank's
batch dict with a ``BlockDiagCPContext``); ``from_flattened`` converts HF's own flattened batches.
"""

from .collator import PackingCollator
from .dataset import PackedDataset
from .examples import Document, read_example
from .flattened import from_flattened
from .packing import OVERFLOW_MODES, Piece, best_fit_decreasing, split_overflow
from .rows import FullRows, PackedRow, assemble_rows, shift_row_labels
from .sharding import rank_batch, resolve_cp
from .windows import sliding_windows

__all__ = [
    "Document",
    "FullRows",
    "OVERFLOW_MODES",
    "PackedDataset",
    "PackedRow",
    "PackingCollator",
    "Piece",
    "assemble_rows",
    "best_fit_decreasing",
    "from_flattened",
    "rank_batch",
    "read_example",
    "resolve_cp",
    "shift_row_labels",
    "sliding_windows",
    "split_overflow",
]
