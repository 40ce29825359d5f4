"""Records of JSONL and Parquet files, one at a time, in bounded memory.

A JSONL file is read a line at a time; a Parquet file (the format of datasets on the Hugging Face
hub) through pyarrow, a batch of rows at a time (`PARQUET_ROWS`, within one row group), only the
columns asked for: a file larger than memory is read in a few megabytes. Each record comes with
where it is (`FILE:LINE`, `FILE row N`), for errors that name it.
"""

from __future__ import annotations

import json
import re

PARQUET_ROWS = 1024  # rows decoded at once
RECORD_FILES = (".jsonl", ".parquet")
INSTALL = "pip install 'paro-jax[hf]' (from a checkout: pip install -e \".[hf]\")"


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_surrogates(where: str, what: str, text: str) -> None:
  """A lone surrogate (JSON's "\\ud800" escape) is no character and has no UTF-8: no tokenizer
  takes it. One line naming the record and the field."""
  if bad := _SURROGATE.search(text):
    raise ValueError(
      f"{where}: {what} holds a lone surrogate ({ascii(bad.group())} at character "
      f"{bad.start()}), which is not text: fix or drop that record"
    )


def preview(value) -> str:
  """The start of a record's field as JSON writes it (bytes and other non-JSON values: their
  repr), for a line naming a field that is not text."""
  try:
    shown = json.dumps(value)
  except (TypeError, ValueError):
    shown = repr(value)
  return shown[:40]


def not_text(where: str, field: str, value, fix: str) -> ValueError:
  """The field `field` of a record is not text (a number, a list, bytes...): one line."""
  kind = type(value).__name__
  if isinstance(value, (bytes, bytearray)):
    fix = f"{fix}; a Parquet column of binary type holds bytes: cast it to string"
  return ValueError(f"{where}: the {field!r} field is {preview(value)} ({kind}), not text: {fix}")


def is_records(path: str) -> bool:
  """Whether `path` holds records (JSONL or Parquet) rather than text or token ids."""
  return path.endswith(RECORD_FILES)


def _parquet(path: str):
  try:
    import pyarrow.parquet as pq  # optional: only for Parquet files
  except ImportError:
    raise ValueError(
      f"{path}: reading Parquet files needs pyarrow, the hf extra: {INSTALL}"
    ) from None
  try:
    return pq.ParquetFile(path)
  except Exception as e:  # pyarrow's ArrowInvalid and friends
    raise ValueError(
      f"{path} is not a readable Parquet file ({e}): pass a *.parquet file"
    ) from None


def parquet_columns(path: str) -> list[str]:
  return list(_parquet(path).schema_arrow.names)


def read_records(path: str, columns=None, progress=None):
  """(where, record) of each record of a JSONL or Parquet file; `columns`: the fields a Parquet
  file's records are read with (None: all); `progress(n)` is called with the bytes read."""
  if path.endswith(".parquet"):
    yield from _parquet_records(path, columns, progress)
    return
  try:
    with open(path, "rb") as f:
      for n, raw in enumerate(f, 1):
        if progress:
          progress(len(raw))
        line = raw.decode("utf-8")
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{n}: not a JSON object ({e.msg})") from e
        if not isinstance(record, dict):
          raise ValueError(f"{path}:{n}: a JSON {type(record).__name__}, not an object")
        yield f"{path}:{n}", record
  except UnicodeDecodeError as e:
    raise ValueError(
      f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x}): pass JSONL in UTF-8"
    ) from None


def _parquet_records(path: str, columns, progress):
  pf = _parquet(path)
  names = pf.schema_arrow.names
  missing = [c for c in columns or () if c not in names]
  if missing:
    raise ValueError(f"{path} has no column {missing[0]!r} (it has {names})")
  row, total = 0, pf.metadata.num_rows
  size = pf.metadata.serialized_size + sum(
    pf.metadata.row_group(i).total_byte_size for i in range(pf.num_row_groups)
  )
  for group in range(pf.num_row_groups):
    batches = pf.iter_batches(batch_size=PARQUET_ROWS, columns=columns, row_groups=[group])
    while True:
      try:  # decoding a page: where a damaged file fails (a bad checksum, garbled compression)
        batch = next(batches, None)
        records = None if batch is None else batch.to_pylist()
      except Exception as e:  # noqa: BLE001 - pyarrow's ArrowInvalid, OSError and friends
        raise _damaged(path, pf, group, e) from None
      if batch is None:
        break
      for record in records:
        yield f"{path} row {row}", record
        row += 1
      if progress and total:
        progress(size * batch.num_rows // total)


def _damaged(path: str, pf, group: int, e: Exception) -> ValueError:
  first = sum(pf.metadata.row_group(g).num_rows for g in range(group))
  last = first + pf.metadata.row_group(group).num_rows - 1
  why = str(e).strip() or type(e).__name__
  return ValueError(
    f"{path}: row group {group} of {pf.num_row_groups} (rows {first}-{last}) cannot be read "
    f"({why}): the file is damaged: download or write it again"
  )


def first_record(path: str) -> tuple[str, dict]:
  """The first record of a records file (for its shape: text, prompt/completion or chat)."""
  for where, record in read_records(path):
    return where, record
  raise ValueError(f"data file {path!r} has no record: give a file with records in it")


def read_texts(path: str, field: str, progress=None):
  """The `field` text of each record of a Parquet file (JSONL: data/streams.py read_jsonl)."""
  if field not in parquet_columns(path):
    raise ValueError(
      f"{path} has no {field!r} column (it has {parquet_columns(path)}): pass --text-field with "
      f"the column that holds the text"
    )
  for where, record in read_records(path, [field], progress):
    text = record[field]
    if not isinstance(text, str):
      fix = "fix or drop that record, or pass --text-field with the column that holds the text"
      raise not_text(where, field, text, fix)
    yield text
