"""Training data: corpora and their decoding, tokenizers, packing and validation windows (grain).

  files        reading and checking text / JSON-lines files, one-line data errors
  tokenizers   the byte tokenizer and Hugging Face / SentencePiece ones
  pipeline     sources (stdlib, files, tfds), packed batch iterators, validation windows
  fingerprint  the training files' names and sizes: what a saved data position belongs to
"""
