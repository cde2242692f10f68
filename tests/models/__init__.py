"""Tests of the reference models: AmoebaNet-D, the Transformer and its decoding."""
