"""A task family written only against tasks/base.py: repeat a number stated in the prompt (the answer is the number)."""
from __future__ import annotations

import random
from dataclasses import dataclass

from tasks.base import Sample, Task


class RepeatNumber(Task):
    @dataclass
    class Params:
        samples: int = 3
        max_new_tokens: int = 4

    def build_samples(self, tokenizer) -> list[Sample]:
        rng = random.Random(self.seed)
        out = []
        for i in range(self.params.samples):
            number = str(rng.randrange(1000, 9999))
            out.append(Sample(id=f"n{i}", context=f"The number is {number}. ", question="Repeat the number.",
                              answers=(number,), max_new_tokens=self.params.max_new_tokens))
        return out

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        return {"score": 100.0 if sample.answers[0] in prediction else 0.0}


TASK = RepeatNumber
