"""Prompts as the generate CLI reads them: text with <image> markers, .jsonl files."""

from __future__ import annotations

import json
import os

from deepseek41.generate.generator import GenerateError

IMAGE_MARKER = '<image>'


def with_images(text: str, images: list, where: str):
  """The prompt's parts: text split at each <image> marker, the images in order."""
  if not images:
    if IMAGE_MARKER in text:
      raise GenerateError(f'{where} has an {IMAGE_MARKER} marker but no image')
    return text
  pieces = text.split(IMAGE_MARKER)
  if len(pieces) == 1:
    pieces = ['', text]
  if len(pieces) - 1 != len(images):
    raise GenerateError(f'{where}: {len(pieces) - 1} {IMAGE_MARKER} markers for {len(images)} '
                        'images')
  parts = [{'text': pieces[0]}] if pieces[0] else []
  for image, piece in zip(images, pieces[1:]):
    parts.append({'image': image})
    if piece:
      parts.append({'text': piece})
  return parts


def read_prompts(path: str) -> list:
  """The prompts of a .jsonl file: {"prompt": ..., "images": [...]} per line."""
  try:
    lines = open(path, encoding='utf-8').read().splitlines()
  except OSError as e:
    raise GenerateError(f'--prompts={path}: {e.strerror or e}') from None
  prompts = []
  for i, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      obj = json.loads(line)
      text = obj['prompt'] if isinstance(obj, dict) else None
    except (json.JSONDecodeError, KeyError):
      text = None
    if not isinstance(text, str):
      raise GenerateError(f'--prompts={path} line {i}: expected {{"prompt": "..."}}')
    images = [p if os.path.isabs(p) else os.path.join(os.path.dirname(os.path.abspath(path)), p)
              for p in obj.get('images', [])]
    prompts.append(with_images(text, images, f'--prompts={path} line {i}'))
  if not prompts:
    raise GenerateError(f'--prompts={path} holds no prompt')
  return prompts
