"""The translation example's data: a generated multilingual corpus, a BPE vocabulary, length-bucketed batches."""
