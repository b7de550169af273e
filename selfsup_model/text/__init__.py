"""Text to ids: special tokens, the tokenizer, encoding, windows and masked-LM corruption."""
