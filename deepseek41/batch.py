"""The batch contract shared by the data pipeline and the model (docs/design.md, "Batches").

Text fields, int32 [B, T]:

    tokens       input ids (0 in padding; model.image_token_id at image-span positions)
    targets      the next token of the same document (0 in padding)
    segment_ids  1, 2, ... per packed piece within a row; 0 = padding
    positions    0, 1, ... restarting at each piece
    loss_mask    1 where targets is a real text token (never an image-span position)
    modality     TEXT or IMAGE (every image-span position, delimiters and alignment pad included)

Image fields, present only when `model.vision` is on (N = data.max_images_per_row,
P = merge^2 * model.vision_max_image_tokens patches, p = model.vision_patch):

    image_role     int32 [B, T]      ROLE_TEXT, or the role of the position inside its span
    image_index    int32 [B, T]      ROLE_PATCH positions: n * M + i * wm + j, the merged token
                                     (i, j) of the row's image slot n (M = vision_max_image_tokens,
                                     wm = ceil(w / merge)); 0 elsewhere
    image_span     int32 [B, T]      1, 2, ... per image span within a row (start, patches,
                                     newlines, end); 0 elsewhere, the alignment pad included
    image_patches  uint8 [B, N, P, p*p*3]  RGB pixels of each patch, (row, col, channel) order
                                     inside a patch; patches in raster order of the image's
                                     patch grid, the first h*w real, the rest 0
    image_grid     int32 [B, N, 2]   (h, w) of each slot's patch grid; (0, 0) = empty slot

Span layout (docs/architecture.md section 3.15), for an image of hm x wm merged tokens:

    [align pad]? [start] ([patch] x wm [newline]) x hm [end]

The alignment pad is present when the span would otherwise start at an odd position of its
document, so no ratio-2 compressed group straddles the span start.
"""

TEXT, IMAGE = 0, 1  # modality ids

TEXT_KEYS = ('tokens', 'targets', 'segment_ids', 'positions', 'loss_mask', 'modality')
IMAGE_KEYS = ('image_role', 'image_index', 'image_span', 'image_patches', 'image_grid')

# image_role values. Delimiters and the alignment pad take learned vectors (in this order, at
# index role - ROLE_START of the vision module's delimiter table); patches take aligner outputs.
ROLE_TEXT, ROLE_START, ROLE_NEWLINE, ROLE_END, ROLE_ALIGN, ROLE_PATCH = 0, 1, 2, 3, 4, 5
NUM_DELIMITERS = 4  # start, newline, end, alignment pad


def batch_keys(vision: bool) -> tuple[str, ...]:
  return TEXT_KEYS + (IMAGE_KEYS if vision else ())


def span_length(hm: int, wm: int) -> int:
  """Positions of an image span without its alignment pad: start + hm * (wm + 1) + end."""
  return hm * (wm + 1) + 2


def max_span_positions(max_image_tokens: int) -> int:
  """The longest span any image can take, alignment pad included (a 1-wide column is worst)."""
  return span_length(max_image_tokens, 1) + 1
