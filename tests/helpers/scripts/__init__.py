"""Entry points the tests start as processes (python -m tests.helpers.scripts.<name>)."""
