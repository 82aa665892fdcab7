"""kvharness's paged, tiered inference engine (nano-vllm sized): model, KV storage, scheduler, policy hooks."""
