"""The data pipeline: text and token streams, tokenizers, .bin shards and prepare-data, instruction
records (JSONL, Parquet), chat templates, examples and their packing, the data's fingerprint.

Below run/ (it imports neither run/ nor cluster/). What a run asks of it: `DataConfig`
(config.py), its batches (streams.py `Batches`, sources.py `instruction_batches`), their
fingerprint (fingerprint.py) and the shards' meta (bins.py); tests/test_layers.py keeps run/'s
imports of it to that named surface.
"""
