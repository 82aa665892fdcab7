"""L-Eval (OpenLMLab/LEval): closed tasks with exam scoring, open tasks with F1 or ROUGE, upstream prompts.

Follows the baseline scripts (Baselines/*-test.py, LEval_config.py) and Evaluation/auto_eval.py: per-task
system prompts, the document cut from the right by words until it fits `max_length - max_new_tokens`
tokens (codeU keeps the last words), "Answer this question with N words." on open tasks, documents
marked human/LLM dropped, and each closed task's answer extraction before exact match. sci_fi asks
every question twice, as upstream: once on the document (loyalty) and once without it (fact, no
chat template); both count. Deviation: the exam prompt's trailing "\\nAnswer:", which upstream puts
after [/INST], ends the user text here (the harness owns the chat template).
"""
from __future__ import annotations

import logging
import math
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from tasks import haystack, metrics, sources
from tasks.base import Sample, Task, TaskError, split_at

log = logging.getLogger(__name__)
CLOSED = ["coursera", "gsm100", "quality", "tpo", "topic_retrieval_longchat", "sci_fi", "codeU"]
OPEN_F1 = ["financial_qa", "legal_contract_qa", "multidoc_qa", "narrative_qa", "natural_question", "scientific_qa"]
OPEN_ROUGE = ["gov_report_summ", "meeting_summ", "news_summ", "paper_assistant", "patent_summ", "review_summ",
              "tv_show_summ"]
GROUPS = {"closed": CLOSED, "open_f1": OPEN_F1, "open_rouge": OPEN_ROUGE, "open": OPEN_F1 + OPEN_ROUGE}
WITH_OPTIONS = ("coursera", "quality", "tpo")
SCORED = ("exam", "f1", "rouge")          # the n-gram path drops documents judged by humans or an LLM

SYSTEM_PROMPTS = {
    "gsm100": "Given several question answer pairs, you need to follow a similar format to answer the last "
              "question. Make sure the response is end with The answer is _ . ",
    "topic_retrieval_longchat": "Below is a record of our previous conversation on many different topics. You "
              "are the ASSISTANT, and I am the USER. At the beginning of each topic, the USER will say 'I would "
              "like to discuss the topic of <TOPIC>'. Memorize each <TOPIC>. At the end of the record, I will ask "
              "you to retrieve the first/second/third topic names. Now the record start. ",
    "coursera": "Now you are given a very long document. Please follow the instruction based on this document. "
                "For multi-choice questions, there could be a sinlge correct option or multiple correct options. "
                "Please only provide the letter corresponding to the answer (like A or AB) when answering. ",
    "codeU": "Now you are given a code base consisting of a large amount of functions and the corresponding "
             "comments. In the end, I will call some functions defined in the code base. Please carefully read "
             "these codes and comments and answer the question.",
    "sci_fi": "Now you are given a scientific fiction. I will ask you some questions and the answer should be "
              "\"True\" or \"False\". Notice that you should answer the question based on the evidence in the "
              "document instead of your background knowledge.",
}
EXAM_SYSTEM = ("Now you are given a very long document. Please follow the instruction based on this document. For "
               "multi-choice questions, there is only a sinlge correct option. Please only provide the letter "
               "corresponding to the answer (like A or B) when answering. For other questions, please directly "
               "give the concise and accurate answer. ")
OPEN_SYSTEM = ("Now you are given a very long document. Please follow the instruction after this document. These "
               "instructions may include summarizing a document, answering questions based on the document, or "
               "writing a required paragraph. ")
EXAM_USER = ("Document is as follows. {document} \nQuestion: {inst}.  Please directly give answer without any "
             "additonal output or explanation \nAnswer:")
OPEN_USER = "Document is as follows. {document} Instruction: {inst} "
SCI_FI_WORLD = "based on the world described in the document."
SCI_FI_REAL = "based on the real-world knowledge and facts up until your last training"


# -- upstream answer extraction (Evaluation/auto_eval.py) ------------------------------------------
def options_of_output(response: str, several: bool) -> str:
    """Option letters in an output (upstream `process_output_mc`, HEAD): a blank output is "None" (scores 0); a
    non-coursera task takes the first A-D letter; coursera (`several`) takes a leading run of letters, else every
    option-like capital before "Question", else the first run of A-D letters; the last resort is "A"."""
    if not response.strip():
        return "None"
    if response in "ABCD":
        return response
    if not several:
        letter = next((ch for ch in response if ch in "ABCD"), None)
        if letter:
            return letter
    lead = len(response) - len(response.lstrip("ABCD"))
    picked, rest = response[:lead], response[lead:]
    if len(picked) > 1:
        return "".join(sorted(set(picked)))
    rest = rest.split("Question")[0]
    found = re.findall(r"\s*[A-Z](?=[\s.)])", rest)
    letters = "".join(sorted(set(re.sub(r"[^A-D]", "", picked + " ".join(found).strip()))))
    if not letters:
        first_run = re.search(r"[A-D]+", rest)
        letters = first_run.group(0) if first_run else ""
    return letters or "A"


