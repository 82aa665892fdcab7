"""Measuring: load generation, CPU accounting, teacher-forced fidelity, timed offline calls and the servers swept."""
