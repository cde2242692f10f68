"""Tests of the examples: their data, their LightningModules and every config."""
