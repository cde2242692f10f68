"""Tests of GPipeStrategy: the same run as a plain Trainer for every layout, habit and Lightning feature."""