def options_of_gold(gold: str) -> str:
    return re.sub(r"[^A-D]", "", gold.split()[0]) or "A"


def math_answer(text: str) -> str:
    """Digits of the token after "The answer is", else of the last token with a digit (first paragraph)."""
    match = re.search(r"The answer is (\S+)", text)
    if match:
        token = match.group(1)
    else:
        words = text.split("\n\n")[0].split(" ")[::-1]
        token = next((w for w in words if any(ch.isdigit() for ch in w)), "")
    digits = ""
    for ch in token:
        if ch.isdigit():
            digits += ch
        if ch == ".":
            break
    return digits


def code_gold(text: str) -> str:
    text = re.sub(r"\s+", " ", text)
    for old, new in ((",", ""), ("'", ""), ("\\", ""), (".0", ""), ("] [", "]["), ("[ [", "[["), ("] ]", "]]")):
        text = text.replace(old, new)
    return text


def code_output(response: str, gold: str) -> str:
    """The output's tail (or what follows "the final output"), as long as the gold plus three words."""
    keep = len(gold.split()) + 3
    response = code_gold(response)
    for filler in ("will be", "of the code", "is", "would be", "the value of", "the result of", "printed"):
        response = response.replace(filler, "")
    if "the final output" in response:
        return " ".join(re.split(r"\s+", response.split("the final output")[-1])[:keep])
    return " ".join(re.split(r"\s+", response)[-keep:])


def judge_word(text: str) -> str:
    """sci_fi: the first word containing "true" or "false", else "<error>"."""
    for word in text.lower().split():
        if "true" in word:
            return "true"
        if "false" in word:
            return "false"
    return "<error>"


def judge_gold(gold: str) -> tuple[str, str]:
    loyalty, fact = gold.lower().split("[fact:")
    return loyalty.strip(), fact[:-1].strip()


def right_truncate(tokenizer: Any, document: str, max_tokens: int, keep_tail: bool) -> str:
    """L-Eval's cut: keep max_tokens - cnt space-separated words, cnt += 250, until the tokens fit."""
    cnt = 0
    while haystack.count_tokens(tokenizer, document) > max_tokens:
        words = document.split(" ")
        document = " ".join(words[cnt - max_tokens:] if keep_tail else words[:max_tokens - cnt])
        cnt += 250
    return document


