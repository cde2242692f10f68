"""The examples: ``python -m examples.nmt`` and ``python -m examples.amoebanet``, run from the repository root."""
