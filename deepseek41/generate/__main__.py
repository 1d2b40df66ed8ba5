"""`python -m deepseek41.generate --workdir=DIR [--step=N] --prompt=TEXT | --prompts=FILE.jsonl
[--images=A.png,...] [--max_new_tokens=N] [--temperature=T] [--top_p=P] [--speculative]
[--prefill=auto|ced|full] [--tokens_per_dispatch=N] [--stream]`

Restores a checkpoint of a training run, tokenizes with the run's tokenizer, generates and
prints each completion with its tokens/s. --prompts reads one JSON object per line with a
"prompt" field (and optionally "images", paths relative to the file); all prompts go through as
one batch (different lengths are fine). Images take the places of the prompt's <image> markers.
--json prints one JSON object per prompt instead.

Plain decoding runs --tokens_per_dispatch steps on the device per round trip to the host;
speculative decoding runs draft-and-verify rounds there until a row could pass that many
tokens (1: a draft and a verification per round trip). With one --prompt (or --stream) the
text is printed as each dispatch completes it: one prompt's output is the same as without
streaming; several prompts' pieces come as `[row] "text"` lines (with --json, {"row": ...,
"text": ...} objects) before the usual output.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags, logging

from deepseek41.generate.generator import (PREFILL_CHUNK, TOKENS_PER_DISPATCH, GenerateError,
                                           Generator, execution_overrides)
from deepseek41.generate.prompts import IMAGE_MARKER, read_prompts, with_images

_WORKDIR = flags.DEFINE_string('workdir', None, 'Work directory of a training run.')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: the newest).')
_PROMPT = flags.DEFINE_string('prompt', None, 'One prompt.')
_PROMPTS = flags.DEFINE_string('prompts', None, 'A .jsonl file of {"prompt": ...} lines.')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 64, 'Tokens to generate per prompt at most.')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.0, '0 = greedy.')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Nucleus sampling mass.')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed.')
_SPECULATIVE = flags.DEFINE_bool('speculative', False,
                                 'Draft with DSpark and verify (a DSpark-stage checkpoint).')
_PREFILL = flags.DEFINE_enum('prefill', 'auto', ['auto', 'ced', 'full'],
                             'auto: CED where the model has an encoder/decoder split.')
_N_WIN = flags.DEFINE_integer('n_win', 0, 'CED decoder tail (0: the smallest exact one).')
_VERIFY_COST = flags.DEFINE_float(
    'verify_cost', None, 'Cost of one more verified position relative to a decode step '
    '(default: 0.05 with --tokens_per_dispatch=1; 0, admitting every draft, in the device loop, '
    'which verifies every draft in one shape).')
_TOKENS_PER_DISPATCH = flags.DEFINE_integer(
    'tokens_per_dispatch', TOKENS_PER_DISPATCH,
    'Plain decoding steps per dispatch to the device, speculative decoding tokens a row at '
    'most (1: a host round trip per step or per draft-and-verify round).')
_PREFILL_CHUNK = flags.DEFINE_integer(
    'prefill_chunk', PREFILL_CHUNK, 'Prompt positions per prefill dispatch: longer prompts '
    'prefill in chunks (memory of one chunk\'s activations); 0: the whole prompt at once. Image '
    'prompts prefill whole.')
_STREAM = flags.DEFINE_bool('stream', None, 'Print the text as it is generated (default: with '
                            'one --prompt and without --json).')
_JSON = flags.DEFINE_bool('json', False, 'One JSON object per prompt.')
_IMAGES = flags.DEFINE_list('images', [], 'Images of --prompt, in the order of its <image> '
                            'markers (without markers: before the text). Needs model.vision.')
_EXECUTION = flags.DEFINE_list(
    'execution', [], 'Execution-only model keys to override, KEY=VALUE,... (e.g. '
    'model.mhc_decode_block_d=256,model.moe_gather_small_calls=false): how the model is '
    'computed, never what.')


def shown_prompt(prompt) -> str:
  """A prompt as printed: its text, with image parts shown by their markers."""
  return prompt if isinstance(prompt, str) else \
      ''.join(p.get('text', IMAGE_MARKER) for p in prompt)


def stream_printer(inline: str | None, as_json: bool):
  """Prints each row's new text: after the prompt `inline` as it comes (one prompt, which is
  printed with the first piece: an error before it leaves the output empty), or one line per
  piece."""
  started = False

  def show(row: int, text: str):
    nonlocal started
    if inline is not None:
      print(('' if started else inline) + text, end='', flush=True)
      started = True
    elif not text:
      return
    elif as_json:
      print(json.dumps({'row': row, 'text': text}), flush=True)
    else:
      print(f'[{row}] {json.dumps(text, ensure_ascii=False)}', flush=True)
  return show


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # the checkpoint library's per-read lines
  try:
    if not _WORKDIR.value:
      raise GenerateError('--workdir is required')
    if (_PROMPT.value is None) == (_PROMPTS.value is None):
      raise GenerateError('give exactly one of --prompt and --prompts')
    prompts = [with_images(_PROMPT.value, _IMAGES.value, '--prompt')] \
        if _PROMPT.value is not None else read_prompts(_PROMPTS.value)
    gen = Generator(_WORKDIR.value, _STEP.value, execution_overrides(_EXECUTION.value))
    shown = [shown_prompt(p) for p in prompts]
    stream = _STREAM.value if _STREAM.value is not None else \
        _PROMPT.value is not None and not _JSON.value
    inline = stream and len(prompts) == 1 and not _JSON.value  # the usual output, piece by piece
    results = gen.generate(prompts, max_new_tokens=_MAX_NEW.value,
                           temperature=_TEMPERATURE.value, top_p=_TOP_P.value, seed=_SEED.value,
                           speculative=_SPECULATIVE.value, prefill=_PREFILL.value,
                           n_win=_N_WIN.value, verify_cost=_VERIFY_COST.value,
                           tokens_per_dispatch=_TOKENS_PER_DISPATCH.value,
                           prefill_chunk=_PREFILL_CHUNK.value,
                           stream=stream_printer(shown[0] if inline else None, _JSON.value)
                           if stream else None)
  except GenerateError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  for prompt, r in zip(shown, results):
    if _JSON.value:
      print(json.dumps({'prompt': prompt, 'text': r.text, 'tokens': r.tokens,
                        'tokens_per_s': r.tokens_per_s, 'prefill_s': r.prefill_s,
                        'forwards': r.forwards, 'accepted_drafts': r.accepted_drafts}))
    else:
      print('' if inline else f'{prompt}{r.text}')
      extra = (f', {r.accepted_drafts} drafts accepted in {r.forwards} verifications'
               if _SPECULATIVE.value else '')
      print(f'--- {len(r.tokens)} tokens, {r.tokens_per_s:.1f} tokens/s after compilation '
            f'(prefill {r.prefill_s:.2f} s with compilation){extra}')
  return 0


def run():
  app.run(lambda argv: sys.exit(main(argv)))


if __name__ == '__main__':
  run()
