"""decode_roofline's split: counting the KV bytes a layer read is the benchmark's work, not the step's."""
import time
from types import SimpleNamespace

from harness.experiments.decode_roofline import bench
from systems.engine.engine import Engine
from systems.policies import load_policy

PAUSE_S = 0.02


def test_byte_counting_is_outside_the_timed_phases(tiny_llama_dir, monkeypatch):
    cfg = SimpleNamespace(page_size=16, device_memory_gb=0.05, host_memory_gb=0.01, max_num_seqs=2,
                          max_num_batched_tokens=256)
    engine = Engine(str(tiny_llama_dir), load_policy("dense", {}), cfg, dtype="float32")
    count = bench.kv_bytes_read

    def slow_count(*args):
        time.sleep(PAUSE_S)
        return count(*args)

    monkeypatch.setattr(bench, "kv_bytes_read", slow_count)
    row = bench.measure(engine, batch=1, context=32, steps=1, split_steps=1, warmup=0, noise=0.1, seed=0)
    layers = engine.model.spec.num_layers
    assert row["kv_bytes"] > 0
    # each layer's count sleeps PAUSE_S: were it timed, the split step would exceed layers x PAUSE_S
    assert row["split_step_ms"] < 1e3 * PAUSE_S * layers / 2
    assert row["attention_ms"] + row["select_ms"] < 1e3 * PAUSE_S / 2
