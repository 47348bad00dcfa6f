"""Documents -> rows of max_seq_length: nothing lost, nothing reordered, no label across a document boundary."""

from __future__ import annotations

from tunebook.data import IGNORE_INDEX, chunk_documents


def test_rows_are_full_and_keep_every_token_in_order():
    docs = [list(range(100, 107)), list(range(200, 203)), list(range(300, 311)), [400]]
    rows = list(chunk_documents(iter(docs), 8))
    assert [len(r["input_ids"]) for r in rows] == [8, 8, 6]  # 22 tokens: full rows, the remainder last
    assert [t for r in rows for t in r["input_ids"]] == [t for d in docs for t in d]
    # Pieces: doc 0 (7) | doc 1 (1) + ... a document cut at a row end continues at the next row's start.
    assert [r["seq_lengths"] for r in rows] == [[7, 1], [2, 6], [5, 1]]
    for r in rows:
        start = 0
        for n in r["seq_lengths"]:
            # The first token of every piece has no label: nothing of its document precedes it in the row.
            assert r["labels"][start] == IGNORE_INDEX
            assert r["labels"][start + 1 : start + n] == r["input_ids"][start + 1 : start + n]
            start += n
        assert start == len(r["input_ids"])


def test_no_documents_no_rows():
    assert list(chunk_documents(iter([]), 8)) == []
