"""Model definitions the engine can run."""
