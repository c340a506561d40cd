"""Training data: text, JSONL and chat formats cut into batches (formats) and the tokenizer
(tokenizer). corpus.txt is the built-in default corpus."""
