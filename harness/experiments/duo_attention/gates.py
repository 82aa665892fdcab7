"""DuoAttention gate training: multi-passkey samples, teacher and gated student forwards, schedule and training loop."""
from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from systems.engine.models.llama import LlamaModel

NATO = ("alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november oscar papa quebec "
        "romeo sierra tango uniform victor whiskey xray yankee zulu").split()
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth"]
NEEDLE = "Remeber this sequence of words, it's the {ordinal} passkey to the vault: "
QUESTION = "Based on the content of the book, what is the {ordinal} passkey to the vault?\nPasskey: "
PROMPT1, PROMPT2 = "<|im_start|> This is a very long story book: <book> ", " </book>.\n\n"


def sample_ids(tokenizer: Any, haystack: list[int], length: int, p: dict, rng: random.Random
               ) -> tuple[list[int], slice]:
    """One multi-passkey sample: token ids and the slice of the QA block (the loss span)."""
    keys = [" ".join(rng.choice(NATO) for _ in range(p["passkey_words"])) for _ in range(p["passkeys"])]
    depths = sorted(rng.sample([0.05 + 0.9 * i / 999 for i in range(1000)], p["passkeys"]))
    context = haystack[:length]
    for k in reversed(range(p["passkeys"])):          # deepest first: the shallower offsets stay valid
        at = int(length * depths[k])                  # a position in the haystack itself
        needle = tokenizer.encode("\n\n" + NEEDLE.format(ordinal=ORDINALS[k]) + keys[k] + "\n\n",
                                  add_special_tokens=False)
        context = context[:at] + needle + context[at:]
    head = tokenizer.encode(PROMPT1, add_special_tokens=True) + context
    head += tokenizer.encode(PROMPT2, add_special_tokens=False)
    qa = tokenizer.encode("".join(QUESTION.format(ordinal=ORDINALS[k]) + keys[k] + "\n\n"
                                  for k in range(p["passkeys"])), add_special_tokens=False)
    return head + qa, slice(len(head), len(head) + len(qa))


def streaming_mask(n: int, sink: int, recent: int) -> torch.Tensor:
    """Token-exact streaming attention (DuoAttention's sdpa path): key j visible to query i iff j <= i and
    (j < sink or i - j < recent)."""
    i = torch.arange(n).view(-1, 1)
    j = torch.arange(n).view(1, -1)
    return (j <= i) & ((j < sink) | (i - j < recent))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              mask: torch.Tensor | None) -> torch.Tensor:
    """q [n, Hq, D], k/v [n, Hkv, D] -> [n, Hq, D]; causal when mask is None (GQA stays grouped)."""
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def teacher(model: LlamaModel, ids: torch.Tensor, scale: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The full-attention outputs of every layer (pre-o_proj) and the final hidden states."""
    outs: list[torch.Tensor] = []

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o = attention(q, k, v, scale, None)
        outs.append(o.detach())
        return o
    with torch.no_grad():
        hidden = model.forward(ids, torch.arange(len(ids)), attend)
    return outs, hidden.detach()


def student(model: LlamaModel, ids: torch.Tensor, gates: torch.Tensor, full: list[torch.Tensor], mask: torch.Tensor,
            scale: float, group: int) -> torch.Tensor:
    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        stream = attention(q, k, v, scale, mask)
        alpha = gates[layer].clamp(0, 1).repeat_interleave(group).view(1, -1, 1)       # a KV head's gate, per group
        return (1 - alpha) * stream + alpha * full[layer]
    return model.forward(ids, torch.arange(len(ids)), attend)


def lr_factor(step: int, total: int) -> float:
    ramp = max(1, total // 5)
    return min(1.0, max((step + 1) / ramp, 0.1), max((total - step) / ramp, 0.1))


def build_pool(model: LlamaModel, tokenizer: Any, haystack: list[int], lengths: list[int], p: dict,
               rng: random.Random) -> list[tuple]:
    """The fixed sample pool, teacher states computed once: per sample its ids, loss span, per-layer full-attention
    outputs, final hidden states over the span and streaming mask."""
    scale = model.spec.head_dim ** -0.5
    pool = []
    for i in range(p["pool"]):
        ids, span = sample_ids(tokenizer, haystack, lengths[i % len(lengths)], p, rng)
        x = torch.tensor(ids)
        full, final = teacher(model, x, scale)
        pool.append((x, span, full, final[span], streaming_mask(len(ids), p["sink_tokens"], p["recent_tokens"])))
    return pool


def train_gates(model: LlamaModel, pool: list[tuple], p: dict, rng: random.Random,
                on_step: Callable[[dict], None] | None = None) -> tuple[torch.Tensor, list[dict]]:
    """Train one gate per (layer, KV head) on the pool; returns the clamped gates and the per-step history.
    `on_step` gets each step's history entry as it ends (progress: a CPU run takes hours)."""
    spec = model.spec
    scale = spec.head_dim ** -0.5
    group = spec.num_q_heads // spec.num_kv_heads
    gates = torch.nn.Parameter(torch.ones(spec.num_layers, spec.num_kv_heads))
    optimizer = torch.optim.AdamW([gates], lr=p["lr"], weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, p["steps"]))
    history: list[dict] = []
    order: list[int] = []
    for step in range(p["steps"]):
        if not order:
            order = list(range(len(pool)))
            rng.shuffle(order)
        x, span, full, target, mask = pool[order.pop()]
        with torch.no_grad():
            gates.clamp_(0, 1)
        hidden = student(model, x, gates, full, mask, scale, group)[span]
        distill = (hidden - target).pow(2).mean(-1).mean()
        loss = distill + p["reg_weight"] * gates.clamp(0, 1).abs().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        history.append({"step": step, "distill": float(distill.detach()),
                        "mean_gate": float(gates.detach().clamp(0, 1).mean())})
        if on_step is not None:
            on_step(history[-1])
    with torch.no_grad():
        gates.clamp_(0, 1)
    return gates.detach(), history
