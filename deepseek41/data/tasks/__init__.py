"""Synthetic long-context tasks: retrieval documents generated from a seed, no files to download.

    text.py        task documents with their answers marked; text through the run's tokenizer;
                   the filler (repeated sentences, or real text from a prepared dataset)
    retrieval.py   mqar, passkey, needle

The data pipeline reads a task like any source when data.sources names it (`mqar:0.5,
default:0.5`; data/pipeline.py `TaskSource`), and evaluation generates held-out documents of
a task at a context length and depth (train/evaluation.py, `python -m deepseek41.eval`).
"""

from __future__ import annotations

import numpy as np

from deepseek41.config import TASK_NAMES, TasksConfig
from deepseek41.data.shards import DataError
from deepseek41.data.tasks.retrieval import Mqar, Needle, Passkey
from deepseek41.data.tasks.text import (Answer, CorpusFiller, Hidden, TaskDocument, TaskText,
                                        assemble)
from deepseek41.data.tokenizer import Tokenizer

Task = Mqar | Passkey | Needle

__all__ = ['Answer', 'CorpusFiller', 'Hidden', 'Mqar', 'Needle', 'Passkey', 'Task', 'TaskDocument',
           'TaskText', 'assemble', 'build_task', 'held_out_documents']


def build_task(name: str, tk: TasksConfig, tokenizer: Tokenizer,
               filler_dir: str | None = None) -> Task:
  """The task `name` with the tasks section's parameters, encoding with `tokenizer`; the needle
  task hides its needles in the text of `filler_dir` (a prepared dataset's split directory)."""
  text = TaskText(tokenizer)
  if name == 'mqar':
    return Mqar(text, tk.mqar_pairs, tk.mqar_queries, tk.mqar_key_letters, tk.mqar_value_digits)
  if name == 'passkey':
    return Passkey(text, tk.passkey_digits)
  if name == 'needle':
    if filler_dir is None:
      raise DataError('the needle task needs filler text (tasks.needle_filler)')
    return Needle(text, CorpusFiller(filler_dir, text, 'tasks.needle_filler'), tk.needle_count,
                  tk.needle_queries, tk.needle_value_digits)
  raise DataError(f'unknown task {name!r}')


def held_out_documents(task: Task, length: int, depth: float | None,
                       count: int) -> list[TaskDocument]:
  """`count` evaluation documents of `task` at `length` and `depth`: the same for every run and
  checkpoint (seeded by task, length and depth only), so variants are scored on one set. Open
  the task on the held-out split (its filler text)."""
  seed = [0xE7A1, TASK_NAMES.index(task.name), length,
          0 if depth is None else 1 + int(round(depth * 1e6))]
  return [task.document(np.random.default_rng(seed + [i]), length, depth) for i in range(count)]
