"""A tiny out-of-tree extension: one KV policy and one task family, found by kvharness through entry points only."""
