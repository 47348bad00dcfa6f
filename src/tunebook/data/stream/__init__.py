"""Streamed training data: sources read shard by shard, tokenised and packed on the fly in the loader's workers, at
a position every checkpoint saves and a resumed run continues from exactly.

A streamed run has G = processes x max(workers, 1) readers. Reader g reads `split_dataset_by_node(mixture, g, G)`:
whole shards (files) when G divides their number, else every G-th row (then every reader reads every file: give a
corpus a multiple of G files). A reader takes `group` rows at a time and turns each group into training rows
(pretrain: documents cut into rows of `max_seq_length`, the unfinished row carried into the next group; sft:
examples, or rows packed best-fit within the group, `packing_buffer_size`). It loops over epochs itself, so the
stream never ends and the row in flight at an epoch's end is finished with the next epoch's documents.

A reader's position is where its current group starts (the Hugging Face stream's own `state_dict`, exact at a batch
boundary), the row carried into the group, and how many of the group's rows were delivered. A resumed reader reads
that one group again and skips what was delivered: a few KB of state, where the packing buffer itself would be
megabytes to ship from a worker with every batch. The stream's shuffle buffer is not used: datasets does not restore
its contents on resume (its `state_dict` documentation says so), and a resumed run would train on other rows.

Each worker puts its position on every batch it makes; `StreamLoader` keeps the latest position of each worker as
the loop takes batches, so a checkpoint holds the position of what was trained on, not of what was prefetched.
torch's loader takes batches from workers 0, 1, ..., W-1 in turn and a new loader starts again at worker 0, so after
n batches worker j plays the part (reader and position) of worker (j + n) mod W and the order goes on unchanged.
torchdata's `StatefulDataLoader` keeps the same books; it is not a dependency of Tunebook.

Modules: `mixture` (the sources opened and interleaved), `rows` (groups -> training rows, a reader's position),
`token_stream` (the `IterableDataset` the workers read), `loader` (`StreamLoader`), `prepared` (prepared shards).
"""

from .loader import EXAMPLE_COUNTS, StreamLoader
from .mixture import Mixture, is_streamed, source_names, stream_fingerprint
from .prepared import prepared_meta, prepared_tokenizer, write_prepared_shards
from .rows import ChatRows, TextRows, reader_rows
from .token_stream import TokenStream, process_position

__all__ = [
    "EXAMPLE_COUNTS",
    "ChatRows",
    "Mixture",
    "StreamLoader",
    "TextRows",
    "TokenStream",
    "is_streamed",
    "prepared_meta",
    "prepared_tokenizer",
    "process_position",
    "reader_rows",
    "source_names",
    "stream_fingerprint",
    "write_prepared_shards",
]
