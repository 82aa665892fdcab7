"""Integrations with the world outside the harness: lm-eval's CLI, the embedded model assets, a ready server."""
