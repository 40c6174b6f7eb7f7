"""Training data: what it reads (sources), what it makes (pipeline), and the tokenizers between (grain).

  sources      what is read: one function per data.source (stdlib, files, tfds), the
               files' decoding and start-up checks, one-line data errors
  pipeline     what is made: tokens packed into batches, the batch iterator and its
               state, validation windows
  tokenizers   the byte tokenizer and Hugging Face / SentencePiece ones
  fingerprint  the training files' names and sizes: what a saved data position belongs to
"""
