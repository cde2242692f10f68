"""Tests of the engine (lightning_gpipe.pipe): parity with the plain model, failures, transport, partition."""