class LEval(Task):
    unit_key = "task"

    @dataclass
    class Params:
        tasks: list[str] = field(default_factory=lambda: ["closed"])   # names or groups closed/open_f1/...
        max_length: int = 7500              # upstream --max_length; documents get max_length - max_new_tokens
        max_new_tokens: int = 512
        length_instruction: bool = True     # "Answer this question with N words." on open tasks
        data_dir: str | None = None         # folder of LEval-data jsonl (<task>.jsonl, or the upstream subfolders)
        hub_repo: str = "L4NLP/LEval"
        hub_revision: str | None = "refs/convert/parquet"   # parquet branch: the loading script needs datasets<4
        hub_timeout_s: float = 5.0
        on_malformed: str = "skip"          # skip | fail
        questions_per_context: Optional[int] = None   # instructions asked per document (k); null = all of them

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        p = self.params
        self.tasks: list[str] = []
        for name in p.tasks:
            for t in GROUPS.get(name, [name]):
                if t not in CLOSED + OPEN_F1 + OPEN_ROUGE:
                    raise TaskError(f"unknown L-Eval task {t!r} in task.params.tasks; valid: "
                                    f"{CLOSED + OPEN_F1 + OPEN_ROUGE} or a group {sorted(GROUPS)}")
                if t not in self.tasks:
                    self.tasks.append(t)
        if p.max_length <= p.max_new_tokens:
            raise TaskError(f"task.params.max_length ({p.max_length}) must exceed max_new_tokens "
                            f"({p.max_new_tokens})")
        if p.on_malformed not in ("skip", "fail"):
            raise TaskError(f"task.params.on_malformed must be 'skip' or 'fail', got {p.on_malformed!r}")

    def _rows(self, task: str) -> list[Any]:
        p, key = self.params, "task.params.data_dir"
        if not p.data_dir:
            return sources.hub_rows(p.hub_repo, task, "test", key, p.hub_timeout_s, revision=p.hub_revision)
        group = "Closed-ended-tasks" if task in CLOSED else "Open-ended-tasks"
        for name in (f"{task}.jsonl", f"{group}/{task}.jsonl", f"LEval-data/{group}/{task}.jsonl"):
            try:
                return sources.local_rows(p.data_dir, name, key)
            except TaskError:
                continue
        return sources.local_rows(p.data_dir, f"{task}.jsonl", key)      # raises, naming the simplest path

    @staticmethod
    def _problem(row: Any) -> str | None:
        if not isinstance(row, dict) or not isinstance(row.get("input"), str):
            return "'input' is not a string"
        inst, outs = row.get("instructions"), row.get("outputs")
        if not (isinstance(inst, list) and isinstance(outs, list) and len(inst) == len(outs) and inst
                and all(isinstance(x, str) for x in inst + outs)):
            return "'instructions'/'outputs' are not equal-length lists of strings"
        if not isinstance(row.get("evaluation"), str):
            return "'evaluation' is missing"
        return None

    def build_samples(self, tokenizer: Any) -> list[Sample]:
        out: list[Sample] = []
        budget = self.params.max_length - self.params.max_new_tokens
        for task in self.tasks:
            for d, row in enumerate(self._rows(task)):
                problem = self._problem(row)
                if problem is not None:
                    if self.params.on_malformed == "fail":
                        raise TaskError(f"L-Eval {task} document {d}: {problem}; fix the data or set "
                                        f"task.params.on_malformed=skip")
                    log.warning("L-Eval %s: skipped malformed document %d (%s)", task, d, problem)
                    continue
                if row["evaluation"] not in SCORED:
                    continue
                document = right_truncate(tokenizer, row["input"], budget, keep_tail=task == "codeU")
                for q, (inst, gold) in enumerate(zip(row["instructions"], row["outputs"])):
                    if self.params.questions_per_context is not None and q >= self.params.questions_per_context:
                        break
                    out += self._samples(task, f"{task}-{d}", q, document, inst, gold, row["evaluation"])
        return out

    def _samples(self, task: str, doc_id: str, q: int, document: str, inst: str, gold: Any,
                 evaluation: str) -> list[Sample]:
        """The samples of one instruction: the context is the document (with what precedes it), the question part
        the instruction and everything after it, so a document's instructions share one context."""
        sid = f"{doc_id}-{q}"
        meta = {"task": task, "evaluation": evaluation, "gold": gold, "context_id": doc_id, "question_index": q}
        if task in ("gsm100", "codeU", "topic_retrieval_longchat"):
            template, system = "{document}\n\n{inst}", SYSTEM_PROMPTS[task]
        elif task in CLOSED:
            template, system = EXAM_USER, SYSTEM_PROMPTS.get(task, EXAM_SYSTEM)
        else:
            template, system = OPEN_USER, OPEN_SYSTEM
            if self.params.length_instruction:
                template += f"\nAnswer this question with {len(gold.split())} words."
        context, question = split_at(template.format(document=document, inst=inst),
                                     template.split("{document}", 1)[1].format(inst=inst))
        common = dict(answers=(gold,), max_new_tokens=self.params.max_new_tokens)
        first = Sample(id=sid, context=context, question=question, system_prompt=system, truncation="middle",
                       meta={**meta, "part": "loyalty" if task == "sci_fi" else "main"}, **common)
        if task != "sci_fi":
            return [first]
        # the fact check asks without the document: nothing in it is shared
        fact_meta = {k: v for k, v in meta.items() if k not in ("context_id", "question_index")}
        fact = Sample(id=f"{sid}-fact", context="", question=inst.replace(SCI_FI_WORLD, SCI_FI_REAL) + "\nAnswer:",
                      chat_template=False, truncation="none", meta={**fact_meta, "part": "fact"}, **common)
        return [first, fact]

    # -- scoring ---------------------------------------------------------------------------------
    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        task, gold, evaluation = sample.meta["task"], sample.meta["gold"], sample.meta["evaluation"]
        if evaluation == "f1":
            return {"score": 100 * metrics.leval_f1(prediction, gold)}
        if evaluation == "rouge":
            r = metrics.leval_rouge_best(prediction, [gold])
            return {"score": metrics.geometric_mean_rouge(r["rouge1"], r["rouge2"], r["rougeL"]), **r}
        if task in WITH_OPTIONS:
            pred, ref = options_of_output(prediction, several=task == "coursera"), options_of_gold(gold)
        elif task == "gsm100":
            pred, ref = math_answer(prediction), math_answer(gold)
        elif task == "codeU":
            pred, ref = code_output(prediction, gold), code_gold(gold)
        elif task == "sci_fi":
            loyalty, fact = judge_gold(gold)
            pred, ref = judge_word(prediction), loyalty if sample.meta["part"] == "loyalty" else fact
        else:
            pred, ref = prediction, gold
        return {"score": 100 * metrics.leval_exam(pred, ref)}

    def summarize(self, rows: Sequence[dict]) -> dict[str, float]:
        """Per task: exam/F1 mean x100, or ROUGE-1/2/L means and their geometric mean; "score" = mean over tasks."""
        by_task: dict[str, list[dict]] = defaultdict(list)
        for row in rows:
            by_task[row["meta"]["task"]].append(row)
        out: dict[str, float] = {}
        for task, items in by_task.items():
            mean = {k: sum(r[k] for r in items) / len(items) for k in ("rouge1", "rouge2", "rougeL")
                    if all(k in r for r in items)}
            if len(mean) == 3:
                out.update({f"{task}_{k}": round(v, 4) for k, v in mean.items()})
                out[task] = round(metrics.geometric_mean_rouge(*mean.values()), 4)
            else:
                out[task] = round(sum(r["score"] for r in items) / len(items), 4)
        scores = [out[t] for t in by_task]
        out["score"] = sum(scores) / len(scores) if scores else math.nan
        out["n"] = len(rows)
        return out


TASK = LEval
