"""The eval command's progress lines (eval/report.py `progress_lines`): one per finished task
cell, numbered against the cells due, decoded cells after teacher-forced ones."""

from deepseek41.eval.report import progress_lines


def _cell(label, depth, correct, answers):
  return {'label': label, 'depth': depth, 'acc': correct / answers, 'correct': correct,
          'answers': answers}


def test_a_line_for_each_new_cell_and_the_time_on_the_last():
  report = {'cells': 6, 'tasks': [_cell('mqar@4k', None, 36, 384),
                                  _cell('passkey@4k', 0.5, 1, 6),
                                  _cell('passkey@4k', 1.0, 0, 6)],
            'generated': [_cell('mqar@4k', None, 30, 384)]}
  assert progress_lines(report, 1, 12.34) == [
      '[2/6] passkey@4k depth 0.5: acc 0.167 (1 of 6)',
      '[3/6] passkey@4k depth 1: acc 0.000 (0 of 6)',
      '[4/6] decoded mqar@4k: acc 0.078 (30 of 384), 12.3 s']
  assert progress_lines(report, 4, 1.0) == []
