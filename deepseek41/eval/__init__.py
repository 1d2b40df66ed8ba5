"""Long-context evaluation of any checkpoint: `python -m deepseek41.eval` (README, "Long-context
evaluation").

    restore.py   a checkpoint (pretraining, DSpark stage, HF import) restored for evaluation
    run.py       held-out loss per source; the tasks' accuracy per task, length and depth,
                 teacher-forced (train/evaluation.py, as the trainer's train.eval_tasks) and
                 optionally decoded through generation; for a CSA2 model the selection against
                 dense attention at the answers (model/diagnostics.py)
    report.py    the table, the JSON file, the depth x length heat map
    __main__.py  the command line
"""
