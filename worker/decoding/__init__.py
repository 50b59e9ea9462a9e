"""Decoding methods a worker runs one session at a time (classic draft models, cross-tokenizer drafts), plain decoding as their reference, and the `Step` contract every method yields."""
