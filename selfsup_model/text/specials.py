"""Special tokens: the one place their strings and ids are defined.

The ids are fixed so that a tokenizer, a stored mask file and a saved model
agree without having to consult each other. `fit_tokenizer` passes this list
to the trainer in this order, which pins the ids below.
"""

from __future__ import annotations

PAD, UNK, CLS, SEP, MASK, BOS, EOS = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[BOS]", "[EOS]"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, UNK, CLS, SEP, MASK, BOS, EOS)

PAD_ID = 0
UNK_ID = 1
CLS_ID = 2
SEP_ID = 3
MASK_ID = 4
BOS_ID = 5
EOS_ID = 6
NUM_SPECIAL = len(SPECIAL_TOKENS)
SPECIAL_IDS: tuple[int, ...] = tuple(range(NUM_SPECIAL))

# Corruption kinds stored per position in val_masks.npz.
CORRUPT_NONE, CORRUPT_MASK, CORRUPT_RANDOM, CORRUPT_UNCHANGED = 0, 1, 2, 3

