"""The user's own PUBLIC records (``public_validation``): a file of records from the private data's domain that the
owner may publish, to validate and select on instead of raydp's synthetic public population.

Its form follows the private dataset's: a Diabetes 130-US dataset (synthetic or a real CSV) takes a CSV in the
diabetic_data.csv schema, whose records are verbalised with their value spans (the value-token metric); a free-text
dataset (:mod:`raydp.data.text_source`) takes a table of the same kind (CSV, Parquet or JSON Lines) with the same
text and unit columns, whose texts are scored by perplexity (free text has no value spans).

The records must be apart from the private ones. Refused: a file whose bytes are the private dataset's own source;
one holding a text of any split of the private dataset (the same record under another or a pseudonymised id, ERRATA
E16); one sharing a privacy unit (a patient, a note's patient, a message's user) with any split. Units are compared
the way the dataset stores them (Diabetes ``patient_nbr`` as is; a free-text unit as its 62-bit digest,
:func:`raydp.data.text_source.unit_digest`, of the id as the private source spelled it; a public id is compared in
the spellings another file format or a tidier export gives it: stripped, upper or lower case, an integer without
leading zeros or a trailing ``.0``). The private side keeps its spelling only (its ids are stored as digests), so a
private ``"0042"`` and a public ``42`` still match, but a private ``" 42"`` or ``"42.0"`` and a public ``42`` do not:
the check refuses what it can see, and an owner who exports ids differently must compare them. Texts are compared
after collapsing whitespace. A dataset whose splits cannot be read is an error, never a pass. Whatever passes
is treated as public: its records steer selection and charge nothing (ERRATA E15), so the owner vouches that they
are public; raydp refuses what it can see is not.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from raydp.data.csv_source import load_diabetes_csv
from raydp.data.splits import ALL_SPLITS, UNIT_COLUMN, load_texts, load_units
from raydp.data.text_source import read_text_table, unit_digest
from raydp.data.verbalise import verbalise_records
from raydp.errors import ConfigError, DataError


#: what a run records as its ``public_validation`` when it validated on raydp's own public population
SYNTHETIC_PUBLIC = "synthetic public population"


@dataclass(frozen=True)
class PublicRecords:
    """A ``public_validation`` file read in the form of the private dataset whose manifest is ``manifest``."""

    path: Path
    #: the free-text dataset's ``text_source`` (text and unit column names) or None for the Diabetes schema
    text_source: dict | None

    @classmethod
    def of(cls, source: str | Path, manifest: dict) -> PublicRecords:
        path = Path(source).expanduser()
        if not path.is_file():
            raise ConfigError(f"public_validation: {source} is not a file")
        return cls(path, manifest.get("text_source"))

    @property
    def kind(self) -> str:
        """``"text"`` (a free-text table, scored by perplexity) or ``"records"`` (the Diabetes schema)."""
        return "text" if self.text_source else "records"

    def _table(self):
        """(the records: texts for free text, the records' table for the Diabetes schema; the unit ids as the
        dataset stores them, every spelling of a free-text id included)."""
        try:
            if self.text_source:
                table = read_text_table(self.path, self.text_source["text_column"], self.text_source["unit_column"])
                return table["text"].tolist(), unit_digest(sorted({v for u in table["unit"] for v in spellings(u)}))
            records, _ = load_diabetes_csv(self.path)
            return records, records[UNIT_COLUMN].astype("int64").to_numpy()
        except DataError as exc:
            raise ConfigError(f"public_validation: {exc}") from None

    def texts(self, n_records: int) -> tuple[list[str], list | None]:
        """The first ``n_records`` records as texts, with their value spans (None for free text)."""
        rows, _ = self._table()
        if self.text_source:
            return rows[:n_records], None
        texts, spans = verbalise_records(rows.iloc[:n_records], progress=False, spans=True)
        return texts, spans

    def check_apart(self, dataset_dir: Path, manifest: dict) -> None:
        """Refuse (one line) a file that is the private dataset's own source or shares a unit with any of its
        splits. Run before anything is charged."""
        if manifest.get("source_sha256") == hashlib.sha256(self.path.read_bytes()).hexdigest():
            raise ConfigError(f"public_validation: {self.path} is the private dataset's own source file")
        rows, units = self._table()
        public_units = set(int(u) for u in units)
        texts = rows if self.text_source else verbalise_records(rows, progress=False)  # the file read once
        public_texts = {_digest(t) for t in texts}
        what = "units (the text table's unit column)" if self.text_source else "patients"
        for split in ALL_SPLITS:
            try:  # a split the dataset does not have reads as empty; anything else unreadable fails closed
                private_units, private_texts = load_units(dataset_dir, split), load_texts(dataset_dir, split)
            except (DataError, OSError) as exc:
                raise ConfigError(f"public_validation: cannot compare {self.path} with the private dataset's {split} "
                                  f"split ({' '.join(str(exc).split())[:160]}): nothing was started") from None
            if public_units.intersection(int(u) for u in private_units.tolist()):
                raise ConfigError(f"public_validation: {self.path} shares {what} with the private dataset's {split} "
                                  "split: its records are not public")
            if any(_digest(t) in public_texts for t in private_texts):
                raise ConfigError(f"public_validation: {self.path} holds a text of the private dataset's {split} "
                                  "split (under another unit id?): its records are not public")


def _digest(text: str) -> bytes:
    """A text's digest after collapsing whitespace (a copy re-wrapped or re-indented is the same record)."""
    return hashlib.sha256(" ".join(str(text).split()).encode()).digest()


def spellings(unit) -> set[str]:
    """A unit id as written and as another export may write it: stripped, upper and lower case, and an integer id
    without leading zeros or a trailing ``.0`` (``" 0042 "``, ``"42.0"`` and ``"42"`` all give ``"42"``)."""
    text = str(unit)
    out = {text, text.strip(), text.strip().upper(), text.strip().lower()}
    try:
        number = float(text.strip())
        if number.is_integer():
            out.add(str(int(number)))
    except ValueError:
        pass
    return out
